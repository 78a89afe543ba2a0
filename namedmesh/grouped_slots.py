"""The grouped FFN's jax kernel (`nm.grouped_ffn`), dropless and exact whatever the
load: rows sorted by group once, each group's first `cap` rows (an even share m of the
rows and 3 sqrt(m), rounded up to 8: `slot_capacity`) gathered into a (groups, cap, c)
buffer that runs the whole FFN as batched matmuls, and each group's rows past its slots
(the overflow of an uneven load) by one loop over blocks of `OVERFLOW_BLOCK` rows, the
whole FFN a block, under a cond that skips it when no group overflows.

Its gradient is written out (a custom vjp) rather than jax's of the composition, for
what that would cost (docs/benchmarks.md, "MoE experts' path (issue 40)"): jax's
gradient of a cond makes every residual of either branch an output of both (the
skipped overflow's hidden layers zero-filled every step, XLA's temporaries doubled),
and each row loop's gradient is loops of its own (the compile). Here the forward saves
the slots' two products (their inputs, the gathered rows) and nothing of the overflow;
the backward runs the slots' products' gradients as batched matmuls, then the overflow
blocks' forward and backward in one loop (a block's FFN recomputed), adding into the
slots' gradients in place, under the same cond. The work is bounded: the slots (the
rows and the slack under an even load) plus the overflow rows rounded up to blocks.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from namedmesh.contract import varying_axes

OVERFLOW_BLOCK = 64  # rows of an overflow block: the loop's only dot shape


def slot_capacity(rows: int, groups: int) -> int:
    """Slots per group of the batched part: an even share m of `rows` and 3 sqrt(m)
    (an even random load's busiest group stays within that with probability about
    0.999 per group, so the overflow loop rarely runs), rounded up to 8, and no more
    than the rows."""
    m = rows / groups
    return min(max(8, math.ceil((m + 3 * math.sqrt(m)) / 8) * 8), math.ceil(rows / 8) * 8)


def sorted_slots(g, groups: int, cap: int):
    """(order: the rows sorted by group, those outside [0, groups) last; each group's
    first sorted row and row count; src (groups x cap): each slot's row, `rows` for an
    empty slot; at (rows,): each row's slot, or groups x cap for a row outside or past
    its group's capacity; rank (rows,): each row's sorted place; place (rows,): its
    place in its group's rows, -1 for a row outside [0, groups))."""
    n = g.shape[0]
    inside = (g >= 0) & (g < groups)
    key = jnp.where(inside, g, groups)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    count = jnp.zeros(groups + 1, jnp.int32).at[key].add(1)[:groups]
    first = jnp.cumsum(count) - count
    j = jnp.arange(cap, dtype=jnp.int32)
    filled = j[None, :] < count[:, None]
    src = jnp.where(filled, jnp.take(order, jnp.minimum(first[:, None] + j, n - 1)), n)
    rank = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    place = jnp.where(inside, rank - jnp.take(first, jnp.minimum(key, groups - 1)), -1)
    at = jnp.where(inside & (place < cap), key * cap + place, groups * cap)
    return order, first, count, src.reshape(-1), at, rank, place


def slotted_ffn(act, x, g, wi, wo, wg=None):
    """The FFN of rows x (n, c) by their groups g (n,): act(x @ wi[g]) (* x @ wg[g]) @
    wo[g], zero for a group outside [0, groups); weights (groups, in, out). Where at
    most half the rows are inside (an expert-split shard, whose other shards' rows are
    outside), the slots, sized for every row, would compute mostly padding: the
    overflow loop takes every row then. Inside shard_map every operand is cast to vary
    where any does first: the custom vjp's cotangents vary there, and jax sums them
    back over the axes an operand was invariant over (the cast's transpose)."""
    ws = (x, wi, wo) + (() if wg is None else (wg,))
    ws = tuple(_like(a, *ws, g) for a in ws)
    cap = slot_capacity(x.shape[0], wi.shape[0])
    return _ffn(act, cap, g, *ws)


class Plan:
    """Where each row goes (`sorted_slots`), whether the slots run (`few`: they do not),
    and each group's overflow: its first sorted row past the slots and its row count."""

    def __init__(self, g, groups: int, cap: int):
        self.order, first, count, self.src, self.at, self.rank, place = sorted_slots(g, groups, cap)
        self.few = 2 * jnp.sum(count) <= g.shape[0]
        skip = jnp.where(self.few, 0, cap)
        self.first, self.left = first + skip, jnp.maximum(count - skip, 0)
        self.over = place >= skip

    def tree(self):
        return (self.order, self.src, self.at, self.rank, self.few, self.first, self.left,
                self.over)  # fmt: skip

    @classmethod
    def of(cls, tree):
        plan = cls.__new__(cls)
        (plan.order, plan.src, plan.at, plan.rank, plan.few, plan.first, plan.left,
         plan.over) = tree  # fmt: skip
        return plan


def _like(a, *like):
    """`a` varying over every mesh axis any of `like` varies over (inside shard_map: a
    loop's carry and a cond's branches must agree with the results)."""
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


def _gather(a, rows):
    """a's `rows`; an index past the last row gives a zero row."""
    return jnp.take(jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)]), rows, axis=0)


