"""The rules of reductions along dims (sum, max, any, logsumexp, ...), of the
normalizations (softmax, log_softmax), the moments (var, std) and cumsum: each reduces
its shard, then combines the shards over the mesh axes that split a reduced dim."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from lowering.rules.registry import P, rule
from lowering.rules.structural import along_dims_rule
from namedmesh.primitive import is_inexact
from namedmesh.reductions import finite_shift


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
    y = ctx.call(jax.lax.stop_gradient, y, like=y)
    m = (ctx.pmax if prim is P.max else ctx.pmin)(y, split)
    if not is_inexact(x.dtype):
        return m
    counts = ctx.call(_ties_and_nans, x, m, axes=axes, shape=(2, *m.shape), dtype=np.int32)
    counts = ctx.psum(counts, split)
    vma = ctx.vma(m) | ctx.vma(counts)  # the extreme's, not x's: its gradient is custom
    return ctx.call(_extreme_with_ties, x, m, counts, axes=axes, split=split, vma=vma)


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


@rule(P.sum, P.max, P.min, P.any, P.all, P.mean, P.logsumexp, P.prod)
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
            y = ctx.call(_divide, y, by=k, to=out.dtype, of=(x,))
    elif prim in _STACKED and split:
        g = ctx.gather_stacked(y, split)
        y = ctx.call(_reduce_stacked, g, reduce=_STACKED[prim], to=out.dtype, of=(x,))
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
    key = (id(x), "global max", axes, split, np.dtype(dtype))  # (str() of a dtype: slow)
    if key not in ctx.moved:
        shape = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
        m = ctx.call(_local_max, x, axes=axes, to=dtype, shape=shape, dtype=dtype)
        ctx.moved[key] = (x, ctx.pmax(m, split))
    return ctx.moved[key][1]


def _local_max(x, axes, to):  # (`to` is a float dtype; initial: a dim of size 0)
    return jax.lax.stop_gradient(jnp.max(x.astype(to), axis=axes, keepdims=True, initial=-jnp.inf))


def _split_logsumexp(ctx, x, axes, split, dtype):
    """scipy's logsumexp along dims split over `split`: the global max m (pmax of the
    shards' maxes, no gradient; 0 where infinite) plus log of the psum of the shards'
    sums of exp(x - m). A shard's NaN or inf reaches the psum through exp; an element at
    -inf gets a zero gradient (a per-shard logsumexp would give an all -inf shard NaN)."""
    m = _global_max(ctx, x, axes, split, dtype)
    part = ctx.call(_sum_exp, x, m, axes=axes, to=dtype, dtype=dtype)  # the result's shape
    total = ctx.psum(part, split)
    return ctx.call(_log_total, m, total, axes=axes, of=(x,))


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
    shift, dt = _SHIFT[eqn.primitive], out.dtype
    shape = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
    total = ctx.call(_sum_shifted_exp, x, m, axes=axes, shift=shift, to=dt, shape=shape, dtype=dt)
    total = ctx.psum(total, split)
    total = ctx.varying(total, ctx.vma(x))  # logged: the backward psums its gradient
    y = ctx.call(_normalize, x, m, total, shift=shift, to=dt, log=eqn.primitive is P.log_softmax)
    return [(ctx.relayout(y, lay, want), want)]


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
    shape = tuple(1 if i == axis else n for i, n in enumerate(x.shape))
    totals = ctx.call(_total, x, axis=axis, to=y.dtype, shape=shape, dtype=y.dtype)
    totals = ctx.gather_stacked(totals, axes)
    totals = ctx.varying(totals, ctx.vma(y))  # logged: the backward psums its gradient
    me = ctx.axis_index(axes)
    y = ctx.call(_plus_before, y, totals, me, reverse=p["reverse"])
    want = ctx.wanted[eqn.outputs[0]]
    return [(ctx.relayout(y, lay, want), want)]


def _total(x, axis, to):
    return jnp.sum(x.astype(to), axis=axis, keepdims=True)


def _plus_before(y, totals, me, reverse: bool):
    """y plus the gathered `totals` of the shards before device `me` (after, reversed)."""
    shard = jnp.arange(totals.shape[0]).reshape((-1,) + (1,) * y.ndim)
    before = (shard > me) if reverse else (shard < me)
    return y + jnp.sum(jnp.where(before, totals, 0), axis=0).astype(y.dtype)


@rule(P.var, P.std)
def moment_rule(ctx, eqn, args):
    """Along split dims, in two passes as on one device: the global mean (psum of the
    shards' sums over the count), then the psum of the shards' sums of squared
    deviations from it, over count - ddof; std is its square root. All of it is the
    rule's own arithmetic (`ctx.call`), so the step is costed by the primitive's cost
    rule on the shards (interpret.cost_own_arithmetic), as a softmax along a split dim is:
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
    total = ctx.psum(ctx.call(_sum, x, axes=axes), split)  # the result's shape and dtype
    shape = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
    mean = ctx.call(_expanded_mean, total, count=count, axes=axes, shape=shape, dtype=dt)
    mean = ctx.varying(mean, ctx.vma(x))
    squares = ctx.call(_squared_deviations, x, mean, axes=axes)
    squares = ctx.psum(squares, split)
    root = eqn.primitive is P.std
    y = ctx.call(_moment, squares, n=count - ddof, root=root, to=dt, of=(x,))
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
