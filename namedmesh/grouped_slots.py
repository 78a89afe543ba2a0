"""The grouped FFN's jax kernel (`nm.grouped_ffn`), dropless and exact whatever the
load, its rows sorted by group once, in one of two ways chosen at run time (a cond):

- every group within `cap` rows (an even share m of the rows and 3 sqrt(m), rounded up
  to 8: `slot_capacity`): the rows gathered into a (groups, cap, c) buffer of slots,
  the whole FFN as batched matmuls (XLA's plain dots, forward and backward);
- else (an uneven load, or at most half the rows inside: an expert-split shard): the
  sorted rows by one loop over each group's blocks (`loop_blocks`, `over_group`: its
  row count's binary digits, up to 1024 rows a block), the whole FFN a block, each
  weight sliced once per group.

Its gradient is written out (a custom vjp) rather than jax's of the composition, for
what that cost (docs/benchmarks.md, "MoE experts' path (issue 40)"): jax's gradient of
a cond makes every residual of either branch an output of both (zero-filled when not
taken), and a row loop's gradient is loops of its own. Here both ways save the same
three buffers (the rows and the hidden layer's products, as slots or as sorted rows),
and the backward takes the forward's way. The work is the rows' (and the slots' slack,
or each group's last block's) whatever the load.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from namedmesh.contract import varying_axes
from namedmesh.grouped import over_blocks, rows_at


def slot_capacity(rows: int, groups: int) -> int:
    """Slots per group: an even share m of `rows` and 3 sqrt(m) (an even random load's
    busiest group stays within that with probability about 0.999 per group), rounded
    up to 8, and no more than the rows."""
    m = rows / groups
    return min(max(8, math.ceil((m + 3 * math.sqrt(m)) / 8) * 8), math.ceil(rows / 8) * 8)


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


def sorted_slots(g, groups: int, cap: int):
    """(order: the rows sorted by group, those outside [0, groups) last; each group's
    first sorted row and row count; src (groups x cap): each slot's row, `rows` for an
    empty slot; at (rows,): each row's slot, or groups x cap for a row outside or past
    its group's capacity; rank (rows,): each row's sorted place)."""
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
    return order, first, count, src.reshape(-1), at, rank


def slotted_ffn(act, x, g, wi, wo, wg=None):
    """The FFN of rows x (n, c) by their groups g (n,): act(x @ wi[g]) (* x @ wg[g]) @
    wo[g], zero for a group outside [0, groups); weights (groups, in, out). Inside
    shard_map every operand is cast to vary where any does first: the custom vjp's
    cotangents vary there, and jax sums them back over the axes an operand was
    invariant over (the cast's transpose)."""
    ws = (x, wi, wo) + (() if wg is None else (wg,))
    ws = tuple(_like(a, *ws, g) for a in ws)
    n, groups = x.shape[0], wi.shape[0]
    return _ffn(act, (slot_capacity(n, groups), loop_blocks(n, groups)), g, *ws)


class Plan:
    """Where each row goes (`sorted_slots`) and which way runs: `slots`, when every
    group is within its slots and more than half the rows are inside."""

    def __init__(self, g, groups: int, cap: int):
        self.order, self.first, self.count, self.src, self.at, self.rank = sorted_slots(
            g, groups, cap
        )
        self.slots = jnp.all(self.count <= cap) & (2 * jnp.sum(self.count) > g.shape[0])
        self.inside = (g >= 0) & (g < groups)

    def tree(self):
        return (self.order, self.first, self.count, self.src, self.at, self.rank, self.slots,
                self.inside)  # fmt: skip

    @classmethod
    def of(cls, tree):
        plan = cls.__new__(cls)
        (plan.order, plan.first, plan.count, plan.src, plan.at, plan.rank, plan.slots,
         plan.inside) = tree  # fmt: skip
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


def _products(spec, rows, wi, wg):
    """The hidden layer's products: (x wi,) or (x wi, x wg)."""
    return tuple(_mm(spec, rows, w) for w in (wi, *wg))


def _hidden(act, products):
    h = act(products[0])
    return h * products[1] if len(products) == 2 else h


def saved_rows(rows: int, groups: int) -> int:
    """Rows of each buffer the kernel's backward pass keeps for `rows` rows in `groups`
    groups (the rows themselves and the hidden layer's products: `_ffn_forward`)."""
    return _saved_rows(rows, groups, slot_capacity(rows, groups), loop_blocks(rows, groups))


def _saved_rows(n: int, groups: int, cap: int, blocks) -> int:
    """Rows of the saved buffers, which hold either way's: the slots, or the sorted rows
    and a smallest block after them (a group's last block reaches past its rows by
    less: `over_group`)."""
    return max(groups * cap, n + blocks[-1])


def _padded(a, rows: int):
    return jnp.pad(a, ((0, rows - a.shape[0]), (0, 0)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ffn(act, sizes, g, x, wi, wo, *wg):
    return _ffn_forward(act, sizes, g, x, wi, wo, *wg)[0]


# the kernel's ops carry this name in their HLO metadata (a profile's buckets:
# benchmarks/step_profile.py), forward and backward
SCOPE = "grouped_ffn"


@jax.named_scope(SCOPE)
def _ffn_forward(act, sizes, g, x, wi, wo, *wg):
    (cap, blocks), (n, c), groups = sizes, x.shape, wi.shape[0]
    plan, rows = Plan(g, groups, cap), _saved_rows(n, groups, cap, blocks)

    def slotted(x, wi, wo, *wg):
        slots = _gather(x, plan.src).reshape(groups, cap, c)
        products = _products("gsc,gcf->gsf", slots, wi, wg)
        out = _mm("gsf,gfo->gso", _hidden(act, products), wo).reshape(groups * cap, -1)
        saved = (slots, *products)
        return _gather(out, plan.at), *(_padded(a.reshape(groups * cap, -1), rows) for a in saved)

    def looped(x, wi, wo, *wg):
        ys, saved = _loop_forward(act, plan, blocks, rows, x, wi, wo, *wg)
        return _unsorted(ys, plan), *saved

    y, *saved = jax.lax.cond(plan.slots, slotted, looped, x, wi, wo, *wg)
    return y, (plan.tree(), wi, wo, wg, saved)


def _unsorted(ys, plan):
    """The sorted rows `ys` back in the rows' order, a row outside the groups zero."""
    return jnp.where(plan.inside[:, None], jnp.take(ys, plan.rank, axis=0), jnp.zeros((), ys.dtype))


@jax.named_scope(SCOPE)
def _ffn_backward(act, sizes, res, dy):
    (cap, blocks), (tree, wi, wo, wg, saved) = sizes, res
    plan, o, (groups, c) = Plan.of(tree), dy.shape[1], wi.shape[:2]

    def slotted(dy, wi, wo, *wg):
        slots, *products = (a[: groups * cap].reshape(groups, cap, -1) for a in saved)
        dout = _gather(dy, plan.src).reshape(groups, cap, o)
        h, pull = jax.vjp(functools.partial(_hidden, act), tuple(products))
        dwo = _mm("gsf,gso->gfo", h, dout)
        (dproducts,) = pull(_mm("gso,gfo->gsf", dout, wo))
        dslots = sum(_mm("gsf,gcf->gsc", d, w) for d, w in zip(dproducts, (wi, *wg), strict=True))
        dws = tuple(_mm("gsc,gsf->gcf", slots, d) for d in dproducts)
        dx = _gather(dslots.reshape(groups * cap, c), plan.at)
        return dx, dws[0], dwo, *dws[1:]

    def looped(dy, wi, wo, *wg):
        dxs, dws = _loop_backward(act, plan, blocks, saved, dy, wi, wo, *wg)
        return _unsorted(dxs, plan), *dws

    grads = jax.lax.cond(plan.slots, slotted, looped, dy, wi, wo, *wg)
    return (None, *grads)


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
