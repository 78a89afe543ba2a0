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

from lowering import collectives as col
from lowering.cost import traffic
from lowering.layout import local_shape
from namedmesh.elementwise import align
from namedmesh.ordering import lowest, sort_key
from namedmesh.primitive import REGISTRY, Primitive
from namedmesh.reductions import finite_shift
from namedmesh.structural import wide_indices

SPMD_RULES: dict[Primitive, Callable] = {}

# The primitives the rules of this package lower, by their registry entries (a KeyError
# at import is a primitive that was renamed or removed).
P = SimpleNamespace(**REGISTRY)


def rule(*prims: Primitive):
    """File the decorated function as the SPMD rule of `prims` in `SPMD_RULES`."""

    def register(fn):
        for p in prims:
            SPMD_RULES[p] = fn
        return fn

    return register


def rule_for(prim: Primitive) -> Callable:
    """The SPMD rule that lowers `prim`: its own, else by its declared flags."""
    if prim in SPMD_RULES:
        return SPMD_RULES[prim]
    return elementwise_rule if prim.elementwise else replicated_rule


def replicated_rule(ctx, eqn, args):
    xs = [ctx.relayout(x, lay, ((),) * len(lay)) for x, lay in args]
    outs = ctx.local(eqn.primitive, *xs, **eqn.params)
    outs = outs if eqn.primitive.multiple_results else (outs,)
    return [(o, ((),) * len(v.dims)) for o, v in zip(outs, eqn.outputs, strict=True)]


def _layout_in(dims, layout_of):
    return tuple(layout_of.get(d, ()) for d in dims)


def elementwise_rule(ctx, eqn, args):
    """Inputs relaid to the output's layout; the op runs on matching shards. An output
    whose dims conflict under the rules (`ctx.free`) takes the layout of the first input
    with its dims, so that e.g. an expert FFN's activation stays where its einsum put it."""
    (out,) = eqn.outputs
    want = ctx.wanted[out]
    if out in ctx.free:
        same = (lay for (_, lay), v in zip(args, eqn.inputs, strict=True) if v.dims == out.dims)
        want = ctx.wanted[out] = tuple(next(same, None) or ctx.soft_layout(out.dims, out.shape))
    by_dim = dict(zip(out.dims, want, strict=True))
    xs = [
        ctx.relayout(x, lay, _layout_in(v.dims, by_dim))
        for (x, lay), v in zip(args, eqn.inputs, strict=True)
    ]
    return [(ctx.local(eqn.primitive, *xs, **eqn.params), want)]


@rule(P.convert, P.stop_gradient, P.rename)
def same_layout_rule(ctx, eqn, args):
    """Ops that act on each element alone and keep the dims' order: any layout will do."""
    ((x, lay),) = args
    return [(ctx.local(eqn.primitive, x, **eqn.params), lay)]


@rule(P.constrain)
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
        col.relayout_traffic(lay, _layout_in(v.dims, comp), col.nbytes(x), ctx.sizes)
        for (x, lay), v in zip(args, eqn.inputs, strict=True)
    )
    cur = _layout_in(out.dims, comp)
    nbytes = math.prod(local_shape(cur, out.shape, ctx.mesh)) * out.dtype.itemsize
    summed = [a for d in all_dims if d not in out.dims for a in comp[d]]
    scatter, reduce, cur = _combine(summed, cur, want)
    for a, _ in scatter:
        total += traffic("psum_scatter", (a,), nbytes, ctx.sizes)
        nbytes //= ctx.sizes[a]
    if reduce:
        total += traffic("psum", reduce, nbytes, ctx.sizes)
    return total + col.relayout_traffic(cur, want, nbytes, ctx.sizes)


@rule(P.einsum)
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
    xs = [
        ctx.relayout(x, lay, _layout_in(v.dims, comp))
        for (x, lay), v in zip(args, eqn.inputs, strict=True)
    ]
    y = ctx.local(eqn.primitive, *xs, **eqn.params)
    summed = [a for d in all_dims if d not in out.dims for a in comp[d]]
    scatter, reduce, cur = _combine(summed, _layout_in(out.dims, comp), want)
    y = _as_counts(y, summed, ctx.sizes)
    for a, j in scatter:
        y = col.psum_scatter(y, (a,), j, ctx.log)
    y = col.psum(y, reduce, ctx.log)
    return [(ctx.relayout(_from_counts(y, out.dtype), cur, want), want)]


