"""How a two-operand contraction is laid out for one `jax.lax.dot_general` that XLA runs
without copying its operands (issue 40 item 1).

XLA canonicalises every dot to [batch, free, summed] x [batch, summed, free] before its
backends see it (its DotDecomposer): a dot with more than one summed or free dim, or
batch dims that do not lead, gets its operands transposed into that form, a copy of
each. A weight's gradient `x[batch, length, d] g[batch, length, f] -> w[d, f]` sums
two dims, so XLA copied x (or g) to [d, batch * length] although XLA:CPU's dot reads
a 2-d left operand summed over its first dim in place (a strided GEMM). Here each
operand whose batch dims lead and whose other dims form a free group and a summed
group, in either order, is reshaped to [batch, free, summed] or [batch, summed,
free], a bitcast, so the dot is canonical as it stands; only an operand whose dims
interleave otherwise is transposed.

XLA:CPU's dot with its left operand summed over its first dims (summed, then free) is
fast only when the right operand is [summed, free] too and the left has no more free
elements than the right ([2048, 8192]^T [2048, 512] ran at 0.72 of the rate of
[2048, 512]^T [2048, 8192], docs/benchmarks.md "Movement planned away"); otherwise
that operand counts as copied, and is copied to [batch, free, summed], where
XLA:CPU's YNNPACK dot runs at its rate, or summed first where its free size is at most
SUMMED_FIRST_MAX and the right operand allows it (attention's key gradient).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax

# The largest free size of a left operand that XLA:CPU's dot runs faster read summed
# dims first ([K, M]) than summed dims last ([M, K]): measured 119-141 GFLOP/s against
# 57 at M = 64, about equal at 512, 0.6-0.8x at 2048 (docs/benchmarks.md, "Dot rates
# per shape"). A copy to that order is pinned (an optimization barrier on CPU), or XLA
# folds the transpose into the dot and copies in its own order.
SUMMED_FIRST_MAX = 512


class Plan(NamedTuple):
    """The dot of `lhs x rhs`: the batch and summed dims in the order both operands
    are read in, each operand's dims as the dot reads them (its own order where it is
    read in place, else the order it is copied to), the dims the dot writes, and the
    elements copied to run it (operands transposed, and the result if `out` wants
    another order)."""

    batch: tuple
    summed: tuple
    lhs: tuple
    rhs: tuple
    result: tuple
    copied: int


def _grouped(dims, batch, summed) -> str | None:
    """ "free first" or "summed first" where `dims` run `batch`, then their free dims
    and `summed` (in that order) as two groups, either one first; else None."""
    n = len(batch)
    if tuple(dims[:n]) != batch:
        return None
    rest = dims[n:]
    k = len(rest) - len(summed)
    if tuple(rest[k:]) == summed:
        return "free first"
    if tuple(rest[: len(summed)]) == summed:
        return "summed first"
    return None


def _candidate(lhs, rhs, out, batch, summed, sizes) -> Plan:
    """The plan whose operands are read with `batch` and `summed` in these orders."""
    size = lambda dims: math.prod(sizes[d] for d in dims)
    l_free = tuple(d for d in lhs if d not in batch and d not in summed)
    r_free = tuple(d for d in rhs if d not in batch and d not in summed)
    copied = 0
    r_read = rhs
    if _grouped(rhs, batch, summed) is None:
        r_read, copied = (*batch, *summed, *r_free), size(rhs)
    l_read = lhs
    how = _grouped(lhs, batch, summed)
    r_summed_first = _grouped(r_read, batch, summed) == "summed first" or not r_free
    k_first_ok = r_summed_first and size(l_free) <= size(r_free)
    if how is None or (how == "summed first" and l_free and summed and not k_first_ok):
        # copied summed first where that order runs faster (a small free size; dotrate's
        # measurement, SUMMED_FIRST_MAX), else as XLA canonicalises it, summed last
        first = k_first_ok and summed and size(l_free) <= SUMMED_FIRST_MAX
        order = (*summed, *l_free) if first else (*l_free, *summed)
        l_read, copied = (*batch, *order), copied + size(lhs)
    result = (*batch, *l_free, *r_free)
    if tuple(out) != result:
        copied += size(out)
    return Plan(batch, summed, l_read, r_read, result, copied)


@functools.lru_cache(maxsize=4096)
def plan(lhs: tuple, rhs: tuple, out: tuple, sizes: tuple) -> Plan:
    """The cheapest `Plan` of `lhs x rhs -> out` with `lhs` on the left (every dim of
    each operand is in the other or in `out`; `sizes` a sorted tuple of (dim, size)):
    the batch and summed dims in the left operand's order, the right's or the
    result's, whichever copies fewest elements (ties: the left's)."""
    sizes_ = dict(sizes)
    batch = {d for d in lhs if d in rhs and d in out}
    summed = {d for d in lhs if d in rhs and d not in out}
    best = None
    for src_b in (lhs, rhs, out):
        for src_s in (lhs, rhs):
            b = tuple(d for d in src_b if d in batch)
            s = tuple(d for d in src_s if d in summed)
            got = _candidate(lhs, rhs, out, b, s, sizes_)
            if best is None or got.copied < best.copied:
                best = got
    return best


def transposed(x, dims: tuple, order: tuple):
    """x (dims `dims`) with its dims in `order` (a copy unless it is `dims`)."""
    if tuple(dims) == tuple(order):
        return x
    return jax.numpy.transpose(x, tuple(dims.index(d) for d in order))


def _read(x, dims, read, batch, summed, left=False):
    """x (dims `dims`) as the dot reads it: transposed to `read` where it differs, then
    its free and summed groups each merged into one dim (a bitcast)."""
    if tuple(dims) != tuple(read):
        x = transposed(x, dims, read)
        pinned = left and len(read) > len(batch) and read[len(batch)] in summed
        if pinned and jax.default_backend() == "cpu":  # summed first: SUMMED_FIRST_MAX
            x = jax.lax.optimization_barrier(x)
    shape = dict(zip(read, x.shape, strict=True))
    n = len(batch)
    groups = []
    for d in read[n:]:
        kind = d in summed
        if not groups or groups[-1][0] != kind:
            groups.append((kind, []))
        groups[-1][1].append(d)
    merged = [shape[d] for d in batch] + [math.prod(shape[d] for d in g) for _, g in groups]
    return x.reshape(merged), [kind for kind, _ in groups]


def dot(a, b, a_dims: tuple, b_dims: tuple, p: Plan, sizes: dict, precision=None):
    """`a x b` (a on the left) by plan `p`: one canonical dot_general, its result with
    dims `p.result` (the merged groups split again, a bitcast)."""
    n = len(p.batch)
    a, a_groups = _read(a, a_dims, p.lhs, p.batch, p.summed, left=True)
    b, b_groups = _read(b, b_dims, p.rhs, p.batch, p.summed)
    summed = lambda groups: (n + groups.index(True),) if True in groups else ()
    numbers = ((summed(a_groups), summed(b_groups)), (tuple(range(n)), tuple(range(n))))
    y = jax.lax.dot_general(a, b, numbers, precision=precision)
    return y.reshape([sizes[d] for d in p.result])
