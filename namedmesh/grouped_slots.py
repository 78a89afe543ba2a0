"""The grouped FFN's jax kernel (`nm.grouped_ffn`), dropless and exact whatever the
load: its rows sorted by group once, then one loop over each group's sorted rows in
blocks (`loop_blocks`, `over_group`: its row count's binary digits, up to 1024 rows a
block), the whole FFN a block, each weight sliced once per group. The work is the
rows' and, per group, fewer than a smallest block's rows past them, whatever the load.

Until 2026-12-06 an even load ran another way, chosen at run time by a cond: every
group's rows gathered into slots of an even share and 3 sqrt(share), as batched
matmuls. The slots' slack (4,672 slots for 4,096 rows at the realistic size) cost more
than the loop's blocks by then, so the loop alone runs (docs/benchmarks.md, "MoE
experts' path (issue 40)").

Its gradient is written out (a custom vjp) rather than jax's of the composition: a row
loop's gradient by jax is loops of its own, each block's residuals stacked. Here the
forward saves the sorted rows and the hidden layer's products, and the backward runs
the forward's blocks again, recomputing each block's activation from its products.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from namedmesh.contract import varying_axes
from namedmesh.grouped import over_blocks, rows_at


def loop_blocks(rows: int, groups: int, top: int = 1024) -> tuple[int, ...]:
    """The loop's row blocks, largest first: powers of two from `top` (at most the rows
    and four even shares: each size is a loop body to compile) down to the smallest, an
    eighth of an even share up to 256 rows and at least 8. A group's rows, rounded up
    to the smallest, go by whole blocks of the largest, then at most one of each smaller
    size (its count's binary digits): a group of 946 rows is 512 + 256 + 128 + 64, where
    blocks of at most 256 rows were six (docs/benchmarks.md, "MoE experts' path")."""
    share = min(256, max(8, 1 << max(0, (rows // groups).bit_length() - 1)))
    top = max(share, min(top, 4 * share, 1 << max(0, rows.bit_length() - 1)))
    return tuple(top >> i for i in range((top // max(8, share >> 3)).bit_length()))


def over_group(blocks, first, count, body, carry):
    """carry through body(carry, row, size) for the blocks covering a group's sorted rows
    [first, first + count): its count rounded up to whole smallest blocks, by whole
    largest blocks, then at most one of each smaller size (the last may reach past the
    rows by less than a smallest block)."""
    count = (count + blocks[-1] - 1) // blocks[-1] * blocks[-1]
    return over_blocks(blocks, first, count, body, carry)


class Plan:
    """The rows sorted by group: `order` (those outside [0, groups) last), each group's
    `first` sorted row and row `count`, each row's sorted place `rank`, and which rows
    are `inside` a group."""

    def __init__(self, g, groups: int):
        self.inside = (g >= 0) & (g < groups)
        key = jnp.where(self.inside, g, groups)
        self.order = jnp.argsort(key, stable=True).astype(jnp.int32)
        self.count = jnp.zeros(groups + 1, jnp.int32).at[key].add(1)[:groups]
        self.first = jnp.cumsum(self.count) - self.count
        n = g.shape[0]
        self.rank = jnp.zeros(n, jnp.int32).at[self.order].set(jnp.arange(n, dtype=jnp.int32))

    def tree(self):
        return (self.order, self.first, self.count, self.rank, self.inside)

    @classmethod
    def of(cls, tree):
        plan = cls.__new__(cls)
        plan.order, plan.first, plan.count, plan.rank, plan.inside = tree
        return plan


def blocked_ffn(act, x, g, wi, wo, wg=None):
    """The FFN of rows x (n, c) by their groups g (n,): act(x @ wi[g]) (* x @ wg[g]) @
    wo[g], zero for a group outside [0, groups); weights (groups, in, out). Inside
    shard_map every operand is cast to vary where any does first: the custom vjp's
    cotangents vary there, and jax sums them back over the axes an operand was
    invariant over (the cast's transpose)."""
    ws = (x, wi, wo) + (() if wg is None else (wg,))
    ws = tuple(_like(a, *ws, g) for a in ws)
    return _ffn(act, loop_blocks(x.shape[0], wi.shape[0]), g, *ws)


def _like(a, *like):
    """`a` varying over every mesh axis any of `like` varies over (inside shard_map: a
    loop's carry must agree with its body's results)."""
    vary = tuple(set().union(*(varying_axes(b) for b in like)) - varying_axes(a))
    return jax.lax.pcast(a, vary, to="varying") if vary else a


def _zeros(shape, dtype, *like):
    return _like(jnp.zeros(shape, dtype), *like)


def _accumulator(dtype):
    """Floats are summed in float32 at least (as the NumPy reference sums them)."""
    return jnp.promote_types(dtype, jnp.float32)


def _mm(spec, a, b):
    """einsum `spec` summed in float32 at least, in a's dtype (each product as the
    composition of grouped matmuls rounds it)."""
    return jnp.einsum(spec, a, b, preferred_element_type=_accumulator(a.dtype)).astype(a.dtype)


def _products(spec, rows, wi, wg):
    """The hidden layer's products: (x wi,) or (x wi, x wg)."""
    return tuple(_mm(spec, rows, w) for w in (wi, *wg))


def _hidden(act, products):
    h = act(products[0])
    return h * products[1] if len(products) == 2 else h


def saved_rows(rows: int, groups: int) -> int:
    """Rows of each buffer the kernel's backward pass keeps for `rows` rows in `groups`
    groups (the sorted rows themselves and the hidden layer's products): the rows and a
    smallest block after them (a group's last block reaches past its rows by less:
    `over_group`)."""
    return rows + loop_blocks(rows, groups)[-1]


def _padded(a, rows: int):
    return jnp.pad(a, ((0, rows - a.shape[0]), (0, 0)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ffn(act, blocks, g, x, wi, wo, *wg):
    return _ffn_forward(act, blocks, g, x, wi, wo, *wg)[0]


# the kernel's ops carry this name in their HLO metadata (a profile's buckets:
# benchmarks/step_profile.py), forward and backward
SCOPE = "grouped_ffn"


@jax.named_scope(SCOPE)
def _ffn_forward(act, blocks, g, x, wi, wo, *wg):
    plan = Plan(g, wi.shape[0])
    ys, saved = _loop_forward(act, plan, blocks, x.shape[0] + blocks[-1], x, wi, wo, *wg)
    return _unsorted(ys, plan), (plan.tree(), wi, wo, wg, saved)


def _unsorted(ys, plan):
    """The sorted rows `ys` back in the rows' order, a row outside the groups zero."""
    return jnp.where(plan.inside[:, None], jnp.take(ys, plan.rank, axis=0), jnp.zeros((), ys.dtype))


@jax.named_scope(SCOPE)
def _ffn_backward(act, blocks, res, dy):
    """The loop's gradient, under a cond that skips it when no row is inside a group (an
    expert-split shard's): the cond's branch also bounds the loop's buffers' lifetimes,
    which XLA:CPU otherwise stretches (Mixtral's realistic step held 745 MB of
    temporaries without it, 580 with it: docs/benchmarks.md, "MoE experts' path")."""
    tree, wi, wo, wg, saved = res
    plan = Plan.of(tree)

    def loop(dy, wi, wo, *wg):
        dxs, dws = _loop_backward(act, plan, blocks, saved, dy, wi, wo, *wg)
        return _unsorted(dxs, plan), *dws

    def none(dy, wi, wo, *wg):
        like = (dy, wi, wo, *wg, *saved, *tree)
        x = (dy.shape[0], saved[0].shape[1])
        return _zeros(x, dy.dtype, *like), *(_zeros(w.shape, w.dtype, *like) for w in (wi, wo, *wg))

    return (None, *jax.lax.cond(jnp.any(plan.inside), loop, none, dy, wi, wo, *wg))


_ffn.defvjp(_ffn_forward, _ffn_backward)


def _put(a, rows, row):
    return jax.lax.dynamic_update_slice_in_dim(a, rows, row, 0)


def _group_weights(ws, e):
    return tuple(jax.lax.dynamic_index_in_dim(w, e, 0, keepdims=False) for w in ws)


def _loop_forward(act, plan, blocks, rows, x, wi, wo, *wg):
    """(ys: the sorted rows' FFN, (sorted rows, their products): the saved buffers), each
    group's blocks in turn, in sorted row order, so that the rows a group's last block
    writes past its own are written again by the groups after (or are no group's)."""
    like = (x, wi, wo, *wg, *plan.tree())
    xs = _padded(jnp.take(x, plan.order, axis=0), rows)
    f, o = wi.shape[-1], wo.shape[-1]

    def group(e, carry):
        we = _group_weights((wi, wo, *wg), e)

        def block(carry, row, size):
            ys, products = carry
            xb = rows_at(xs, row, size)
            pb = _products("nc,cf->nf", xb, we[0], we[2:])
            yb = _mm("nf,fo->no", _hidden(act, pb), we[1])
            return _put(ys, yb, row), tuple(
                _put(p, b, row) for p, b in zip(products, pb, strict=True)
            )

        return over_group(blocks, plan.first[e], plan.count[e], block, carry)

    ys = _zeros((rows, o), x.dtype, *like)
    products = tuple(_zeros((rows, f), x.dtype, *like) for _ in (wi, *wg))
    ys, products = jax.lax.fori_loop(0, wi.shape[0], group, (ys, products))
    return ys, (xs, *products)


def _loop_backward(act, plan, blocks, saved, dy, wi, wo, *wg):
    """(dxs: the sorted rows' gradient, the weights' gradients) by the forward's blocks,
    each group's accumulated in float32 over its blocks; a block's rows past its group
    masked out of every operand (0 x inf is NaN)."""
    xs, *products = saved
    like = (dy, wi, wo, *wg, *saved, *plan.tree())
    dys = _padded(jnp.take(jnp.where(plan.inside[:, None], dy, jnp.zeros((), dy.dtype)),
                           plan.order, axis=0), xs.shape[0])  # fmt: skip
    acc = _accumulator(xs.dtype)
    ws = (wi, wo, *wg)

    def group(e, carry):
        dxs, dws = carry
        we = _group_weights(ws, e)
        end = plan.first[e] + plan.count[e]

        def block(carry, row, size):
            dxs, dwe = carry
            mine = (row + jnp.arange(size) < end)[:, None]
            zero = jnp.zeros((), xs.dtype)
            xb, dyb, *pb = (
                jnp.where(mine, rows_at(a, row, size), zero) for a in (xs, dys, *products)
            )
            h, pull = jax.vjp(functools.partial(_hidden, act), tuple(pb))
            (dpb,) = pull(_mm("no,fo->nf", dyb, we[1]))
            dxb = sum(_mm("nf,cf->nc", d, w) for d, w in zip(dpb, (we[0], *we[2:]), strict=True))
            dwb = (_mm("nc,nf->cf", xb, dpb[0]), _mm("nf,no->fo", h, dyb),
                   *(_mm("nc,nf->cf", xb, d) for d in dpb[1:]))  # fmt: skip
            dwe = tuple(a + b.astype(acc) for a, b in zip(dwe, dwb, strict=True))
            return _put(dxs, dxb, row), dwe

        dwe = tuple(_zeros(w.shape, acc, *like) for w in we)
        dxs, dwe = over_group(blocks, plan.first[e], plan.count[e], block, (dxs, dwe))
        dws = tuple(jax.lax.dynamic_update_index_in_dim(dw, d.astype(dw.dtype), e, 0)
                    for dw, d in zip(dws, dwe, strict=True))  # fmt: skip
        return dxs, dws

    dxs = _zeros(xs.shape, xs.dtype, *like)
    dws = tuple(_zeros(w.shape, w.dtype, *like) for w in ws)
    dxs, (dwi, dwo, *dwg) = jax.lax.fori_loop(0, wi.shape[0], group, (dxs, dws))
    return dxs, (dwi, dwo, *dwg)
