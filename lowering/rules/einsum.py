"""The rule of `nm.einsum`: a compute layout over all its dims, partial sums combined by
psum_scatter or psum, the rule order weighed against promoting a shared dim."""

from __future__ import annotations

import math

import numpy as np

from lowering import collectives as col
from lowering.caches import per_object
from lowering.cost import traffic
from lowering.layout import local_shape
from lowering.plan import nbytes
from lowering.rules.registry import P, layout_in, rule


def combine(summed, cur, want):
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
        col.relayout_traffic(lay, layout_in(v.dims, comp), nbytes(x), ctx.sizes)
        for (x, lay), v in zip(args, eqn.inputs, strict=True)
    )
    cur = layout_in(out.dims, comp)
    size = math.prod(local_shape(cur, out.shape, ctx.mesh)) * out.dtype.itemsize
    summed = [a for d in all_dims if d not in out.dims for a in comp[d]]
    scatter, reduce, cur = combine(summed, cur, want)
    for a, _ in scatter:
        total += traffic("psum_scatter", (a,), size, ctx.sizes)
        size //= ctx.sizes[a]
    if reduce:
        total += traffic("psum", reduce, size, ctx.sizes)
    return total + col.relayout_traffic(cur, want, size, ctx.sizes)


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
    ins = eqn.inputs  # (indexes: zip's keyword strict= costs more than this)
    xs = [ctx.relayout(x, lay, layout_in(ins[i].dims, comp)) for i, (x, lay) in enumerate(args)]
    y = ctx.local(eqn.primitive, *xs, **eqn.params)
    summed = [a for d in all_dims if d not in out.dims for a in comp[d]]
    scatter, reduce, cur = combine(summed, layout_in(out.dims, comp), want)
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
