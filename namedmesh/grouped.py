"""`grouped_matmul`: a contraction whose weight is picked per row by an integer group
(the expert FFN of a dropless mixture of experts), computed as grouped matmuls.

out[g..., o...] = sum_c x[g..., c...] * w[group[g...], c..., o...]

Its meaning names no order: the sort by group is how the jax implementation runs it
(rows sorted by group, then a loop over the groups, each multiplying its rows by its
weight in blocks of up to 128 rows: the weight sliced once per group, never copied per
block; the gradient by the same loops, a custom vjp), so a row costs about one row's matmul
whatever the groups' sizes. `jax.lax.ragged_dot` states the same product but lowers
on CPU to a dense product over every group (groups times the flops), and an earlier
kernel here, one batched matmul of padded blocks against a gathered copy of each
block's weight, ran 2-4x slower (benchmarks/grouped_kernel.py). A group outside
[0, groups) gives a zero row: an expert-parallel shard passes the groups of the other
shards that way (lowering/rules/grouped.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from namedmesh.checks import agreed_sizes, axis_of
from namedmesh.elementwise import align
from namedmesh.errors import ShapeError
from namedmesh.primitive import Aval, Cost, bind, primitive, result_dtype
from namedmesh.structural import wide_indices
from namedmesh.tensor import Tensor


def roles(x_dims, w_dims, dim) -> tuple[tuple, tuple]:
    """(contracted dims: w's shared with x, output dims: w's others, besides the group
    dim `dim`), in w's order."""
    contracted = tuple(d for d in w_dims if d != dim and d in x_dims)
    return contracted, tuple(d for d in w_dims if d != dim and d not in x_dims)


def _out_dims(group_dims, w_dims, x_dims, dim) -> tuple:
    return tuple(group_dims) + roles(x_dims, w_dims, dim)[1]


def grouped_aval(x, w, group, dim, op="grouped_matmul"):
    """The result's aval, or a ShapeError naming `op` (also nm.grouped_ffn's, for each of
    its products)."""
    axis_of(w, dim, op)
    if group.dtype.kind not in "iu":
        raise ShapeError(f"{op}: the groups must be integers, got {group.dtype} {group.dims}")
    if dim in x.dims or dim in group.dims:
        raise ShapeError(f"{op}: the group dim {dim!r} must be a dim of the weight alone")
    contracted, outs = roles(x.dims, w.dims, dim)
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
    contracted, outs = roles(x_dims, w_dims, dim)
    sizes = dict(zip(w_dims, w.shape, strict=True)) | dict(
        zip(group_dims, group.shape, strict=True)
    )
    x = align(x, x_dims, tuple(group_dims) + contracted, xp)
    x = xp.broadcast_to(x, tuple(sizes[d] for d in group_dims + contracted))
    w = as_groups(xp, w, w_dims, dim, contracted)
    out_shape = tuple(sizes[d] for d in group_dims + outs)
    return x.reshape(-1, w.shape[1]), w, wide_indices(group).reshape(-1), out_shape


def as_groups(xp, w, w_dims, dim, contracted, outs=None) -> object:
    """The weight `w` as (groups, c, o): its group dim `dim`, its `contracted` dims
    flattened in that order, then its others (`outs`, default: in its own order)."""
    if outs is None:
        outs = tuple(d for d in w_dims if d != dim and d not in contracted)
    sizes = dict(zip(w_dims, w.shape, strict=True))
    order = [w_dims.index(d) for d in (dim, *contracted, *outs)]
    c, o = math.prod(sizes[d] for d in contracted), math.prod(sizes[d] for d in outs)
    return xp.transpose(w, order).reshape(sizes[dim], c, o)


def _grouped_np(x, w, group, dim, dims):
    x, w, g, shape = as_rows(np, x, w, group, dim, *dims)
    return grouped_rows_np(x, w, g).reshape(shape)