def _from_counts(y, dtype):
    """A combined einsum result in its dtype (a boolean one from its counts)."""
    return y.astype(dtype) if y.dtype != dtype else y


def _as_counts(y, summed, sizes):
    """A boolean einsum's partial results (ORs of ANDs) as counts of the shards that hold
    a True, in the narrowest unsigned type that cannot wrap (bool's bytes while under 256
    shards), so that a psum then a cast to bool is their OR. Integer partial sums need
    nothing: they wrap modulo 2^bits as NumPy's do, and wrapping addition is associative."""
    if y.dtype != jnp.bool_ or not summed:
        return y
    return y.astype(jnp.uint8 if math.prod(sizes[a] for a in summed) < 256 else jnp.uint32)


def _extreme(name: str, y, axes, log):
    """The elementwise max (min) of `y` over the devices along `axes`: pmax (pmin), one
    all-reduce of `y` where a gather would send (n-1) times its bytes. Exact for every
    dtype; a NaN may be dropped (XLA's all-reduce max does on CPU): see `_global_extreme`."""
    return (col.pmax if name == "max" else col.pmin)(y, axes, log)


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


def _global_extreme(name: str, x, y, axes: tuple[int, ...], split, log):
    """max (min) of `x` along `axes` split over the mesh axes `split`, `y` the local
    result: exactly NumPy's (pmax of the local extremes, no value through a sum or a
    float), NaN wherever a shard holds one, and for floats jax's tie gradient. One psum
    carries the count of NaNs (the value needs it) and of elements equal to the extreme
    (the gradient does)."""
    m = _extreme(name, jax.lax.stop_gradient(y), split, log)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return m
    x0 = jax.lax.stop_gradient(x)
    hit = x0 == jnp.expand_dims(m, axes)
    counts = jnp.stack([jnp.sum(hit, axis=axes, dtype=jnp.int32),
                        jnp.sum(jnp.isnan(x0), axis=axes, dtype=jnp.int32)])  # fmt: skip
    ties, nans = col.psum(counts, split, log)
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


@rule(P.sum, P.max, P.min, P.any, P.all, P.mean, P.logsumexp, P.prod)
def reduction_rule(ctx, eqn, args):
    """The reduction on each shard, then combined over the axes that split reduced dims:
    psum for sum (mean divides by the shard count); any, all and prod reduce the
    gathered per-shard results; max and min take the extreme by pmax/pmin of the
    shard results (`_global_extreme`: exact, NaN-propagating, jax's tie gradient);
    logsumexp is `_split_logsumexp`."""
    ((x, lay),) = args
    split, kept = _reduced(eqn, lay)
    name, out = eqn.primitive.name, eqn.outputs[0]
    want = ctx.wanted[out]
    if name == "logsumexp" and split:
        y = _split_logsumexp(ctx, x, eqn.params["axes"], split, out.dtype)
        return [(ctx.relayout(y, kept, want), want)]
    y = ctx.local(eqn.primitive, x, **eqn.params)
    if name in ("sum", "mean"):
        y = col.psum(y, split, ctx.log)
        if name == "mean" and split:
            y = y / math.prod(ctx.sizes[a] for a in split)
    elif name in ("any", "all", "prod") and split:
        y = getattr(jnp, name)(col.gather_stacked(y, split, ctx.log), axis=0)
    elif name in ("max", "min") and split:
        y = _global_extreme(name, x, y, eqn.params["axes"], split, ctx.log)
    return [(ctx.relayout(y.astype(out.dtype), kept, want), want)]


def _global_max(ctx, x, axes, split, dtype):
    """The max of the local array `x` along `axes` over the devices of `split` (dims kept,
    no gradient), in `dtype`: one pmax per (array, axes) in a trace, shared by softmax,
    log_softmax and logsumexp of one value, as XLA would merge their equal all-reduces."""
    key = (id(x), "global max", axes, split, str(dtype))
    if key not in ctx.moved:
        m = jax.lax.stop_gradient(jnp.max(x.astype(dtype), axis=axes, keepdims=True))
        ctx.moved[key] = (x, _extreme("max", m, split, ctx.log))
    return ctx.moved[key][1]


