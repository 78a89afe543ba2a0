"""The rules of ops that select by value or index: top_k, argmax, argmin (local
candidates, gathered, ranked again), gather (a table split along the looked-up dim),
one_hot and update_slice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowering.layout import local_shape
from lowering.rules.registry import P, layout_in, rule
from lowering.rules.structural import along_dims_rule
from namedmesh.elementwise import align
from namedmesh.ordering import sort_key


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
    if eqn.primitive is P.top_k:
        outs = [ctx.call(_best, vals, got, **kw, of=(x,), output=n)  # the shape rule's
                for n, got in enumerate((vals, idx))]  # fmt: skip
        return [
            (ctx.relayout(o, kept, ctx.wanted[v]), ctx.wanted[v])
            for o, v in zip(outs, eqn.outputs, strict=True)
        ]
    lay_out = tuple(a for i, a in enumerate(lay) if i != axis)
    want = ctx.wanted[eqn.outputs[0]]
    first = ctx.call(_best_first, vals, idx, **kw, of=(x,))
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
    # (the merged length stated: -1 cannot be solved for where another dim has size 0)
    merged = [jnp.moveaxis(a, 0, -2).reshape(a.shape[1:-1] + (a.shape[0] * a.shape[-1],))
              for a in (vals, what)]  # fmt: skip
    _, pos = jax.lax.top_k(sort_key(merged[0], largest), k)
    return jnp.moveaxis(jnp.take_along_axis(merged[1], pos, axis=-1), -1, axis)


def _best_first(vals, idx, axis, k, largest):
    """The global index of the extreme (argmax, argmin), int32."""
    return jnp.moveaxis(_best(vals, idx, axis, k, largest), axis, -1)[..., 0].astype(jnp.int32)


@rule(P.one_hot)
def one_hot_rule(ctx, eqn, args):
    """Each device builds only its block of the new dim: one_hot(index - offset, block)."""
    ((idx, lay),) = args
    out = eqn.outputs[0]
    want = ctx.wanted[out]
    idx = ctx.relayout(idx, lay, want[:-1])
    (n,) = local_shape(want[-1:], out.shape[-1:], ctx.mesh)
    if want[-1]:
        idx = wide_indices(ctx, idx)
        me = ctx.axis_index(want[-1])
        idx = ctx.call(minus_block, idx, me, n=n, like=idx)
    p = eqn.params
    return [(ctx.local(eqn.primitive, idx, dim=p["dim"], n=n, dtype=p["dtype"]), want)]


def wide_indices(ctx, idx):
    """Integer indices of at least 32 bits (`structural.wide_indices`), so that sizes,
    offsets and `idx + n` fit their dtype."""
    return ctx.astype(idx, np.int32) if np.dtype(idx.dtype).itemsize < 4 else idx


def minus_block(idx, me, n):
    """Indices into this device's block of n (the `me`-th)."""
    return idx - (me * n).astype(idx.dtype)


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
    idx = ctx.relayout(idx, il, layout_in(vi.dims, by_dim))
    if not split:
        return [(ctx.local(eqn.primitive, x, idx, **eqn.params), want)]
    n = x.shape[axis]
    full = vx.shape[axis]
    idx = wide_indices(ctx, idx)  # an int8 index + 256 would wrap
    me = ctx.axis_index(split)
    local = ctx.call(_block_indices, idx, me, n=n, full=full, like=idx)
    inside = ctx.call(_in_block, idx, me, n=n, full=full, like=idx, dtype=bool)
    y = ctx.local(eqn.primitive, x, local, **eqn.params)
    y = ctx.call(_zero_outside, y, inside, dims=vi.dims, out_dims=out.dims, of=(x, local))
    return [(ctx.psum(y, split), want)]


@rule(P.update_slice)
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
    start = ctx.relayout(start, sl, layout_in(vs.dims, by_dim))
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
