"""Moving a local shard between value layouts inside shard_map, with the least traffic.

Per mesh axis: dim i split -> dim j split is one all_to_all; split -> replicated an
all_gather; replicated -> split a local slice by axis_index (free). Every collective
issued is reported to `log(kind, axes, nbytes)` so plans and reports can show it
(with `transposes=False` when its transpose in the backward pass is local).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax

from lowering.cost import traffic
from lowering.layout import ValueLayout

Log = Callable[..., None]  # log(kind, axes, nbytes, transposes=True)


def nbytes(x) -> int:
    """Bytes of the local array `x`."""
    return math.prod(x.shape) * x.dtype.itemsize


def axis_index(axes: tuple[str, ...], sizes: dict[str, int]):
    """This device's position along the mesh axes `axes`, major to minor."""
    idx = 0
    for a in axes:
        idx = idx * sizes[a] + jax.lax.axis_index(a)
    return idx


def slice_to(x, dim: int, axes: tuple[str, ...], sizes: dict[str, int]):
    """This device's block of dim `dim` when `axes` split it further (no communication)."""
    if not axes:
        return x
    n = x.shape[dim] // math.prod(sizes[a] for a in axes)
    return jax.lax.dynamic_slice_in_dim(x, axis_index(axes, sizes) * n, n, axis=dim)


def gather(x, dim: int, axes: tuple[str, ...], log: Log):
    """Undo the split of dim `dim` by `axes` (the minor-most axes of its split).

    The result stays "varying" over `axes` so that its transpose is a reduce-scatter
    (FSDP's gradient); `make_invarying` fixes up results that leave replicated."""
    if not axes:
        return x
    name = axes[0] if len(axes) == 1 else axes
    log("all_gather", axes, nbytes(x))
    return jax.lax.all_gather(x, name, axis=dim, tiled=True)


def varying_axes(x) -> set[str]:
    """The mesh axes over which shard_map types `x` as varying (its `vma`)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:  # jax 0.10 keeps it in the aval's manual axis type
        vma = aval.manual_axis_type.varying
    return set(vma)


class WiderCarry(Exception):
    """Raised from a planned loop body whose carry came out varying over more mesh axes
    (`axes`) than it went in: the loop is planned again with the carry cast to them."""

    def __init__(self, axes: set):
        super().__init__(axes)
        self.axes = axes


def make_invarying(x, axes: tuple[str, ...], sizes: dict[str, int], log: Log):
    """`x`, equal on every device along `axes` but typed varying there, as a value that
    shard_map may return replicated: a psum of device 0's copy. (A slice and gather back
    would move half the bytes, but XLA folds it into the gather that made `x`, and the
    plan would no longer be what runs.)"""
    axes = tuple(a for a in sizes if a in axes)
    if not axes:
        return x
    log("psum", axes, nbytes(x))
    first = axis_index(axes, sizes) == 0
    return psum(jax.numpy.where(first, x, jax.numpy.zeros_like(x)), axes)


def psum(x, axes: tuple[str, ...]):
    """The sum of `x` over the devices of `axes`, in `x`'s dtype: bools are ORed (their
    sum in NumPy), where jax.lax.psum would make them int32 counts. A bool that a rule
    psums (a gather's or slice's block, zero elsewhere; device 0's copy) must stay bool,
    or `~x` downstream is a bitwise not of an integer."""
    name = axes[0] if len(axes) == 1 else tuple(axes)
    if x.dtype == jax.numpy.bool_:
        return jax.lax.pmax(x, name)
    return jax.lax.psum(x, name)


def mesh_position(pos: int, axes: tuple[str, ...], sizes: dict[str, int]) -> int:
    """The position `pos` along `axes` as numbered in their tuple's order (as
    `axis_index(axes, sizes)` numbers it), renumbered in the mesh's axis order."""
    coords = {}
    for a in reversed(axes):
        pos, coords[a] = divmod(pos, sizes[a])
    out = 0
    for a in (a for a in sizes if a in axes):
        out = out * sizes[a] + coords[a]
    return out


def ppermute(x, axes: tuple[str, ...], perm, sizes: dict[str, int], log: Log):
    """`x` sent along the mesh axes `axes` by `perm`, pairs (source, destination) of
    positions numbered as `axis_index(axes, sizes)` numbers them: the tuple's order, major
    to minor, the order of a PartitionSpec's blocks and of all_gather, psum_scatter and
    all_to_all over the tuple. jax.lax.ppermute alone reads a permutation over several
    axes in the mesh's axis order whatever the tuple's order (jax 0.10), so the pairs
    are renumbered here, for every rule, and the axes passed in mesh order."""
    log("ppermute", axes, nbytes(x))
    in_mesh = tuple(a for a in sizes if a in axes)
    at = lambda p: mesh_position(p, axes, sizes)
    return jax.lax.ppermute(
        x, in_mesh[0] if len(in_mesh) == 1 else in_mesh, [(at(s), at(d)) for s, d in perm]
    )


def gather_stacked(x, axes: tuple[str, ...], log: Log):
    """Every device's `x` along the mesh axes `axes`, stacked on a new leading dim; its
    result is invariant, so its transpose is a local slice."""
    log("all_gather", axes, nbytes(x), transposes=False)
    return jax.lax.all_gather(x, axes[0] if len(axes) == 1 else axes, axis=0, to="invarying")


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


def relayout(x, src: ValueLayout, dst: ValueLayout, sizes: dict[str, int], log: Log):
    """The local shard of layout `dst` from the local shard `x` of layout `src`, by the
    moves of `plan_moves`."""
    for m in plan_moves(src, dst):
        if m.kind == "all_to_all":
            log("all_to_all", m.axes, nbytes(x))
            x = jax.lax.all_to_all(x, m.axes[0], split_axis=m.to, concat_axis=m.dim, tiled=True)
        elif m.kind == "all_gather":
            x = gather(x, m.dim, m.axes, log)
        else:
            x = slice_to(x, m.dim, m.axes, sizes)
    return x


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


def psum_scatter(x, axes: tuple[str, ...], dim: int):
    """The block along `dim` of the sum of `x` over the devices of `axes`, in `x`'s dtype:
    bools are ORed (counted in int32, which no mesh wraps), where jax.lax.psum_scatter
    refuses them."""
    name = axes[0] if len(axes) == 1 else tuple(axes)
    if x.dtype == jax.numpy.bool_:
        counts = jax.lax.psum_scatter(x.astype(jax.numpy.int32), name, scatter_dimension=dim,
                                      tiled=True)  # fmt: skip
        return counts != 0
    return jax.lax.psum_scatter(x, name, scatter_dimension=dim, tiled=True)


def pmax(x, axes, log: Log):
    if not axes:
        return x
    log("pmax", axes, nbytes(x))
    return jax.lax.pmax(x, axes)


def pmin(x, axes, log: Log):
    if not axes:
        return x
    log("pmin", axes, nbytes(x))
    return jax.lax.pmin(x, axes)