def _split_logsumexp(ctx, x, axes, split, dtype):
    """scipy's logsumexp along dims split over `split`: the global max m (pmax of the
    shards' maxes, no gradient; 0 where infinite) plus log of the psum of the shards'
    sums of exp(x - m). A shard's NaN or inf reaches the psum through exp; an element at
    -inf gets a zero gradient (a per-shard logsumexp would give an all -inf shard NaN)."""
    m = jnp.squeeze(_global_max(ctx, x, axes, split, dtype), axes)
    x = x.astype(dtype)
    m = jnp.where(jnp.isfinite(m), m, jnp.zeros((), m.dtype))
    total = col.psum(jnp.sum(jnp.exp(x - jnp.expand_dims(m, axes)), axis=axes), split, ctx.log)
    return m + jnp.log(total)


# The max each normalization subtracts: softmax all of it (an infinite max gives NaN, as
# scipy's softmax does), log_softmax only a finite one (as scipy's log_softmax does).
_SHIFT = {"softmax": lambda x, m: x - m, "log_softmax": finite_shift}


@rule(P.softmax, P.log_softmax)
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
    x = x.astype(out.dtype)
    shifted = _SHIFT[eqn.primitive.name](x, m)
    total = col.psum(jnp.sum(jnp.exp(shifted), axis=axes, keepdims=True), split, ctx.log)
    total = ctx.varying(total, col.varying_axes(x))  # logged: the backward psums its gradient
    if eqn.primitive.name == "softmax":
        y = jnp.exp(shifted) / total
    else:
        y = shifted - jnp.log(total)
    return [(ctx.relayout(y, lay, want), want)]


@rule(P.slice, P.pad, P.split, P.concat)
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


def _offsets(ctx, layout, local):
    return [
        col.axis_index(axes, ctx.sizes) * n if axes else 0
        for axes, n in zip(layout, local, strict=True)
    ]


@rule(P.random)
def random_rule(ctx, eqn, args):
    """Each device draws only its own block, from the block's global offsets: the values
    equal the single-device ones under every layout, and nothing moves."""
    from namedmesh.random import random_values

    ((key, lay),) = args
    key = ctx.relayout(key, lay, ((),))
    (out,) = eqn.outputs
    want = ctx.wanted[out]
    local = local_shape(want, out.shape, ctx.mesh)
    p = eqn.params
    y = random_values(
        key,
        p["shape"],
        p["dist"],
        p["dtype"],
        p["args"],
        xp=jnp,
        offsets=_offsets(ctx, want, local),
        shape=local,
    )
    return [(y, want)]


@rule(P.full)
def full_rule(ctx, eqn, args):
    (out,) = eqn.outputs
    want = ctx.wanted[out]
    p = eqn.params
    return [(jnp.full(local_shape(want, out.shape, ctx.mesh), p["value"], p["dtype"]), want)]


@rule(P.iota)
def iota_rule(ctx, eqn, args):
    (out,) = eqn.outputs
    want = ctx.wanted[out]
    (n,) = local_shape(want, out.shape, ctx.mesh)
    (off,) = _offsets(ctx, want, (n,))
    p = eqn.params
    return [((p["start"] + p["step"] * (jnp.arange(n) + off)).astype(p["dtype"]), want)]


@rule(P.transpose)
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


@rule(P.reshape)
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
    shape = local_shape(out_lay, out.shape, ctx.mesh)
    y = ctx.local(eqn.primitive, x, shape=shape, dims=eqn.params["dims"])
    want = ctx.wanted[out]
    return [(ctx.relayout(y, out_lay, want), want)]


@rule(P.one_hot)
def one_hot_rule(ctx, eqn, args):
    """Each device builds only its block of the new dim: one_hot(index - offset, block)."""
    ((idx, lay),) = args
    out = eqn.outputs[0]
    want = ctx.wanted[out]
    idx = ctx.relayout(idx, lay, want[:-1])
    (n,) = local_shape(want[-1:], out.shape[-1:], ctx.mesh)
    if want[-1]:
        idx = wide_indices(idx) - col.axis_index(want[-1], ctx.sizes) * n
    p = eqn.params
    return [(ctx.local(eqn.primitive, idx, dim=p["dim"], n=n, dtype=p["dtype"]), want)]