def _products(spec, slots, wi, wg):
    """The hidden layer's products: (x wi,) or (x wi, x wg)."""
    return tuple(_mm(spec, slots, w) for w in (wi, *wg))


def _hidden(act, products):
    h = act(products[0])
    return h * products[1] if len(products) == 2 else h


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ffn(act, cap, g, x, wi, wo, *wg):
    return _ffn_forward(act, cap, g, x, wi, wo, *wg)[0]


def _ffn_forward(act, cap, g, x, wi, wo, *wg):
    (n, c), groups = x.shape, wi.shape[0]
    plan = Plan(g, groups, cap)

    def slotted(x, wi, wo, *wg):
        slots = _gather(x, plan.src).reshape(groups, cap, c)
        products = _products("gsc,gcf->gsf", slots, wi, wg)
        out = _mm("gsf,gfo->gso", _hidden(act, products), wo)
        return _gather(out.reshape(groups * cap, -1), plan.at), slots, products

    def skipped(x, wi, wo, *wg):
        like = (x, wi, wo, *wg, g)
        slots = _zeros((groups, cap, c), x.dtype, *like)
        products = tuple(_zeros((groups, cap, wi.shape[-1]), x.dtype, *like) for _ in (wi, *wg))
        return _zeros((n, wo.shape[-1]), x.dtype, *like), slots, products

    y, slots, products = jax.lax.cond(plan.few, skipped, slotted, x, wi, wo, *wg)
    y = y + _overflow(act, plan, x, (wi, wo, *wg))
    return y, (plan.tree(), x, wi, wo, wg, slots, products)


def _ffn_backward(act, cap, saved, dy):
    tree, x, wi, wo, wg, slots, products = saved
    plan, c, groups = Plan.of(tree), x.shape[1], wi.shape[0]

    def slotted(dy, wi, wo, *wg):
        dout = _gather(dy, plan.src).reshape(groups, cap, -1)
        h, pull = jax.vjp(functools.partial(_hidden, act), products)
        dwo = _mm("gsf,gso->gfo", h, dout)
        (dproducts,) = pull(_mm("gso,gfo->gsf", dout, wo))
        dslots = sum(_mm("gsf,gcf->gsc", d, w) for d, w in zip(dproducts, (wi, *wg), strict=True))
        dws = tuple(_mm("gsc,gsf->gcf", slots, d) for d in dproducts)
        dx = _gather(dslots.reshape(groups * cap, c), plan.at)
        return dx, dws[0], dwo, *dws[1:]

    def skipped(dy, wi, wo, *wg):
        like = (dy, x, wi, wo, *wg, *tree)
        return _zeros(x.shape, x.dtype, *like), *(_zeros(w.shape, w.dtype, *like)
                                                  for w in (wi, wo, *wg))  # fmt: skip

    grads = jax.lax.cond(plan.few, skipped, slotted, dy, wi, wo, *wg)
    grads = _overflow_grads(act, plan, x, (wi, wo, *wg), dy, grads)
    return (None, *grads)


_ffn.defvjp(_ffn_forward, _ffn_backward)


def _blocks(plan, e):
    """Group e's overflow: its first sorted row and its number of blocks."""
    return plan.first[e], (plan.left[e] + OVERFLOW_BLOCK - 1) // OVERFLOW_BLOCK


def _rows(a, row):
    return jax.lax.dynamic_slice_in_dim(a, row, OVERFLOW_BLOCK)


def _sorted(a, plan, mask=None):
    """a's rows in sorted order (those of `mask` alone, others zero), then a block of
    zero rows (a group's last block reaches up to a block's rows past its rows)."""
    if mask is not None:
        a = jnp.where(mask[:, None], a, jnp.zeros((), a.dtype))
    return jnp.pad(jnp.take(a, plan.order, axis=0), ((0, OVERFLOW_BLOCK), (0, 0)))


