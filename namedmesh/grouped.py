"""`grouped_matmul`: a contraction whose weight is picked per row by an integer group
(the expert FFN of a dropless mixture of experts), computed as grouped matmuls.

out[g..., o...] = sum_c x[g..., c...] * w[group[g...], c..., o...]

Its meaning names no order: the sort by group is how the jax implementation runs it
(rows sorted by group, each group padded to whole blocks, one batched matmul of the
blocks against their groups' weights, then unsorted), so a row costs about one row's
matmul whatever the groups' sizes (`block_rows`). `jax.lax.ragged_dot` states the same
product but lowers on CPU to a dense product over every group (groups times the
flops: benchmarks/moe_routing.py). A group outside
[0, groups) gives a zero row: an expert-parallel shard passes the groups of the other
shards that way (lowering/rules/grouped.py).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from namedmesh.checks import agreed_sizes, axis_of
from namedmesh.elementwise import align
from namedmesh.errors import ShapeError
from namedmesh.primitive import Aval, Cost, bind, primitive, result_dtype
from namedmesh.structural import wide_indices
from namedmesh.tensor import Tensor


def _roles(x_dims, w_dims, dim) -> tuple[tuple, tuple]:
    """(contracted dims: w's shared with x, output dims: w's others), in w's order."""
    contracted = tuple(d for d in w_dims if d != dim and d in x_dims)
    return contracted, tuple(d for d in w_dims if d != dim and d not in x_dims)


def _out_dims(group_dims, w_dims, x_dims, dim) -> tuple:
    return tuple(group_dims) + _roles(x_dims, w_dims, dim)[1]


def _grouped_rule(x, w, group, dim):
    op = "grouped_matmul"
    axis_of(w, dim, op)
    if group.dtype.kind not in "iu":
        raise ShapeError(f"{op}: the groups must be integers, got {group.dtype} {group.dims}")
    if dim in x.dims or dim in group.dims:
        raise ShapeError(f"{op}: the group dim {dim!r} must be a dim of the weight alone")
    contracted, outs = _roles(x.dims, w.dims, dim)
    if not contracted:
        raise ShapeError(f"{op}: x {x.dims} and the weight {w.dims} share no dim to contract")
    stray = [d for d in x.dims if d not in contracted and d not in group.dims]
    if stray:
        raise ShapeError(
            f"{op}: x's dims {stray} are neither contracted with the weight {w.dims} nor "
            f"dims of the groups {group.dims}"
        )
    clash = [d for d in w.dims if d != dim and d in group.dims]
    if clash:
        raise ShapeError(
            f"{op}: the weight's dims {clash} are also dims of the groups: a weight dim is "
            "either contracted with x or a dim of the result, after the groups' dims"
        )
    sizes = agreed_sizes(op, (x, w, group), ("x", "the weight", "the groups"))
    out = _out_dims(group.dims, w.dims, x.dims, dim)
    return Aval(out, tuple(sizes[d] for d in out), result_dtype(x.dtype, w.dtype))


def as_rows(xp, x, w, group, dim, x_dims, w_dims, group_dims):
    """(x (rows, c), w (groups, c, o), group (rows,), output shape) from the named
    operands: x broadcast over the groups' dims it lacks (also the expert-parallel
    rule's, lowering/expert_routes.py)."""
    contracted, outs = _roles(x_dims, w_dims, dim)
    sizes = dict(zip(w_dims, w.shape, strict=True)) | dict(
        zip(group_dims, group.shape, strict=True)
    )
    x = align(x, x_dims, tuple(group_dims) + contracted, xp)
    x = xp.broadcast_to(x, tuple(sizes[d] for d in group_dims + contracted))
    order = [w_dims.index(d) for d in (dim, *contracted, *outs)]
    c, o = math.prod(sizes[d] for d in contracted), math.prod(sizes[d] for d in outs)
    w = xp.transpose(w, order).reshape(sizes[dim], c, o)
    out_shape = tuple(sizes[d] for d in group_dims + outs)
    return x.reshape(-1, c), w, wide_indices(group).reshape(-1), out_shape