@rule(P.gather)
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
    idx = wide_indices(idx)  # an int8 index + 256 would wrap
    idx = jnp.clip(jnp.where(idx < 0, idx + full, idx), 0, full - 1)  # as nm.gather does
    local = idx - col.axis_index(split, ctx.sizes) * n
    inside = (local >= 0) & (local < n)
    y = ctx.local(eqn.primitive, x, jnp.where(inside, local, 0), **eqn.params)
    mask = align(inside, vi.dims, out.dims, jnp)  # by name: the indices' dims in any order
    y = col.psum(jnp.where(mask, y, jnp.zeros((), y.dtype)), split, ctx.log)
    return [(y, want)]


def _ring(axes, sizes, step: int, wrap: bool):
    k = math.prod(sizes[a] for a in axes)
    pairs = [(j, j + step) for j in range(k) if 0 <= j + step < k]
    if wrap:
        pairs += [(j, (j + step) % k) for j in range(k) if not 0 <= j + step < k]
    return pairs


@rule(P.shift)
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
        return [(ctx.relayout(jnp.full_like(x, p["fill"]), lay, want), want)]
    if not axes or abs(off) > n or off == 0:
        return along_dims_rule(ctx, eqn, args)
    k = abs(off)
    edge = (
        jax.lax.slice_in_dim(x, n - k, n, axis=axis)
        if off > 0
        else jax.lax.slice_in_dim(x, 0, k, axis=axis)
    )
    ring = _ring(axes, ctx.sizes, 1 if off > 0 else -1, p["wrap"])
    halo = col.ppermute(edge, axes, ring, ctx.sizes, ctx.log)
    if not p["wrap"]:
        me = col.axis_index(axes, ctx.sizes)
        end = 0 if off > 0 else math.prod(ctx.sizes[a] for a in axes) - 1
        halo = jnp.where(me == end, jnp.full_like(halo, p["fill"]), halo)
    body = (
        jax.lax.slice_in_dim(x, 0, n - k, axis=axis)
        if off > 0
        else jax.lax.slice_in_dim(x, k, n, axis=axis)
    )
    y = jnp.concatenate([halo, body] if off > 0 else [body, halo], axis=axis)
    return [(ctx.relayout(y, lay, want), want)]


@rule(P.top_k, P.argmax, P.argmin)
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
    name = eqn.primitive.name
    k = p.get("k", 1)
    if not axes or x.shape[axis] < k:
        return along_dims_rule(ctx, eqn, args)
    largest = name != "argmin"
    xm = jnp.moveaxis(x, axis, -1)
    _, idx = jax.lax.top_k(sort_key(xm, largest), k)
    vals = jnp.take_along_axis(xm, idx, axis=-1)
    idx = idx + col.axis_index(axes, ctx.sizes) * x.shape[axis]
    vals = col.gather_stacked(vals, axes, ctx.log)  # [shards, ..., k]
    idx = col.gather_stacked(idx, axes, ctx.log)
    vals, idx = (jnp.moveaxis(a, 0, -2).reshape(a.shape[1:-1] + (-1,)) for a in (vals, idx))
    _, pos = jax.lax.top_k(sort_key(vals, largest), k)
    best = jnp.take_along_axis(vals, pos, axis=-1)
    best_idx = jnp.take_along_axis(idx, pos, axis=-1).astype(jnp.int32)
    kept = tuple(() if i == axis else a for i, a in enumerate(lay))
    if name == "top_k":
        outs = [jnp.moveaxis(best, -1, axis), jnp.moveaxis(best_idx, -1, axis)]
        return [
            (ctx.relayout(o, kept, ctx.wanted[v]), ctx.wanted[v])
            for o, v in zip(outs, eqn.outputs, strict=True)
        ]
    lay_out = tuple(a for i, a in enumerate(lay) if i != axis)
    want = ctx.wanted[eqn.outputs[0]]
    return [(ctx.relayout(best_idx[..., 0], lay_out, want), want)]


