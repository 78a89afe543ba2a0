"""SPMD rules: how each primitive runs on local shards, and which collectives it needs.

A rule takes (ctx, eqn, [(local array, layout), ...]) and returns the outputs as
[(local array, layout), ...]. `@rule(prim, ...)` files it in `SPMD_RULES`, keyed by
the primitive object (as jax keeps one table of lowerings per interpreter).
Primitives without a rule of their own use `elementwise_rule` when they declare
`elementwise`, else `replicated_rule`: gather every input, run the op whole, leave
the result replicated (correct for every primitive, and the baseline the others
improve on).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from lowering import collectives as col
from lowering import expert_routes
from lowering.caches import per_object
from lowering.cost import traffic
from lowering.layout import local_shape
from lowering.plan import nbytes
from namedmesh.elementwise import align
from namedmesh.ordering import lowest, sort_key
from namedmesh.primitive import REGISTRY, Primitive, is_inexact
from namedmesh.reductions import finite_shift

SPMD_RULES: dict[Primitive, Callable] = {}
# The rules that plan without jax: written against the context's operations alone
# (lowering/plan.py RuleContext), they run in the Planner on abstract local values as
# well as traced. The one place that says which rules are pure; a program every op of
# which has one is planned by the Planner (`plannable`).
PLAN_RULES: dict[Primitive, Callable] = {}

# The primitives the rules of this package lower, by their registry entries (a KeyError
# at import is a primitive that was renamed or removed).
P = SimpleNamespace(**REGISTRY)


def rule(*prims: Primitive, pure: bool = False):
    """File the decorated function as the SPMD rule of `prims` in `SPMD_RULES`, and in
    `PLAN_RULES` too when it is `pure` (uses the context's operations alone)."""

    def register(fn):
        for p in prims:
            SPMD_RULES[p] = fn
            if pure:
                PLAN_RULES[p] = fn
        return fn

    return register


def plan_rule(*prims: Primitive):
    """File the decorated function as the plan rule of `prims` alone, for a primitive
    whose traced rule and plan rule differ (nm.scan's)."""

    def register(fn):
        PLAN_RULES.update((p, fn) for p in prims)
        return fn

    return register


def rule_for(prim: Primitive) -> Callable:
    """The SPMD rule that lowers `prim`: its own, else by its declared flags."""
    if prim in SPMD_RULES:
        return SPMD_RULES[prim]
    return elementwise_rule if prim.elementwise else replicated_rule


def plan_rule_for(prim: Primitive) -> Callable:
    """The rule that plans `prim` without jax (KeyError: it has none)."""
    return PLAN_RULES[prim] if prim in SPMD_RULES else rule_for(prim)


def plannable(graph) -> bool:
    """Whether every op of `graph` (and of its scans' bodies) has a plan rule, under any
    layout: a scan whose scanned dim the layout splits (a pipeline, lowering/pipeline.py)
    is planned too. False only for a primitive registered with an impure rule."""
    for e in graph.eqns:
        if e.primitive in SPMD_RULES and e.primitive not in PLAN_RULES:
            return False
        if e.primitive.loop and not plannable(e.params["body"]):
            return False
    return True


def replicated_rule(ctx, eqn, args):
    """Every input gathered, the op run whole, the result replicated."""
    xs = [ctx.relayout(x, lay, ((),) * len(lay)) for x, lay in args]
    outs = ctx.local(eqn.primitive, *xs, **eqn.params)
    outs = outs if eqn.primitive.multiple_results else (outs,)
    return [(o, ((),) * len(v.dims)) for o, v in zip(outs, eqn.outputs, strict=True)]


def _layout_in(dims, layout_of):
    return tuple([layout_of.get(d, ()) for d in dims])


def elementwise_rule(ctx, eqn, args):
    """Inputs relaid to the output's layout; the op runs on matching shards. An output
    whose dims conflict under the rules (`ctx.free`) takes the layout of the first input
    with its dims, so that e.g. an expert FFN's activation stays where its einsum put it."""
    (out,) = eqn.outputs
    want = ctx.wanted[out]
    if out in ctx.free:
        same = (lay for (_, lay), v in zip(args, eqn.inputs, strict=True) if v.dims == out.dims)
        want = ctx.wanted[out] = tuple(next(same, None) or ctx.soft_layout(out.dims, out.shape))
    xs, by_dim = [], None
    for i, v in enumerate(eqn.inputs):  # (indexes: zip's strict= costs more than this)
        x, lay = args[i]
        if v.dims == out.dims:  # (most) the output's dims: its layout as it is
            dst = want
        else:
            by_dim = by_dim or dict(zip(out.dims, want, strict=True))
            dst = _layout_in(v.dims, by_dim)
        xs.append(x if lay == dst else ctx.relayout(x, lay, dst))
    return [(ctx.local(eqn.primitive, *xs, **eqn.params), want)]


@rule(P.convert, P.stop_gradient, P.rename, pure=True)
def same_layout_rule(ctx, eqn, args):
    """Ops that act on each element alone and keep the dims' order: any layout will do."""
    ((x, lay),) = args
    return [(ctx.local(eqn.primitive, x, **eqn.params), lay)]


@rule(P.constrain, pure=True)
def constrain_rule(ctx, eqn, args):
    """The value moved to the layout the constraint pins."""
    ((x, lay),) = args
    want = ctx.wanted[eqn.outputs[0]]
    return [(ctx.relayout(x, lay, want), want)]


def _combine(summed, cur, want):
    """How a partial-sum einsum result in layout `cur` is summed over the mesh axes
    `summed`: [(axis, output dim)] to psum_scatter into (an output dim `want` splits by
    that axis next), the axes left to psum, and the layout after both."""
    cur = [tuple(c) for c in cur]
    scatter, reduce = [], []
    for a in summed:
        j = next((j for j, w in enumerate(want) if a in w), None)
        if j is not None and tuple(want[j][: len(cur[j]) + 1]) == cur[j] + (a,):
            scatter.append((a, j))
            cur[j] = cur[j] + (a,)
        else:
            reduce.append(a)
    return scatter, tuple(reduce), tuple(cur)


def _einsum_choices(ctx, eqn):
    """`_choose_einsum_layouts`, kept per equation and what it reads of the context (the
    rules of the einsum's dims, the mesh, the result's wanted layout or that it is free),
    which many candidate layouts share. A strict layout's are not kept: its errors name
    all of its rules."""
    if ctx.layout.strict:
        return _choose_einsum_layouts(ctx, eqn)
    (out,) = eqn.outputs
    dims = _einsum_dims(eqn)
    free = out in ctx.free
    key = (
        tuple(r for r in ctx.layout.rules if r[0] in dims),
        tuple(ctx.sizes.items()),
        free,
        None if free else ctx.wanted[out],
    )
    known = _einsum_kept(eqn)
    if key not in known:
        known[key] = _choose_einsum_layouts(ctx, eqn)
    return known[key]


@per_object
def _einsum_dims(eqn) -> frozenset:
    return frozenset(d for v in eqn.inputs for d in v.dims)


@per_object(kind="layouts")
def _einsum_kept(eqn) -> dict:
    return {}


def _choose_einsum_layouts(ctx, eqn):
    """(compute layout by dim, output layout) per candidate rule order: the rules as
    given, then each dim that shares a mesh axis with another of the einsum's dims and
    that every operand and the result hold (experts, in an expert FFN) moved first.
    Such a dim splits every operand and the result on the axis, so the candidates
    differ only in what moves; promoting a summed dim, or one an operand lacks, would
    leave that operand or the result whole on the axis (FSDP's `batch:data;d_model:data`
    computed d_model-first holds the whole batch's partial sums on every device), a
    memory trade bytes do not weigh. Only candidates that split the einsum by the same
    mesh axes as the first (so the same flops per device) are kept, each distinct
    compute layout once."""
    (out,) = eqn.outputs
    sizes = {d: n for v in eqn.inputs for d, n in zip(v.dims, v.shape, strict=True)}
    all_dims = tuple(dict.fromkeys(d for v in eqn.inputs for d in v.dims))
    shape = [sizes[d] for d in all_dims]
    shared = [d for d in out.dims if all(d in v.dims for v in eqn.inputs)]
    promoted = [d for d in ctx.layout.conflicts(all_dims, ctx.sizes) if d in shared]
    orders = [None] + [ctx.layout.first(d) for d in promoted]
    choices, seen = [], set()
    for rules in orders:
        lay = ctx.soft_layout(all_dims, shape, is_value=False, rules=rules)
        axes = {a for split in lay for a in split}
        if lay in seen or (choices and axes != choices[0][2]):
            continue
        seen.add(lay)
        want = ctx.wanted[out]
        if out in ctx.free:  # not ctx.wanted: a trace before this one may have chosen it
            want = ctx.soft_layout(out.dims, out.shape, rules=rules)
        choices.append((dict(zip(all_dims, lay, strict=True)), want, axes))
    return [(comp, want) for comp, want, _ in choices], all_dims


def _einsum_traffic(ctx, eqn, args, comp, want, all_dims) -> float:
    """Bytes one device sends to compute the einsum in layout `comp` and leave its result
    in `want`: the inputs' relayouts, the psum_scatter and psum of split summed dims, and
    the result's relayout (by the algorithms that run them)."""
    (out,) = eqn.outputs
    total = sum(
        col.relayout_traffic(lay, _layout_in(v.dims, comp), nbytes(x), ctx.sizes)
        for (x, lay), v in zip(args, eqn.inputs, strict=True)
    )
    cur = _layout_in(out.dims, comp)
    size = math.prod(local_shape(cur, out.shape, ctx.mesh)) * out.dtype.itemsize
    summed = [a for d in all_dims if d not in out.dims for a in comp[d]]
    scatter, reduce, cur = _combine(summed, cur, want)
    for a, _ in scatter:
        total += traffic("psum_scatter", (a,), size, ctx.sizes)
        size //= ctx.sizes[a]
    if reduce:
        total += traffic("psum", reduce, size, ctx.sizes)
    return total + col.relayout_traffic(cur, want, size, ctx.sizes)


@rule(P.einsum, pure=True)
def einsum_rule(ctx, eqn, args):
    """Compute layout from the rules over all the einsum's dims (so each mesh axis splits at
    most one of them); a summed dim split on an axis leaves partial sums, combined by
    psum_scatter into an output dim the output wants split on that axis, else by psum.
    Where the rules give several of its dims one mesh axis, the rule order is weighed
    against each such dim that every operand and the result hold taking it first
    (`_einsum_choices`); the one whose moves send the fewest bytes wins (ties: rule
    order), and a result whose own dims conflict keeps its layout (`ctx.free`)."""
    (out,) = eqn.outputs
    choices, all_dims = _einsum_choices(ctx, eqn)
    if len(choices) > 1:
        cost = [_einsum_traffic(ctx, eqn, args, c, w, all_dims) for c, w in choices]
        choices = [choices[cost.index(min(cost))]]  # index: the first of equal costs
    ((comp, want),) = choices
    if out in ctx.free:
        ctx.wanted[out] = want
    ins = eqn.inputs  # (indexes: zip's keyword strict= costs more than this)
    xs = [ctx.relayout(x, lay, _layout_in(ins[i].dims, comp)) for i, (x, lay) in enumerate(args)]
    y = ctx.local(eqn.primitive, *xs, **eqn.params)
    summed = [a for d in all_dims if d not in out.dims for a in comp[d]]
    scatter, reduce, cur = _combine(summed, _layout_in(out.dims, comp), want)
    y = ctx.astype(y, _counts_dtype(y.dtype, summed, ctx.sizes))
    for a, j in scatter:
        y = ctx.psum_scatter(y, (a,), j)
    y = ctx.psum(y, reduce)
    return [(ctx.relayout(ctx.astype(y, out.dtype), cur, want), want)]


def _counts_dtype(dtype, summed, sizes) -> np.dtype:
    """A boolean einsum's partial results (ORs of ANDs) are summed as counts of the shards
    that hold a True, in the narrowest unsigned type that cannot wrap (bool's bytes while
    under 256 shards), so that a psum then a cast to bool is their OR. Integer partial
    sums need nothing: they wrap modulo 2^bits as NumPy's do, and wrapping addition is
    associative."""
    if np.dtype(dtype) != np.dtype(bool) or not summed:
        return np.dtype(dtype)
    return np.dtype(np.uint8 if math.prod(sizes[a] for a in summed) < 256 else np.uint32)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _ties_gradient(x, m, hit, count, axes: tuple[int, ...], split: tuple[str, ...]):
    """`m`, the global extreme of `x` along `axes`, with jax's one-device gradient of
    jnp.max: the cotangent divided by the number of elements equal to the extreme
    (`count`, over all shards), times the float mask `hit` of those elements (so a NaN
    extreme, which no element equals, gives NaN gradients, as on one device). `m`,
    `hit` and `count` carry no gradient."""
    return m


@_ties_gradient.defjvp
def _ties_gradient_jvp(axes, split, primals, tangents):
    x, m, hit, count = primals
    t = tangents[0]
    # psum's transpose is free: no collective is added to the plan's backward pass
    return m, jax.lax.psum(jnp.sum(t * hit, axis=axes), split) / count


def _global_extreme(ctx, prim, x, y, axes: tuple[int, ...], split):
    """max (min) of `x` along `axes` split over the mesh axes `split`, `y` the local
    result: exactly NumPy's (pmax (pmin) of the local extremes: one all-reduce, no value
    through a sum or a float), NaN wherever a shard holds one (XLA's all-reduce max may
    drop a NaN on CPU), and for floats jax's tie gradient. One psum carries the count of
    NaNs (the value needs it) and of elements equal to the extreme (the gradient does)."""
    y = ctx.call(jax.lax.stop_gradient, y, shape=y.shape, dtype=y.dtype)
    m = (ctx.pmax if prim is P.max else ctx.pmin)(y, split)
    if not is_inexact(x.dtype):
        return m
    counts = ctx.call(_ties_and_nans, x, m, axes=axes, shape=(2, *m.shape), dtype=np.int32)
    counts = ctx.psum(counts, split)
    vma = ctx.vma(m) | ctx.vma(counts)  # the extreme's, not x's: its gradient is custom
    return ctx.call(_extreme_with_ties, x, m, counts, axes=axes, split=split, shape=m.shape,
                    dtype=m.dtype, vma=vma)  # fmt: skip


def _ties_and_nans(x, m, axes):
    """Per result element, the local count of elements equal to the extreme `m` and of
    NaNs (int32, stacked)."""
    x0 = jax.lax.stop_gradient(x)
    hit = x0 == jnp.expand_dims(m, axes)
    return jnp.stack([jnp.sum(hit, axis=axes, dtype=jnp.int32),
                      jnp.sum(jnp.isnan(x0), axis=axes, dtype=jnp.int32)])  # fmt: skip


def _extreme_with_ties(x, m, counts, axes, split):
    """The extreme `m`, NaN where a shard held one, with jax's tie gradient from the
    global `counts` of ties and NaNs."""
    ties, nans = counts
    hit = jax.lax.stop_gradient(x) == jnp.expand_dims(m, axes)
    m = jnp.where(nans > 0, jnp.asarray(jnp.nan, m.dtype), m)
    # With a NaN no element equals the extreme: no ties, and NaN gradients, as jax's
    hit = hit & ~jnp.expand_dims(nans > 0, axes)
    ties = jnp.where(nans > 0, 0, ties)
    return _ties_gradient(x, m, hit.astype(x.dtype), ties.astype(x.dtype), axes, split)


def _reduced(eqn, lay):
    axes = eqn.params["axes"]
    split = tuple(a for i in axes for a in lay[i])
    kept = tuple(lay[i] for i in range(len(lay)) if i not in axes)
    return split, kept


_SUMS = (P.sum, P.mean)
_STACKED = {P.any: jnp.any, P.all: jnp.all, P.prod: jnp.prod}  # reduce gathered results


@rule(P.sum, P.max, P.min, P.any, P.all, P.mean, P.logsumexp, P.prod, pure=True)
def reduction_rule(ctx, eqn, args):
    """The reduction on each shard, then combined over the axes that split reduced dims:
    psum for sum (mean divides by the shard count); any, all and prod reduce the
    gathered per-shard results; max and min take the extreme by pmax/pmin of the
    shard results (`_global_extreme`: exact, NaN-propagating, jax's tie gradient);
    logsumexp is `_split_logsumexp`."""
    ((x, lay),) = args
    split, kept = _reduced(eqn, lay)
    prim, out = eqn.primitive, eqn.outputs[0]
    want = ctx.wanted[out]
    if prim is P.logsumexp and split:
        y = _split_logsumexp(ctx, x, eqn.params["axes"], split, out.dtype)
        return [(ctx.relayout(y, kept, want), want)]
    y = ctx.local(prim, x, **eqn.params)
    if prim in _SUMS:
        y = ctx.psum(y, split)
        if prim is P.mean and split:
            k = math.prod(ctx.sizes[a] for a in split)
            y = ctx.call(_divide, y, by=k, to=out.dtype, shape=y.shape, dtype=out.dtype)
    elif prim in _STACKED and split:
        g = ctx.gather_stacked(y, split)
        y = ctx.call(_reduce_stacked, g, reduce=_STACKED[prim], to=out.dtype, shape=y.shape,
                     dtype=out.dtype)  # fmt: skip
    elif prim in (P.max, P.min) and split:
        y = _global_extreme(ctx, prim, x, y, eqn.params["axes"], split)
    return [(ctx.relayout(ctx.astype(y, out.dtype), kept, want), want)]


def _divide(y, by, to):
    return (y / by).astype(to)


def _reduce_stacked(g, reduce, to):
    return reduce(g, axis=0).astype(to)


def _global_max(ctx, x, axes, split, dtype):
    """The max of the local array `x` along `axes` over the devices of `split` (dims kept,
    no gradient), in `dtype`: one pmax per (array, axes) in a trace, shared by softmax,
    log_softmax and logsumexp of one value, as XLA would merge their equal all-reduces."""
    key = (id(x), "global max", axes, split, str(dtype))
    if key not in ctx.moved:
        shape = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
        m = ctx.call(_local_max, x, axes=axes, to=dtype, shape=shape, dtype=dtype)
        ctx.moved[key] = (x, ctx.pmax(m, split))
    return ctx.moved[key][1]


def _local_max(x, axes, to):
    return jax.lax.stop_gradient(jnp.max(x.astype(to), axis=axes, keepdims=True))


def _split_logsumexp(ctx, x, axes, split, dtype):
    """scipy's logsumexp along dims split over `split`: the global max m (pmax of the
    shards' maxes, no gradient; 0 where infinite) plus log of the psum of the shards'
    sums of exp(x - m). A shard's NaN or inf reaches the psum through exp; an element at
    -inf gets a zero gradient (a per-shard logsumexp would give an all -inf shard NaN)."""
    m = _global_max(ctx, x, axes, split, dtype)
    shape = tuple(n for i, n in enumerate(x.shape) if i not in axes)
    part = ctx.call(_sum_exp, x, m, axes=axes, to=dtype, shape=shape, dtype=dtype)
    total = ctx.psum(part, split)
    return ctx.call(_log_total, m, total, axes=axes, shape=shape, dtype=dtype)


def _finite(m, axes):
    m = jnp.squeeze(m, axes)
    return jnp.where(jnp.isfinite(m), m, jnp.zeros((), m.dtype))


def _sum_exp(x, m, axes, to):
    m = _finite(m, axes)
    return jnp.sum(jnp.exp(x.astype(to) - jnp.expand_dims(m, axes)), axis=axes)


def _log_total(m, total, axes):
    return _finite(m, axes) + jnp.log(total)


# The max each normalization subtracts: softmax all of it (an infinite max gives NaN, as
# scipy's softmax does), log_softmax only a finite one (as scipy's log_softmax does).
_SHIFT = {P.softmax: lambda x, m: x - m, P.log_softmax: finite_shift}


def _sum_shifted_exp(x, m, axes, shift, to):
    return jnp.sum(jnp.exp(shift(x.astype(to), m)), axis=axes, keepdims=True)


def _normalize(x, m, total, shift, to, log: bool):
    shifted = shift(x.astype(to), m)
    return shifted - jnp.log(total) if log else jnp.exp(shifted) / total


@rule(P.softmax, P.log_softmax, pure=True)
def softmax_rule(ctx, eqn, args):
    """Along split dims: the global max (the pmax of the per-shard maxes, without
    gradient) is subtracted (for log_softmax only where it is finite, as scipy does), the
    shards' sums of exponentials are psum-ed; nothing else moves. A NaN or +inf anywhere
    in a row makes the sum NaN or inf, and the row what the reference gives (softmax:
    all NaN)."""
    ((x, lay),) = args
    out = eqn.outputs[0]
    want = ctx.wanted[out]
    axes = eqn.params["axes"]
    split = tuple(a for i in axes for a in lay[i])
    if not split:
        y = ctx.local(eqn.primitive, x, **eqn.params)
        return [(ctx.relayout(y, lay, want), want)]
    m = _global_max(ctx, x, axes, split, out.dtype)
    shift, dt = _SHIFT[eqn.primitive], out.dtype
    shape = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
    total = ctx.call(_sum_shifted_exp, x, m, axes=axes, shift=shift, to=dt, shape=shape, dtype=dt)
    total = ctx.psum(total, split)
    total = ctx.varying(total, ctx.vma(x))  # logged: the backward psums its gradient
    y = ctx.call(_normalize, x, m, total, shift=shift, to=dt, log=eqn.primitive is P.log_softmax,
                 shape=x.shape, dtype=dt)  # fmt: skip
    return [(ctx.relayout(y, lay, want), want)]


@rule(P.slice, P.pad, P.split, P.concat, pure=True)
def along_dims_rule(ctx, eqn, args):
    """Ops that act along some dims and are independent across the others: the acted-on
    dims are gathered, every other dim keeps its split, and outputs keep the inputs' dims
    in place (a reduced dim leaves)."""
    p = eqn.params
    if "widths" in p:  # pad
        acted = {i for i, w in enumerate(p["widths"]) if w != (0, 0)}
    else:
        acted = set(p["axes"]) if "axes" in p else {p["axis"]}
    xs, kept = [], None
    for x, lay in args:
        lay2 = tuple(() if i in acted else a for i, a in enumerate(lay))
        if kept is None:
            kept = lay2
        xs.append(ctx.relayout(x, lay, kept))
    outs = ctx.local(eqn.primitive, *xs, **p)
    outs = outs if eqn.primitive.multiple_results else (outs,)
    result = []
    for o, v in zip(outs, eqn.outputs, strict=True):
        lay = (
            kept
            if len(v.dims) == len(kept)
            else tuple(a for i, a in enumerate(kept) if i not in acted)
        )
        want = ctx.wanted[v]
        result.append((ctx.relayout(o, lay, want), want))
    return result


@rule(P.random, pure=True)
def random_rule(ctx, eqn, args):
    """Each device draws only its own block, from the block's global offsets: the values
    equal the single-device ones under every layout, and nothing moves."""
    ((key, lay),) = args
    key = ctx.relayout(key, lay, ((),))
    (out,) = eqn.outputs
    want = ctx.wanted[out]
    local = local_shape(want, out.shape, ctx.mesh)
    p = eqn.params
    index = [ctx.axis_index(axes) for axes in want if axes]
    y = ctx.call(_random_block, key, *index, split=tuple(bool(a) for a in want), block=local,
                 full=p["shape"], dist=p["dist"], to=p["dtype"], params=p["args"],
                 shape=local, dtype=out.dtype)  # fmt: skip
    return [(y, want)]


def _random_block(key, *index, split, block, full, dist, to, params):
    """The block `block` of a draw of shape `full`: each split dim's block starts at this
    device's position (`index`, one per split dim) times the block's size."""
    from namedmesh.random import random_values

    it = iter(index)
    offsets = [next(it) * n if s else 0 for s, n in zip(split, block, strict=True)]
    return random_values(key, full, dist, to, params, xp=jnp, offsets=offsets, shape=block)


@rule(P.full, pure=True)
def full_rule(ctx, eqn, args):
    """Each device makes its block of the constant."""
    (out,) = eqn.outputs
    want = ctx.wanted[out]
    p = eqn.params
    shape = local_shape(want, out.shape, ctx.mesh)
    y = ctx.call(_full, size=shape, value=p["value"], to=p["dtype"], shape=shape, dtype=out.dtype)
    return [(y, want)]


def _full(size, value, to):
    return jnp.full(size, value, to)


@rule(P.iota, pure=True)
def iota_rule(ctx, eqn, args):
    """Each device makes its block of the range, from the block's offset."""
    (out,) = eqn.outputs
    want = ctx.wanted[out]
    (n,) = local_shape(want, out.shape, ctx.mesh)
    offset = (ctx.axis_index(want[0]),) if want[0] else ()
    p = eqn.params
    y = ctx.call(_iota, *offset, n=n, start=p["start"], step=p["step"], to=p["dtype"],
                 shape=(n,), dtype=out.dtype)  # fmt: skip
    return [(y, want)]


def _iota(*offset, n, start, step, to):
    """start + step * (the global positions of this device's block of n), in `to`."""
    off = offset[0] * n if offset else 0
    return (start + step * (jnp.arange(n) + off)).astype(to)


@rule(P.transpose, pure=True)
def transpose_rule(ctx, eqn, args):
    """The shard transposed: each dim keeps its split."""
    ((x, lay),) = args
    perm = eqn.params["perm"]
    y = ctx.local(eqn.primitive, x, **eqn.params)
    out = eqn.outputs[0]
    want = ctx.wanted[out]
    return [(ctx.relayout(y, tuple(lay[i] for i in perm), want), want)]


def _changed_run(v_in, out):
    """(i0, i1, o1): the reshape turns input dims [i0, i1) into output dims [i0, o1);
    the dims before and after the run are the same (name and size) on both sides."""
    a = list(zip(v_in.dims, v_in.shape, strict=True))
    b = list(zip(out.dims, out.shape, strict=True))
    i0 = 0
    while i0 < min(len(a), len(b)) and a[i0] == b[i0]:
        i0 += 1
    tail = 0
    while tail < min(len(a), len(b)) - i0 and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    return i0, len(a) - tail, len(b) - tail


@rule(P.reshape, pure=True)
def reshape_rule(ctx, eqn, args):
    """Dims outside the changed run keep their split. Inside it, a split of its first input
    dim by axes of total size k passes to its first output dim when k divides that dim's
    size: each shard is still one contiguous block. Other splits in the run are gathered."""
    ((x, lay),) = args
    (v_in,), (out,) = eqn.inputs, eqn.outputs
    i0, i1, o1 = _changed_run(v_in, out)
    first = lay[i0] if i0 < i1 else ()
    k = math.prod(ctx.sizes[a] for a in first)
    keep_first = bool(first) and i0 < o1 and out.shape[i0] % k == 0
    src = tuple(
        (first if keep_first and i == i0 else ()) if i0 <= i < i1 else a for i, a in enumerate(lay)
    )
    x = ctx.relayout(x, lay, src)
    out_lay = src[:i0] + ((first,) if keep_first else ((),) * (o1 > i0))
    out_lay += ((),) * (o1 - i0 - (o1 > i0)) + src[i1:]
    # the dims outside the run keep the shard's sizes (a pipeline's microbatch cuts one)
    run = local_shape(out_lay[i0:o1], out.shape[i0:o1], ctx.mesh)
    shape = (*x.shape[:i0], *run, *x.shape[i1:])
    y = ctx.local(eqn.primitive, x, shape=shape, dims=eqn.params["dims"])
    want = ctx.wanted[out]
    return [(ctx.relayout(y, out_lay, want), want)]


@rule(P.one_hot, pure=True)
def one_hot_rule(ctx, eqn, args):
    """Each device builds only its block of the new dim: one_hot(index - offset, block)."""
    ((idx, lay),) = args
    out = eqn.outputs[0]
    want = ctx.wanted[out]
    idx = ctx.relayout(idx, lay, want[:-1])
    (n,) = local_shape(want[-1:], out.shape[-1:], ctx.mesh)
    if want[-1]:
        idx = _wide(ctx, idx)
        me = ctx.axis_index(want[-1])
        idx = ctx.call(_minus_block, idx, me, n=n, shape=idx.shape, dtype=idx.dtype)
    p = eqn.params
    return [(ctx.local(eqn.primitive, idx, dim=p["dim"], n=n, dtype=p["dtype"]), want)]


def _wide(ctx, idx):
    """Integer indices of at least 32 bits (`structural.wide_indices`), so that sizes,
    offsets and `idx + n` fit their dtype."""
    return ctx.astype(idx, np.int32) if np.dtype(idx.dtype).itemsize < 4 else idx


def _minus_block(idx, me, n):
    """Indices into this device's block of n (the `me`-th)."""
    return idx - (me * n).astype(idx.dtype)


@rule(P.gather, pure=True)
def gather_rule(ctx, eqn, args):
    """Other dims of the table and the indices' dims take the output's splits. A table
    split along the gathered dim (vocab-parallel embeddings) stays split: each device
    looks up the indices that fall in its block, zeros the rest, and a psum combines."""
    (x, xl), (idx, il) = args
    (vx, vi), (out,) = eqn.inputs, eqn.outputs
    axis = eqn.params["axis"]
    want = ctx.wanted[out]
    by_dim = dict(zip(out.dims, want, strict=True))
    split = tuple(a for a in xl[axis] if not any(a in w for w in want))
    x_lay = tuple(split if i == axis else by_dim.get(d, ()) for i, d in enumerate(vx.dims))
    if split != xl[axis] and xl[axis][: len(split)] != split:
        split, x_lay = (), tuple(() if i == axis else a for i, a in enumerate(x_lay))
    x = ctx.relayout(x, xl, x_lay)
    idx = ctx.relayout(idx, il, _layout_in(vi.dims, by_dim))
    if not split:
        return [(ctx.local(eqn.primitive, x, idx, **eqn.params), want)]
    n = x.shape[axis]
    full = vx.shape[axis]
    idx = _wide(ctx, idx)  # an int8 index + 256 would wrap
    me = ctx.axis_index(split)
    local = ctx.call(_block_indices, idx, me, n=n, full=full, shape=idx.shape, dtype=idx.dtype)
    inside = ctx.call(_in_block, idx, me, n=n, full=full, shape=idx.shape, dtype=bool)
    y = ctx.local(eqn.primitive, x, local, **eqn.params)
    y = ctx.call(_zero_outside, y, inside, dims=vi.dims, out_dims=out.dims, shape=y.shape,
                 dtype=y.dtype)  # fmt: skip
    return [(ctx.psum(y, split), want)]


@rule(P.grouped_matmul, pure=True)
def grouped_matmul_rule(ctx, eqn, args):
    """The rows (the groups' dims) and the weight's output dims take the output's splits,
    contracted dims are gathered. A weight split along its group dim (`experts:<axis>`)
    stays split: each device multiplies the rows whose group falls in its block (the
    others are zero rows, which cost nothing), with the rows whole over those axes, and a
    psum_scatter into the dim the output splits on the axis (else a psum) combines.
    Where the output splits its rows over those axes too, each row goes to its group's
    device and back by all_to_all instead (lowering/expert_routes.py)."""
    (x, xl), (w, wl), (g, gl) = args
    (vx, vw, vg), (out,) = eqn.inputs, eqn.outputs
    dim = eqn.params["dim"]
    axis = vw.dims.index(dim)
    split = tuple(wl[axis])
    want = ctx.wanted[out]
    rows = {a for d, lay in zip(out.dims, want, strict=True) if d in vg.dims for a in lay}
    if split and rows >= set(split):
        return expert_routes.route(ctx, eqn, args, split)
    by_dim = {
        d: tuple(a for a in lay if a not in split) for d, lay in zip(out.dims, want, strict=True)
    }
    w_lay = tuple(split if d == dim else by_dim.get(d, ()) for d in vw.dims)
    w = ctx.relayout(w, wl, w_lay)
    x = ctx.relayout(x, xl, tuple(by_dim.get(d, ()) for d in vx.dims))
    g = ctx.relayout(g, gl, _layout_in(vg.dims, by_dim))
    cur = _layout_in(out.dims, by_dim)
    if not split:
        return [(ctx.relayout(ctx.local(eqn.primitive, x, w, g, **eqn.params), cur, want), want)]
    g = _wide(ctx, g)
    me = ctx.axis_index(split)
    n = w.shape[axis]
    g = ctx.call(_minus_block, g, me, n=n, shape=g.shape, dtype=g.dtype)
    y = ctx.local(eqn.primitive, x, w, g, **eqn.params)
    scatter, reduce, cur = _combine(split, cur, want)  # as a contraction's partial sums
    for a, j in scatter:
        y = ctx.psum_scatter(y, (a,), j)
    return [(ctx.relayout(ctx.psum(y, reduce), cur, want), want)]


@rule(P.update_slice, pure=True)
def update_slice_rule(ctx, eqn, args):
    """The written dim whole on every device, every other dim split as the output wants
    (the starts' dims as the tensor's): each device writes its own rows' windows, no
    collective (a KV cache split over batch or heads writes per shard)."""
    (x, xl), (start, sl), (value, vl) = args
    (vx, vs, _), (out,) = eqn.inputs, eqn.outputs
    axis = eqn.params["axis"]
    want = tuple(() if i == axis else a for i, a in enumerate(ctx.wanted[out]))
    by_dim = dict(zip(vx.dims, want, strict=True))
    x = ctx.relayout(x, xl, want)
    value = ctx.relayout(value, vl, want)
    start = ctx.relayout(start, sl, _layout_in(vs.dims, by_dim))
    y = ctx.local(eqn.primitive, x, start, value, **eqn.params)
    return [(ctx.relayout(y, want, ctx.wanted[out]), ctx.wanted[out])]


def _block_offsets(idx, me, n, full):
    """Indices into this device's block of n, wrapped and clipped as nm.gather does."""
    idx = jnp.clip(jnp.where(idx < 0, idx + full, idx), 0, full - 1)
    return idx - (me * n).astype(idx.dtype)


def _in_block(idx, me, n, full):
    local = _block_offsets(idx, me, n, full)
    return (local >= 0) & (local < n)


def _block_indices(idx, me, n, full):
    """The block's indices where they fall in it, else 0."""
    local = _block_offsets(idx, me, n, full)
    return jnp.where((local >= 0) & (local < n), local, 0)


def _zero_outside(y, inside, dims, out_dims):
    """y where the index fell in this device's block, else 0; `inside` has the indices'
    `dims`, matched to the result's by name."""
    return jnp.where(align(inside, dims, out_dims, jnp), y, jnp.zeros((), y.dtype))


def _ring(axes, sizes, step: int, wrap: bool):
    k = math.prod(sizes[a] for a in axes)
    pairs = [(j, j + step) for j in range(k) if 0 <= j + step < k]
    if wrap:
        pairs += [(j, (j + step) % k) for j in range(k) if not 0 <= j + step < k]
    return pairs


@rule(P.shift, pure=True)
def shift_rule(ctx, eqn, args):
    """Along a split dim, each device sends its edge (|offset| elements) to its neighbour
    with ppermute and shifts locally; the first device (the last, for a negative offset)
    fills, or with `wrap` receives from the other end. Offsets past one shard gather."""
    ((x, lay),) = args
    p = eqn.params
    axis, off = p["axis"], p["offset"]
    axes = lay[axis]
    n = x.shape[axis]
    want = ctx.wanted[eqn.outputs[0]]
    if not p["wrap"] and abs(off) >= eqn.inputs[0].shape[axis]:  # nothing is left but fill
        filled = ctx.call(_filled, x, fill=p["fill"], shape=x.shape, dtype=x.dtype)
        return [(ctx.relayout(filled, lay, want), want)]
    if not axes or abs(off) > n or off == 0:
        return along_dims_rule(ctx, eqn, args)
    k = abs(off)
    lo, hi = (n - k, n) if off > 0 else (0, k)
    edge_shape = x.shape[:axis] + (k,) + x.shape[axis + 1 :]
    edge = ctx.call(_slice, x, lo=lo, hi=hi, axis=axis, shape=edge_shape, dtype=x.dtype)
    ring = _ring(axes, ctx.sizes, 1 if off > 0 else -1, p["wrap"])
    halo = ctx.ppermute(edge, axes, ring)
    if not p["wrap"]:
        me = ctx.axis_index(axes)
        end = 0 if off > 0 else math.prod(ctx.sizes[a] for a in axes) - 1
        halo = ctx.call(_fill_at, halo, me, end=end, fill=p["fill"], shape=halo.shape,
                        dtype=halo.dtype)  # fmt: skip
    y = ctx.call(_shifted, x, halo, k=k, axis=axis, forward=off > 0, shape=x.shape,
                 dtype=x.dtype)  # fmt: skip
    return [(ctx.relayout(y, lay, want), want)]


def _filled(x, fill):
    return jnp.full_like(x, fill)


def _slice(x, lo, hi, axis):
    return jax.lax.slice_in_dim(x, lo, hi, axis=axis)


def _fill_at(halo, me, end, fill):
    """The halo, or `fill` on the device at the end that receives nothing."""
    return jnp.where(me == end, jnp.full_like(halo, fill), halo)


def _shifted(x, halo, k, axis, forward: bool):
    """The shard shifted by k along `axis`, the neighbour's `halo` entering at one end."""
    n = x.shape[axis]
    if forward:
        return jnp.concatenate([halo, jax.lax.slice_in_dim(x, 0, n - k, axis=axis)], axis=axis)
    return jnp.concatenate([jax.lax.slice_in_dim(x, k, n, axis=axis), halo], axis=axis)


@rule(P.top_k, P.argmax, P.argmin, pure=True)
def top_k_rule(ctx, eqn, args):
    """Along a split dim: the local top_k (argmax) with global indices, the candidates of
    all shards gathered in shard order, and a final top_k (argmax) over them. Both rank by
    `sort_key` (NumPy's order: NaN first, -0.0 tied with 0.0) and lax.top_k keeps the
    lower index first on ties, so ties go to the first global index; the values are
    gathered as they are and keyed again after the gather."""
    ((x, lay),) = args
    p = eqn.params
    axis = p["axis"]
    axes = lay[axis]
    k = p.get("k", 1)
    if not axes or x.shape[axis] < k:
        return along_dims_rule(ctx, eqn, args)
    kw = {"axis": axis, "k": k, "largest": eqn.primitive is not P.argmin}
    shape = x.shape[:axis] + x.shape[axis + 1 :] + (k,)
    vals = ctx.call(_local_top, x, **kw, shape=shape, dtype=x.dtype)
    me = ctx.axis_index(axes)
    idx = ctx.call(_local_top_index, x, me, **kw, shape=shape, dtype=np.int32)
    vals = ctx.gather_stacked(vals, axes)  # [shards, ..., k]
    idx = ctx.gather_stacked(idx, axes)
    kept = tuple(() if i == axis else a for i, a in enumerate(lay))
    best = x.shape[:axis] + (k,) + x.shape[axis + 1 :]
    if eqn.primitive is P.top_k:
        outs = [ctx.call(_best, vals, vals, **kw, shape=best, dtype=x.dtype),
                ctx.call(_best, vals, idx, **kw, shape=best, dtype=np.int32)]  # fmt: skip
        return [
            (ctx.relayout(o, kept, ctx.wanted[v]), ctx.wanted[v])
            for o, v in zip(outs, eqn.outputs, strict=True)
        ]
    lay_out = tuple(a for i, a in enumerate(lay) if i != axis)
    want = ctx.wanted[eqn.outputs[0]]
    first = ctx.call(_best_first, vals, idx, **kw, shape=shape[:-1], dtype=np.int32)
    return [(ctx.relayout(first, lay_out, want), want)]


def _local_ranked(x, axis, k, largest):
    """(x with `axis` last, the positions of its top k along it)."""
    xm = jnp.moveaxis(x, axis, -1)
    return xm, jax.lax.top_k(sort_key(xm, largest), k)[1]


def _local_top(x, axis, k, largest):
    xm, idx = _local_ranked(x, axis, k, largest)
    return jnp.take_along_axis(xm, idx, axis=-1)


def _local_top_index(x, me, axis, k, largest):
    """The local top k's global indices along `axis`."""
    _, idx = _local_ranked(x, axis, k, largest)
    return idx + me * x.shape[axis]


def _best(vals, what, axis, k, largest):
    """`what` (the gathered values or indices) at the top k of the gathered values, with
    the ranked dim back at `axis`."""
    merged = [jnp.moveaxis(a, 0, -2).reshape(a.shape[1:-1] + (-1,)) for a in (vals, what)]
    _, pos = jax.lax.top_k(sort_key(merged[0], largest), k)
    return jnp.moveaxis(jnp.take_along_axis(merged[1], pos, axis=-1), -1, axis)


def _best_first(vals, idx, axis, k, largest):
    """The global index of the extreme (argmax, argmin), int32."""
    return jnp.moveaxis(_best(vals, idx, axis, k, largest), axis, -1)[..., 0].astype(jnp.int32)


@rule(P.cumsum, pure=True)
def cumsum_rule(ctx, eqn, args):
    """Along a split dim: the local running sum plus the totals of the shards before this
    one (after it, for `reverse`), from the gathered per-shard totals."""
    ((x, lay),) = args
    p = eqn.params
    axis, axes = p["axis"], lay[p["axis"]]
    if not axes:
        return along_dims_rule(ctx, eqn, args)
    y = ctx.local(eqn.primitive, x, **p)
    shape = tuple(1 if i == axis else n for i, n in enumerate(x.shape))
    totals = ctx.call(_total, x, axis=axis, to=y.dtype, shape=shape, dtype=y.dtype)
    totals = ctx.gather_stacked(totals, axes)
    totals = ctx.varying(totals, ctx.vma(y))  # logged: the backward psums its gradient
    me = ctx.axis_index(axes)
    y = ctx.call(_plus_before, y, totals, me, reverse=p["reverse"], shape=y.shape, dtype=y.dtype)
    want = ctx.wanted[eqn.outputs[0]]
    return [(ctx.relayout(y, lay, want), want)]


def _total(x, axis, to):
    return jnp.sum(x.astype(to), axis=axis, keepdims=True)


def _plus_before(y, totals, me, reverse: bool):
    """y plus the gathered `totals` of the shards before device `me` (after, reversed)."""
    shard = jnp.arange(totals.shape[0]).reshape((-1,) + (1,) * y.ndim)
    before = (shard > me) if reverse else (shard < me)
    return y + jnp.sum(jnp.where(before, totals, 0), axis=0).astype(y.dtype)


def _halo_extend(ctx, x, axis: int, axes, left: int, right: int, fill):
    """x with `left` elements of the previous shard before it and `right` of the next after
    it along `axis` (split by `axes`), by ppermute; the first and last shards get `fill`."""
    if not (left or right):
        return x
    k = math.prod(ctx.sizes[a] for a in axes)
    me = ctx.axis_index(axes)
    n = x.shape[axis]
    edge = lambda lo, hi: ctx.call(
        _slice,
        x,
        lo=lo,
        hi=hi,
        axis=axis,
        dtype=x.dtype,
        shape=x.shape[:axis] + (hi - lo,) + x.shape[axis + 1 :],
    )
    parts = []
    if left:
        halo = ctx.ppermute(edge(n - left, n), axes, [(j, j + 1) for j in range(k - 1)])
        parts.append(ctx.call(_fill_at, halo, me, end=0, fill=fill, shape=halo.shape,
                              dtype=halo.dtype))  # fmt: skip
    parts.append(x)
    if right:
        halo = ctx.ppermute(edge(0, right), axes, [(j + 1, j) for j in range(k - 1)])
        parts.append(ctx.call(_fill_at, halo, me, end=k - 1, fill=fill, shape=halo.shape,
                              dtype=halo.dtype))  # fmt: skip
    shape = x.shape[:axis] + (n + left + right,) + x.shape[axis + 1 :]
    return ctx.call(_concat, *parts, axis=axis, shape=shape, dtype=x.dtype)


def _concat(*parts, axis):
    return jnp.concatenate(parts, axis=axis)


def _halos(ctx, lay, shape, axes, spans, strides, pads):
    """Per spatial axis split in `lay`: (left, right) halos when each shard's output block
    needs only its neighbours' edges (out * stride == size, halos within one shard)."""
    halos = {}
    for a, span, s, (lo, hi) in zip(axes, spans, strides, pads, strict=True):
        if not lay[a]:
            continue
        k = math.prod(ctx.sizes[m] for m in lay[a])
        n_out = (shape[a] + lo + hi - span) // s + 1
        n = shape[a] // k
        right = span - s - lo
        if n_out * s != shape[a] or n_out % k or not 0 <= lo <= n or not 0 <= right <= n:
            return None
        halos[a] = (lo, right)
    return halos


@rule(P.conv, pure=True)
def conv_rule(ctx, eqn, args):
    """Along split spatial dims each device extends its block by its neighbours' edges
    (ppermute) and convolves it without padding; batch dims keep their splits, channel and
    window dims are gathered, the kernel's feature dims take the output's splits. Other
    cases (strides that do not tile the shards) run replicated."""
    (x, xl), (k, kl) = args
    (vx, vk), (out,) = eqn.inputs, eqn.outputs
    p = eqn.params
    sp = dict(p["spatial"])
    axes = [vx.dims.index(d) for d in sp]
    spans = [
        dl * (vk.shape[vk.dims.index(w)] - 1) + 1
        for w, dl in zip(sp.values(), p["dilations"], strict=True)
    ]
    shared = set(vx.dims) & set(vk.dims)
    x_lay = tuple(() if d in shared else a for d, a in zip(vx.dims, xl, strict=True))
    halos = _halos(ctx, x_lay, vx.shape, axes, spans, p["strides"], p["pads"])
    if halos is None:
        return replicated_rule(ctx, eqn, args)
    used = {m for a in x_lay for m in a}
    want = dict(zip(out.dims, ctx.wanted[out], strict=True))
    k_lay = tuple(
        want.get(d, ())
        if d not in shared and d not in sp.values() and not used & set(want.get(d, ()))
        else ()
        for d in vk.dims
    )
    x = ctx.relayout(x, xl, x_lay)
    k = ctx.relayout(k, kl, k_lay)
    pads = list(p["pads"])
    for i, a in enumerate(axes):
        if a in halos:
            x = _halo_extend(ctx, x, a, x_lay[a], *halos[a], fill=0)
            pads[i] = (0, 0)
    y = ctx.local(eqn.primitive, x, k, **{**p, "pads": tuple(pads)})
    by_dim = {**dict(zip(vx.dims, x_lay, strict=True)), **dict(zip(vk.dims, k_lay, strict=True))}
    lay = tuple(by_dim.get(d, ()) for d in out.dims)
    return [(ctx.relayout(y, lay, ctx.wanted[out]), ctx.wanted[out])]


@rule(P.pool, pure=True)
def pool_rule(ctx, eqn, args):
    """Pooling along split dims: halos from the neighbours as for conv, filled with the
    identity of the reduction (-inf for max, 0 for mean) at the ends."""
    ((x, lay),) = args
    (v,), (out,) = eqn.inputs, eqn.outputs
    p = eqn.params
    halos = _halos(ctx, lay, v.shape, p["axes"], p["windows"], p["strides"], p["pads"])
    if halos is None:
        return replicated_rule(ctx, eqn, args)
    fill = lowest(x.dtype) if p["kind"] == "max" else 0
    pads = list(p["pads"])
    for i, a in enumerate(p["axes"]):
        if a in halos:
            x = _halo_extend(ctx, x, a, lay[a], *halos[a], fill=fill)
            pads[i] = (0, 0)
    y = ctx.local(eqn.primitive, x, **{**p, "pads": tuple(pads)})
    return [(ctx.relayout(y, lay, ctx.wanted[out]), ctx.wanted[out])]


@rule(P.stack, pure=True)
def stack_rule(ctx, eqn, args):
    """Inputs take the output's splits of their dims; the new leading dim starts whole."""
    out = eqn.outputs[0]
    want = ctx.wanted[out]
    xs = [ctx.relayout(x, lay, want[1:]) for x, lay in args]
    y = ctx.local(eqn.primitive, *xs, **eqn.params)
    return [(ctx.relayout(y, ((),) + want[1:], want), want)]


@rule(P.squeeze, pure=True)
def squeeze_rule(ctx, eqn, args):
    """The size-1 dims leave the shard; the others keep their split (a dim of size 1 is
    never split, since no mesh axis of more than one device divides it)."""
    ((x, lay),) = args
    axes = eqn.params["axes"]
    whole = tuple(() if i in axes else a for i, a in enumerate(lay))
    y = ctx.local(eqn.primitive, ctx.relayout(x, lay, whole), **eqn.params)
    out = eqn.outputs[0]
    kept = tuple(a for i, a in enumerate(lay) if i not in axes)
    return [(ctx.relayout(y, kept, ctx.wanted[out]), ctx.wanted[out])]


@rule(P.expand_dims, pure=True)
def expand_dims_rule(ctx, eqn, args):
    """The old dims take the output's splits; each device repeats its values over its
    block of the new dims (their values are the same everywhere), moving nothing."""
    ((x, lay),) = args
    out = eqn.outputs[0]
    want = ctx.wanted[out]
    new = eqn.params["new"]
    k = len(new)
    x = ctx.relayout(x, lay, want[k:])
    local = local_shape(want[:k], tuple(n for _, n in new), ctx.mesh)
    local_new = tuple((d, n) for (d, _), n in zip(new, local, strict=True))
    return [(ctx.local(eqn.primitive, x, new=local_new), want)]


@rule(P.var, P.std, pure=True)
def moment_rule(ctx, eqn, args):
    """Along split dims, in two passes as on one device: the global mean (psum of the
    shards' sums over the count), then the psum of the shards' sums of squared
    deviations from it, over count - ddof; std is its square root. All of it is the
    rule's own arithmetic (`ctx.call`), so the step is costed by the primitive's cost
    rule on the shards (lower.cost_own_arithmetic), as a softmax along a split dim is:
    with the sums run as local ops, only they were costed, half the work."""
    ((x, lay),) = args
    split, kept = _reduced(eqn, lay)
    (v,), (out,) = eqn.inputs, eqn.outputs
    want = ctx.wanted[out]
    if not split:
        y = ctx.local(eqn.primitive, x, **eqn.params)
        return [(ctx.relayout(y, kept, want), want)]
    axes, ddof, dt = eqn.params["axes"], eqn.params["ddof"], out.dtype
    count = math.prod(v.shape[i] for i in axes)
    x = ctx.astype(x, dt)
    reduced = tuple(n for i, n in enumerate(x.shape) if i not in axes)
    total = ctx.psum(ctx.call(_sum, x, axes=axes, shape=reduced, dtype=dt), split)
    shape = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
    mean = ctx.call(_expanded_mean, total, count=count, axes=axes, shape=shape, dtype=dt)
    mean = ctx.varying(mean, ctx.vma(x))
    squares = ctx.call(_squared_deviations, x, mean, axes=axes, shape=reduced, dtype=dt)
    squares = ctx.psum(squares, split)
    root = eqn.primitive is P.std
    y = ctx.call(_moment, squares, n=count - ddof, root=root, to=dt, shape=squares.shape, dtype=dt)
    return [(ctx.relayout(y, kept, want), want)]


def _expanded_mean(total, count, axes):
    return jnp.expand_dims(total / count, axes)


def _sum(x, axes):
    return jnp.sum(x, axis=axes)


def _squared_deviations(x, mean, axes):
    return jnp.sum(jnp.square(x - mean), axis=axes)


def _moment(squares, n, root: bool, to):
    y = squares / jnp.maximum(n, 0)
    return (jnp.sqrt(y) if root else y).astype(to)