def _grouped_np(x, w, group, dim, dims):
    x, w, g, shape = as_rows(np, x, w, group, dim, *dims)
    inside = (g >= 0) & (g < w.shape[0])
    dtype = result_dtype(x.dtype, w.dtype)
    # floats summed in float32 at least: NumPy's einsum has no bfloat16/float16 loop,
    # and einsum's reference sums their exact products there too
    acc = np.promote_types(dtype, np.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype
    rows = w[np.where(inside, g, 0)]
    y = np.einsum("nc,nco->no", x.astype(acc), rows.astype(acc)).astype(dtype)
    return np.where(inside[:, None], y, np.zeros((), dtype)).reshape(shape)  # 0, never NaN


def block_rows(rows: int, groups: int) -> int:
    """Rows per block of the grouped matmul: a power of two in [8, 128], at most an
    eighth of the rows a group has when they spread evenly. The blocks are sized for
    the worst case, each group's last block part empty (groups x (block - 1) rows more
    than `rows`: at most an eighth more, once rows >= 64 x groups), and each block
    reads its group's weight (fewer, larger blocks read fewer)."""
    share = max(1, rows // (8 * max(groups, 1)))
    return min(128, max(8, 1 << (share.bit_length() - 1)))


def grouped_rows(x, w, g):
    """x (n, c) @ w[g] (n, c, o) row by row, as grouped matmuls: rows sorted by group,
    each group padded to whole blocks, each block multiplied by its group's weight;
    fewer rows than half the groups, each row by its own group's weight. Rows of a
    group outside [0, groups) are zero and cost nothing."""
    n, groups = x.shape[0], w.shape[0]
    inside = (g >= 0) & (g < groups)
    if 2 * n <= groups:  # fewer rows than half the groups (a decoding step's few tokens):
        # each row's own weight, n weights copied and read, not a block's per group
        y = jnp.einsum("nc,nco->no", x, w[jnp.where(inside, g, 0)], preferred_element_type=x.dtype)
        return jnp.where(inside[:, None], y, jnp.zeros((), y.dtype))
    block = block_rows(n, groups)
    key = jnp.where(inside, g, groups)  # outside rows sort last, in no block
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros(groups + 1, jnp.int32).at[key].add(1)[:groups]
    starts = jnp.cumsum(sizes) - sizes  # each group's first sorted row
    padded = (sizes + block - 1) // block * block
    ends = jnp.cumsum(padded)  # each group's padded end
    rank = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    safe = jnp.where(inside, g, 0)
    blocks = (n + groups * (block - 1)) // block  # the most any sizes need
    dest = jnp.where(inside, ends[safe] - padded[safe] + rank - starts[safe], blocks * block)
    src = jnp.full(blocks * block, n, jnp.int32).at[dest].set(jnp.arange(n, dtype=jnp.int32))
    xb = jnp.take(x, src, axis=0, mode="fill", fill_value=0).reshape(blocks, block, -1)
    owner = jnp.minimum(
        jnp.searchsorted(ends, jnp.arange(blocks) * block, side="right"), groups - 1
    )
    yb = jnp.einsum("nbc,nco->nbo", xb, w[owner], preferred_element_type=x.dtype)
    return jnp.take(yb.reshape(blocks * block, -1), dest, axis=0, mode="fill", fill_value=0)


def _grouped_jax(x, w, group, dim, dims):
    dtype = result_dtype(x.dtype, w.dtype)
    x, w, g, shape = as_rows(jnp, x, w, group, dim, *dims)
    return grouped_rows(x.astype(dtype), w.astype(dtype), g).reshape(shape)


def _grouped_cost(in_avals, out_avals, params) -> Cost:
    """A row's matmul per row: 2 flops per output element and contracted element."""
    x, w, _ = in_avals
    contracted, _ = _roles(x.dims, w.dims, params["dim"])
    c = math.prod(w.shape[w.dims.index(d)] for d in contracted)
    flops = 2 * math.prod(out_avals[0].shape) * c
    return Cost(flops, sum(a.nbytes for a in in_avals) + out_avals[0].nbytes)


_grouped = primitive(
    "grouped_matmul",
    lambda x, w, group, dim, dims: _grouped_rule(x, w, group, dim),
    _grouped_np,
    _grouped_jax,
    cost_rule=_grouped_cost,
    matmul=True,
    combines_inputs=True,
    backward_reads="others",
)


def grouped_matmul(x: Tensor, w: Tensor, group: Tensor, dim: str = "experts") -> Tensor:
    """x contracted with the slice of `w` along `dim` that `group` (ints) picks for each
    row: `w`'s dims shared with `x` are summed, its others (besides `dim`) are the
    result's, after the groups' dims; x broadcasts over the groups' dims it lacks (a
    token's k choices). A group outside [0, w.size_of(dim)) gives zeros.
    `grouped_matmul(x, wi, choice)` with x (batch, length, d_model), wi (experts,
    d_model, d_ff), choice (batch, length, k) is (batch, length, k, d_ff)."""
    dims = (x.dims, w.dims, group.dims)
    return bind(_grouped, x, w, group, dim=dim, dims=dims)