def _block_ffn(act, xb, wi, wo, *wg):
    return _mm("nf,fo->no", _hidden(act, _products("nc,cf->nf", xb, wi, wg)), wo)


def _overflow(act, plan, x, weights):
    """The FFN of the rows past their group's slots (zero for the others): each group's
    blocks in turn, in sorted row order, so that the rows a group's last block writes
    past its own are written again by the groups after (or dropped: not overflow rows);
    skipped (a cond) when no group overflows."""
    wi, wo = weights[:2]
    like = (x, *weights, *plan.tree())

    def run(x, *weights):
        xs = _sorted(x, plan)

        def group(e, ys):
            we = tuple(jax.lax.dynamic_index_in_dim(w, e, 0, keepdims=False) for w in weights)
            start, blocks = _blocks(plan, e)

            def block(j, ys):
                row = start + j * OVERFLOW_BLOCK
                yb = _block_ffn(act, _rows(xs, row), *we)
                return jax.lax.dynamic_update_slice_in_dim(ys, yb, row, 0)

            return jax.lax.fori_loop(0, blocks, block, ys)

        ys = _zeros((xs.shape[0], wo.shape[-1]), x.dtype, *like)
        ys = jax.lax.fori_loop(0, wi.shape[0], group, ys)
        return jnp.where(plan.over[:, None], jnp.take(ys, plan.rank, axis=0),
                         jnp.zeros((), ys.dtype))  # fmt: skip

    def skipped(x, *weights):
        return _zeros((x.shape[0], wo.shape[-1]), x.dtype, *like)

    return jax.lax.cond(jnp.any(plan.left > 0), run, skipped, x, *weights)


def _overflow_grads(act, plan, x, weights, dy, grads):
    """`grads` (x's and each weight's) plus the overflow rows': each block's FFN
    recomputed and its gradient taken, a block's rows past its group's masked out (both
    operands: 0 x inf is NaN), accumulated per group in float32 and added into the
    weights' gradients in place; skipped (a cond) when no group overflows."""

    def run(grads, x, dy, *weights):
        dx, *dws = grads
        xs, dys = _sorted(x, plan), _sorted(dy, plan, plan.over)
        acc = _accumulator(x.dtype)

        def group(e, carry):
            dxs, dws = carry
            we = tuple(jax.lax.dynamic_index_in_dim(w, e, 0, keepdims=False) for w in weights)
            start, blocks = _blocks(plan, e)
            end = start + plan.left[e]

            def block(j, carry):
                dxs, dwe = carry
                row = start + j * OVERFLOW_BLOCK
                mine = (row + jnp.arange(OVERFLOW_BLOCK) < end)[:, None]
                zero = jnp.zeros((), xs.dtype)
                xb, dyb = (jnp.where(mine, _rows(a, row), zero) for a in (xs, dys))
                _, pull = jax.vjp(functools.partial(_block_ffn, act), xb, *we)
                dxb, *dwb = pull(dyb)
                dxs = jax.lax.dynamic_update_slice_in_dim(dxs, dxb, row, 0)
                return dxs, tuple(a + b.astype(acc) for a, b in zip(dwe, dwb, strict=True))

            dwe = tuple(_zeros(w.shape, acc, *like) for w in we)
            dxs, dwe = jax.lax.fori_loop(0, blocks, block, (dxs, dwe))
            dws = tuple(
                jax.lax.dynamic_update_index_in_dim(
                    dw, jax.lax.dynamic_index_in_dim(dw, e, 0) + d.astype(dw.dtype)[None], e, 0
                )
                for dw, d in zip(dws, dwe, strict=True)
            )
            return dxs, dws

        dxs = _zeros(xs.shape, x.dtype, *like)
        dxs, dws = jax.lax.fori_loop(0, weights[0].shape[0], group, (dxs, tuple(dws)))
        dx = dx + jnp.where(plan.over[:, None], jnp.take(dxs, plan.rank, axis=0),
                            jnp.zeros((), dx.dtype))  # fmt: skip
        return dx, *dws

    def skipped(grads, x, dy, *weights):
        return tuple(grads)

    like = (x, dy, *weights, *grads, *plan.tree())
    grads = tuple(_like(a, *like) for a in grads)
    return jax.lax.cond(jnp.any(plan.left > 0), run, skipped, grads, x, dy, *weights)
