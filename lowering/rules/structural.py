"""The rules of structural ops: constrain, slice/pad/split/concat, transpose, reshape,
stack, squeeze, expand_dims and shift (a halo from the neighbour by ppermute)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from lowering.layout import local_shape
from lowering.rules.registry import P, rule


@rule(P.constrain)
def constrain_rule(ctx, eqn, args):
    """The value moved to the layout the constraint pins."""
    ((x, lay),) = args
    want = ctx.wanted[eqn.outputs[0]]
    return [(ctx.relayout(x, lay, want), want)]


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
    # the dims outside the run keep the shard's sizes (a pipeline's microbatch cuts one)
    run = local_shape(out_lay[i0:o1], out.shape[i0:o1], ctx.mesh)
    shape = (*x.shape[:i0], *run, *x.shape[i1:])
    y = ctx.local(eqn.primitive, x, shape=shape, dims=eqn.params["dims"])
    want = ctx.wanted[out]
    return [(ctx.relayout(y, out_lay, want), want)]


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
        filled = ctx.call(_filled, x, fill=p["fill"])
        return [(ctx.relayout(filled, lay, want), want)]
    if not axes or abs(off) > n or off == 0:
        return along_dims_rule(ctx, eqn, args)
    k = abs(off)
    lo, hi = (n - k, n) if off > 0 else (0, k)
    edge_shape = x.shape[:axis] + (k,) + x.shape[axis + 1 :]
    edge = ctx.call(slice_along, x, lo=lo, hi=hi, axis=axis, shape=edge_shape, dtype=x.dtype)
    ring = _ring(axes, ctx.sizes, 1 if off > 0 else -1, p["wrap"])
    halo = ctx.ppermute(edge, axes, ring)
    if not p["wrap"]:
        me = ctx.axis_index(axes)
        end = 0 if off > 0 else math.prod(ctx.sizes[a] for a in axes) - 1
        halo = ctx.call(fill_at, halo, me, end=end, fill=p["fill"], like=halo)
    y = ctx.call(_shifted, x, halo, k=k, axis=axis, forward=off > 0)
    return [(ctx.relayout(y, lay, want), want)]


def _filled(x, fill):
    return jnp.full_like(x, fill)


def slice_along(x, lo, hi, axis):
    return jax.lax.slice_in_dim(x, lo, hi, axis=axis)


def fill_at(halo, me, end, fill):
    """The halo, or `fill` on the device at the end that receives nothing."""
    return jnp.where(me == end, jnp.full_like(halo, fill), halo)


def _shifted(x, halo, k, axis, forward: bool):
    """The shard shifted by k along `axis`, the neighbour's `halo` entering at one end."""
    n = x.shape[axis]
    if forward:
        return jnp.concatenate([halo, jax.lax.slice_in_dim(x, 0, n - k, axis=axis)], axis=axis)
    return jnp.concatenate([jax.lax.slice_in_dim(x, k, n, axis=axis), halo], axis=axis)