def grouped_rows_np(x, w, g):
    """The NumPy reference of `grouped_rows`: x (n, c) @ w[g] (n, c, o) row by row, in
    their promoted dtype; a row of a group outside [0, groups) is zero."""
    inside = (g >= 0) & (g < w.shape[0])
    dtype = result_dtype(x.dtype, w.dtype)
    # floats summed in float32 at least: NumPy's einsum has no bfloat16/float16 loop,
    # and einsum's reference sums their exact products there too
    acc = np.promote_types(dtype, np.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype
    rows = w[np.where(inside, g, 0)]
    y = np.einsum("nc,nco->no", x.astype(acc), rows.astype(acc)).astype(dtype)
    return np.where(inside[:, None], y, np.zeros((), dtype))  # 0, never NaN


BLOCK = 128  # rows of the largest block: no weight is copied per block, so large ones


def block_sizes(rows: int) -> tuple[int, ...]:
    """Row block sizes of the grouped matmul, largest first: a power of two in [8,
    BLOCK] at most `rows`, then its halves down to 8. A group's rows are covered by
    whole blocks of the largest size, then at most one of each smaller size, the last
    (8 rows) rounding up: fewer than 8 rows of a group's are computed in vain."""
    top = min(BLOCK, max(8, 1 << (max(rows, 1).bit_length() - 1)))
    return tuple(top >> i for i in range(top.bit_length() - 3))


def _varying(a, *like):
    """`a` typed varying over the mesh axes any of `like` varies over, inside shard_map
    (a loop's carry must be, as its body's results are); as is outside."""

    def vma(a):
        aval = jax.typeof(a)
        v = getattr(aval, "vma", None)
        return set(aval.manual_axis_type.varying if v is None else v)

    axes = tuple(set().union(*(vma(b) for b in like)) - vma(a))
    return jax.lax.pcast(a, axes, to="varying") if axes else a


def _sort(g, groups: int):
    """(order: the rows sorted by group, rows of a group outside [0, groups) last;
    each group's first sorted row; each group's row count; which rows are inside)."""
    inside = (g >= 0) & (g < groups)
    key = jnp.where(inside, g, groups)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sizes = jnp.zeros(groups + 1, jnp.int32).at[key].add(1)[:groups]
    return order, jnp.cumsum(sizes) - sizes, sizes, inside


def over_blocks(sizes: tuple[int, ...], first, count, body, carry):
    """carry through body(carry, row, rows) for the blocks covering sorted rows [first,
    first + count) (`block_sizes`); a block may reach past them (into the next
    group's rows, or the zero rows after the last)."""
    done = jnp.zeros((), jnp.int32)
    for i, size in enumerate(sizes):
        left = count - done
        n = (left + size - 1) // size if i == len(sizes) - 1 else left // size
        step = lambda j, c, size=size, at=first + done: body(c, at + j * size, size)  # noqa: E731
        carry = jax.lax.fori_loop(0, n, step, carry)
        done = done + n * size
    return carry


def rows_at(a, row, size):
    """`size` rows of `a` from `row` (a traced start)."""
    return jax.lax.dynamic_slice_in_dim(a, row, size)


def _sorted_product(xs, w, first, count, sizes, acc):
    """ys (sorted rows, o): each group's sorted rows times its weight, group by group in
    order, so the rows a group's last block writes past its own are written again by
    the groups after (rows past the last group's hold garbage: the caller drops them)."""

    def group(e, ys):
        we = jax.lax.dynamic_index_in_dim(w, e, 0, keepdims=False)  # one copy a group

        def block(ys, row, size):
            y = jnp.matmul(rows_at(xs, row, size), we, preferred_element_type=acc)
            return jax.lax.dynamic_update_slice_in_dim(ys, y.astype(ys.dtype), row, 0)

        return over_blocks(sizes, first[e], count[e], block, ys)

    ys = _varying(jnp.zeros((xs.shape[0], w.shape[-1]), xs.dtype), xs, w, first)
    return jax.lax.fori_loop(0, w.shape[0], group, ys)


def _accumulator(dtype):
    """Floats are summed in float32 at least (as the NumPy reference sums them)."""
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.promote_types(dtype, jnp.float32)
    return dtype


def _padded(a, order, sizes):
    """a's rows in `order`, then a largest block of zero rows (a block may reach past
    the last row by less)."""
    return jnp.pad(jnp.take(a, order, axis=0), ((0, sizes[0]), (0, 0)))


def _forward(x, w, g):
    n, sizes = x.shape[0], block_sizes(x.shape[0])
    order, first, count, inside = _sort(g, w.shape[0])
    xs = _padded(x, order, sizes)
    ys = _sorted_product(xs, w, first, count, sizes, _accumulator(x.dtype))
    rank = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    y = jnp.where(inside[:, None], jnp.take(ys, rank, axis=0), jnp.zeros((), ys.dtype))
    return y, (xs, w, order, rank, first, count, inside)


def _backward(saved, dy):
    """dx = dy w[g]^T row by row and dw[e] = the sum of x^T dy over group e's rows, both
    by the forward's blocks (a block's rows past its group's masked out of dw)."""
    xs, w, order, rank, first, count, inside = saved
    acc = _accumulator(w.dtype)
    sizes = block_sizes(rank.shape[0])
    dys = _padded(jnp.where(inside[:, None], dy, jnp.zeros((), dy.dtype)), order, sizes)

    def group(e, carry):
        dxs, dw = carry
        we = jax.lax.dynamic_index_in_dim(w, e, 0, keepdims=False)
        end = first[e] + count[e]

        def block(carry, row, size):
            dxs, dwe = carry
            mine = (row + jnp.arange(size) < end)[:, None]  # both masked: 0 x inf is NaN
            dyb, xb = (rows_at(a, row, size) for a in (dys, xs))
            dyb, xb = (jnp.where(mine, a, jnp.zeros((), a.dtype)) for a in (dyb, xb))
            dx = jnp.matmul(dyb, we.T, preferred_element_type=acc).astype(dxs.dtype)
            dxs = jax.lax.dynamic_update_slice_in_dim(dxs, dx, row, 0)
            return dxs, dwe + jnp.einsum("nc,no->co", xb, dyb, preferred_element_type=acc)

        dwe = _varying(jnp.zeros(w.shape[1:], acc), xs, dys, w, first)
        dxs, dwe = over_blocks(sizes, first[e], count[e], block, (dxs, dwe))
        return dxs, jax.lax.dynamic_update_index_in_dim(dw, dwe.astype(dw.dtype), e, 0)

    like = (xs, dys, w, first)
    dxs = _varying(jnp.zeros(xs.shape, xs.dtype), *like)
    dw = _varying(jnp.zeros(w.shape, w.dtype), *like)
    dxs, dw = jax.lax.fori_loop(0, w.shape[0], group, (dxs, dw))
    return jnp.take(dxs, rank, axis=0), dw, None


@jax.custom_vjp
def _differentiable(x, w, g):
    return _forward(x, w, g)[0]


_differentiable.defvjp(_forward, _backward)


def grouped_rows(x, w, g):
    """x (n, c) @ w[g] (n, c, o) row by row, as grouped matmuls: rows sorted by group,
    each group's rows multiplied by its weight in blocks (`block_sizes`), the weight
    sliced once per group, never copied per block; the gradient likewise (a custom vjp: the
    loops' trip counts are the groups' sizes); fewer rows than half the groups (a decoding
    step's few tokens), each row by its own group's weight. Rows of a group outside
    [0, groups) are zero and cost nothing."""
    n, groups = x.shape[0], w.shape[0]
    if 2 * n <= groups:  # n weights read, not a loop over every group
        inside = (g >= 0) & (g < groups)
        y = jnp.einsum("nc,nco->no", x, w[jnp.where(inside, g, 0)], preferred_element_type=x.dtype)
        return jnp.where(inside[:, None], y, jnp.zeros((), y.dtype))
    if jnp.issubdtype(x.dtype, jnp.inexact):
        # x and w varying wherever the product does (inside shard_map), before the custom
        # vjp: its cotangents vary there, and jax sums them back over the axes that x or
        # w was invariant over (the cast's transpose, a psum)
        x, w = (_varying(a, x, w, g) for a in (x, w))
        return _differentiable(x, w, g)
    return _forward(x, w, g)[0]


def _grouped_jax(x, w, group, dim, dims):
    dtype = result_dtype(x.dtype, w.dtype)
    x, w, g, shape = as_rows(jnp, x, w, group, dim, *dims)
    return grouped_rows(x.astype(dtype), w.astype(dtype), g).reshape(shape)


def _grouped_cost(in_avals, out_avals, params) -> Cost:
    """A row's matmul per row: 2 flops per output element and contracted element."""
    x, w, _ = in_avals
    contracted, _ = roles(x.dims, w.dims, params["dim"])
    c = math.prod(w.shape[w.dims.index(d)] for d in contracted)
    flops = 2 * math.prod(out_avals[0].shape) * c
    return Cost(flops, sum(a.nbytes for a in in_avals) + out_avals[0].nbytes)


_grouped = primitive(
    "grouped_matmul",
    lambda x, w, group, dim, dims: grouped_aval(x, w, group, dim),
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


def _grouped_example(a, b, d, k):
    """The property strategies' grouped_matmul (Primitive.example): 2 groups of weights
    over d (and b's own dims), rows by a's argmax mod 3 (group 2: zero rows)."""
    b = b if d in b.dims else a
    summed = [x for x in b.dims if x in a.dims and x != d]
    v = b.sum(summed) if summed else b
    w = v.expand_dims({"group": 2}) * Tensor._make(np.array([1.0, -0.5], np.float32), ("group",))
    return grouped_matmul(a, w, a.argmax(d) % 3, "group")


_grouped.example = _grouped_example
