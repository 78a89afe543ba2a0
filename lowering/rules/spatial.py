"""The rules of conv and pool: along split spatial dims each device extends its block
by its neighbours' edges (halos, by ppermute)."""

from __future__ import annotations

import math

import jax.numpy as jnp

from lowering.rules.registry import P, replicated_rule, rule
from lowering.rules.structural import fill_at, slice_along
from namedmesh.ordering import lowest


def _halo_extend(ctx, x, axis: int, axes, left: int, right: int, fill):
    """x with `left` elements of the previous shard before it and `right` of the next after
    it along `axis` (split by `axes`), by ppermute; the first and last shards get `fill`."""
    if not (left or right):
        return x
    k = math.prod(ctx.sizes[a] for a in axes)
    me = ctx.axis_index(axes)
    n = x.shape[axis]
    edge = lambda lo, hi: ctx.call(
        slice_along,
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
        parts.append(ctx.call(fill_at, halo, me, end=0, fill=fill, like=halo))
    parts.append(x)
    if right:
        halo = ctx.ppermute(edge(0, right), axes, [(j + 1, j) for j in range(k - 1)])
        parts.append(ctx.call(fill_at, halo, me, end=k - 1, fill=fill, like=halo))
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