@rule(P.cumsum)
def cumsum_rule(ctx, eqn, args):
    """Along a split dim: the local running sum plus the totals of the shards before this
    one (after it, for `reverse`), from the gathered per-shard totals."""
    ((x, lay),) = args
    p = eqn.params
    axis, axes = p["axis"], lay[p["axis"]]
    if not axes:
        return along_dims_rule(ctx, eqn, args)
    y = ctx.local(eqn.primitive, x, **p)
    totals = jnp.sum(x.astype(y.dtype), axis=axis, keepdims=True)
    totals = col.gather_stacked(totals, axes, ctx.log)
    totals = ctx.varying(totals, col.varying_axes(y))  # logged: the backward psums its gradient
    me = col.axis_index(axes, ctx.sizes)
    shard = jnp.arange(totals.shape[0]).reshape((-1,) + (1,) * y.ndim)
    before = (shard > me) if p["reverse"] else (shard < me)
    y = y + jnp.sum(jnp.where(before, totals, 0), axis=0).astype(y.dtype)
    want = ctx.wanted[eqn.outputs[0]]
    return [(ctx.relayout(y, lay, want), want)]


def _halo_extend(ctx, x, axis: int, axes, left: int, right: int, fill):
    """x with `left` elements of the previous shard before it and `right` of the next after
    it along `axis` (split by `axes`), by ppermute; the first and last shards get `fill`."""
    k = math.prod(ctx.sizes[a] for a in axes)
    me = col.axis_index(axes, ctx.sizes)
    n = x.shape[axis]
    parts = []
    if left:
        edge = jax.lax.slice_in_dim(x, n - left, n, axis=axis)
        halo = col.ppermute(edge, axes, [(j, j + 1) for j in range(k - 1)], ctx.sizes, ctx.log)
        parts.append(jnp.where(me == 0, jnp.full_like(halo, fill), halo))
    parts.append(x)
    if right:
        edge = jax.lax.slice_in_dim(x, 0, right, axis=axis)
        halo = col.ppermute(edge, axes, [(j + 1, j) for j in range(k - 1)], ctx.sizes, ctx.log)
        parts.append(jnp.where(me == k - 1, jnp.full_like(halo, fill), halo))
    return jnp.concatenate(parts, axis=axis) if len(parts) > 1 else x


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


@rule(P.conv)
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


@rule(P.pool)
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


@rule(P.stack)
def stack_rule(ctx, eqn, args):
    """Inputs take the output's splits of their dims; the new leading dim starts whole."""
    out = eqn.outputs[0]
    want = ctx.wanted[out]
    xs = [ctx.relayout(x, lay, want[1:]) for x, lay in args]
    y = ctx.local(eqn.primitive, *xs, **eqn.params)
    return [(ctx.relayout(y, ((),) + want[1:], want), want)]


@rule(P.squeeze)
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


@rule(P.expand_dims)
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


@rule(P.var, P.std)
def moment_rule(ctx, eqn, args):
    """Along split dims, in two passes as on one device: the global mean (psum of the
    shards' sums over the count), then the psum of the shards' sums of squared
    deviations from it, over count - ddof; std is its square root."""
    ((x, lay),) = args
    split, kept = _reduced(eqn, lay)
    (v,), (out,) = eqn.inputs, eqn.outputs
    want = ctx.wanted[out]
    if not split:
        y = ctx.local(eqn.primitive, x, **eqn.params)
        return [(ctx.relayout(y, kept, want), want)]
    axes, ddof = eqn.params["axes"], eqn.params["ddof"]
    count = math.prod(v.shape[i] for i in axes)
    total = P.sum
    x = x.astype(out.dtype)
    mean = col.psum(ctx.local(total, x, axes=axes), split, ctx.log) / count
    mean = ctx.varying(jnp.expand_dims(mean, axes), col.varying_axes(x))
    squares = ctx.local(total, jnp.square(x - mean), axes=axes)
    y = col.psum(squares, split, ctx.log) / jnp.maximum(count - ddof, 0)
    if eqn.primitive.name == "std":
        y = jnp.sqrt(y)
    return [(ctx.relayout(y.astype(out.dtype), kept, want), want)]
