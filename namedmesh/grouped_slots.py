"""The grouped FFN's jax kernel (`nm.grouped_ffn`), dropless and exact whatever the
load: rows sorted by group once, each group's first `cap` rows (an even share m of the
rows and 3 sqrt(m), rounded up to 8: `slot_capacity`) gathered into a (groups, cap, c)
buffer that runs the whole FFN as batched matmuls, and each group's rows past its slots
(the overflow of an uneven load) by the grouped matmul's row loops (`ranges_product`)
on the same sorted rows, under a cond that skips them when no group overflows. The
batched matmuls are XLA's plain dots, forward and backward (a contraction over the
slots for the weights' gradients), where the row loops multiply blocks of at most 128
rows (docs/benchmarks.md, "MoE experts' path (issue 40)": 0.90 of the loops' time at
2048 tokens, d_model 512, 8 experts, top 2; 0.76 at 512 tokens). The work is bounded:
the slots (the rows and the slack under an even load) plus the overflow rows.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from namedmesh.contract import varying_axes
from namedmesh.grouped import block_sizes, ranges_product


def slot_capacity(rows: int, groups: int) -> int:
    """Slots per group of the batched part: an even share m of `rows` and 3 sqrt(m)
    (an even random load's busiest group stays within that with probability about
    0.999 per group, so the row loops rarely run), rounded up to 8 (at least 8: a
    range's last row block reaches at most 7 rows past it, into the next group's slots,
    never its overflow), and no more than the rows."""
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
    outside), the slots, sized for every row, would compute mostly padding: the row
    loops take every row then (a cond)."""
    (n, c), groups = x.shape, wi.shape[0]
    cap = slot_capacity(n, groups)
    order, first, count, src, at, rank, place = sorted_slots(g, groups, cap)
    few = 2 * jnp.sum(count) <= n
    skip = jnp.where(few, 0, cap)

    def slotted(x, wi, wo, *wg):
        slots = moved(x, src, at).reshape(groups, cap, c)
        h = act(batched(slots, wi))
        if wg:
            h = h * batched(slots, wg[0])
        return moved(batched(h, wo).reshape(groups * cap, -1), at, src)

    ws = (x, wi, wo) + (() if wg is None else (wg,))
    y = jax.lax.cond(few, functools.partial(zeros, like=order), slotted, *ws)
    left = jnp.maximum(count - skip, 0)
    return y + overflow(act, x, order, first + skip, left, rank, place >= skip, (wi, wo, wg))


def zeros(x, wi, wo, *wg, like):
    """The rows' zero result (n, o), varying as a product of the operands (and `like`)
    does inside shard_map: a cond's branches must agree."""
    vary = tuple(set().union(*(varying_axes(a) for a in (x, wi, wo, *wg, like))))
    zero = jnp.zeros((x.shape[0], wo.shape[-1]), x.dtype)
    return jax.lax.pcast(zero, vary, to="varying") if vary else zero


@jax.custom_vjp
def moved(a, to, back):
    """a's rows `to` (an index past the last row: a zero row), whose gradient is the
    cotangent's rows `back`: each row's place in `to` (past the last: none), as `to`
    and `back` are one-to-one on the rows they name. A gather both ways: jax's gradient
    of a gather is a scatter-add, which XLA:CPU runs row by row."""
    return jnp.take(_zero_row(a), to, axis=0)


def _zero_row(a):
    return jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])


def _moved_forward(a, to, back):
    return moved(a, to, back), back


def _moved_backward(back, ct):
    return jnp.take(_zero_row(ct), back, axis=0), None, None


moved.defvjp(_moved_forward, _moved_backward)


def batched(slots, w):
    """Each group's slots (groups, cap, in) times its weight (groups, in, out), summed in
    float32 at least (as the NumPy reference sums), in the operands' dtype."""
    acc = jnp.promote_types(slots.dtype, jnp.float32)
    y = jnp.einsum("gsc,gcf->gsf", slots, w, preferred_element_type=acc)
    return y.astype(slots.dtype)


def overflow(act, x, order, first, count, rank, over, weights):
    """The FFN of each group's sorted rows [first, first + count) (those past its
    capacity) by the row loops, zero for the other rows; skipped (a cond) when no
    group overflows."""
    wi, wo, wg = weights
    pad = block_sizes(x.shape[0])[0]

    def run(x, wi, wo, *wg):
        xs = jnp.pad(jnp.take(x, order, axis=0), ((0, pad), (0, 0)))
        h = act(ranges_product(xs, wi, first, count))
        if wg:
            h = h * ranges_product(xs, wg[0], first, count)
        ys = ranges_product(h, wo, first, count)
        return jnp.where(over[:, None], jnp.take(ys, rank, axis=0), jnp.zeros((), ys.dtype))

    ws = (x, wi, wo) + (() if wg is None else (wg,))
    return jax.lax.cond(jnp.any(count > 0), run, functools.partial(zeros, like=order), *ws)
