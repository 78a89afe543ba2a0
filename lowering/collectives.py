"""Moving a local shard between value layouts, with the least traffic: the moves.

Per mesh axis: dim i split -> dim j split is one all_to_all; split -> replicated an
all_gather; replicated -> split a local slice by axis_index (free). `plan_moves` says
which, the rules' context (lowering/plan.py) runs them as instructions of
lowering/ops.py; also the jax facts of shard_map's varying types a traced loop needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lowering.cost import traffic
from lowering.layout import ValueLayout
from namedmesh.contract import varying_axes as varying_axes  # re-exported: its old home


def nbytes(x) -> int:
    """Bytes of the local array `x`."""
    return math.prod(x.shape) * x.dtype.itemsize


class WiderCarry(Exception):
    """Raised from a planned loop body whose carry came out varying over more mesh axes
    (`axes`) than it went in: the loop is planned again with the carry cast to them."""

    def __init__(self, axes: set):
        super().__init__(axes)
        self.axes = axes


@dataclass(frozen=True)
class Move:
    """One step of a relayout. all_to_all: the split by `axes` leaves dim `dim` for dim
    `to`; all_gather: dim `dim`'s minor split by `axes` is undone; slice: `axes` split
    dim `dim` further (local)."""

    kind: str
    axes: tuple[str, ...]
    dim: int
    to: int | None = None


def plan_moves(src: ValueLayout, dst: ValueLayout) -> list[Move]:
    """The moves that take layout `src` to `dst`, with the least traffic.

    Repeatedly: move an axis that is the minor split of one dim and the next split
    `dst` wants of another with all_to_all; else all_gather the minor split of a dim
    whose splits are not a prefix of what `dst` wants. Then slice the splits `dst` adds.
    """
    cur = [tuple(a) for a in src]
    dst = [tuple(a) for a in dst]
    moves: list[Move] = []
    if cur == dst:
        return moves
    prefix = lambda i: cur[i] == dst[i][: len(cur[i])]
    while not all(prefix(i) for i in range(len(cur))):
        for i in range(len(cur)):
            a = cur[i][-1] if cur[i] else None
            j = next((j for j, d in enumerate(dst) if a in d), None)
            if (
                a is not None
                and not prefix(i)
                and j is not None
                and j != i
                and dst[j][: len(cur[j]) + 1] == cur[j] + (a,)
            ):
                moves.append(Move("all_to_all", (a,), i, j))
                cur[i], cur[j] = cur[i][:-1], cur[j] + (a,)
                break
        else:
            i = next(i for i in range(len(cur)) if not prefix(i))
            moves.append(Move("all_gather", cur[i][-1:], i))
            cur[i] = cur[i][:-1]
    for i, (c, d) in enumerate(zip(cur, dst, strict=True)):
        if d[len(c) :]:
            moves.append(Move("slice", d[len(c) :], i))
    return moves


def relayout_traffic(
    src: ValueLayout, dst: ValueLayout, nbytes: int, sizes: dict[str, int]
) -> float:
    """Bytes one device sends (lowering.cost.traffic) for `relayout` of a local shard of
    `nbytes` bytes from layout `src` to `dst`: the same moves, costed."""
    total = 0.0
    for m in plan_moves(src, dst):
        n = math.prod(sizes[a] for a in m.axes)
        if m.kind == "slice":
            nbytes //= n
            continue
        total += traffic(m.kind, m.axes, nbytes, sizes)
        if m.kind == "all_gather":
            nbytes *= n
    return total
