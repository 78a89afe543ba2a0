"""The instructions a plan is made of, each defined once: `OPS[name]` is an `Op`.

An instruction is one operation on local shards inside shard_map: a primitive run
locally, a collective, a slice by this device's index, a cast. Its row holds
everything the lowering knows of it:

- `abstract(xs, mesh, **params)`: the `Local` it makes from the `Local`s `xs` (shape,
  dtype, and the mesh axes shard_map types it varying over) on a mesh of sizes `mesh`, which
  the Planner (lowering/plan.py) records without calling jax;
- `run(*arrays, **params)`: its jax implementation, which the emitter (lowering/emit.py)
  calls on local arrays;
- for a collective, `traffic(n, S)`: the bytes one device sends over n devices when each
  puts in S bytes (ring algorithms; lowering/cost.py sums them); `hlo`, the op it
  compiles to, with `hlo_bytes(n, S)`, its result's bytes, and `groups`, whether the
  HLO names replica groups (lowering/hlo.py reads them back); `rate`, the collective
  whose measured bytes/s prices it and `measure(x, k)`, its microbenchmark on one mesh
  axis "all" of k devices (lowering/rates.py);
- `backward`: the collective its transpose issues under shard_map's varying types, with
  the bytes each device puts in, `(kind, bytes(n, S))`; None where the transpose is
  local (a psum's is a broadcast, a slice's a pad);
- `logs`: the collective kind the plan records when a rule runs it (its own name, or
  the row whose traffic it has: a gather stacked on a new dim is an all_gather).

A new collective is one row here; the rules' context (`RuleContext.collective`) runs
any row by name. The loop (`scan`) is the emitter's and the Planner's own: its
instruction holds the body's steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from lowering.caches import memo
from lowering.expert_routes import routed
from lowering.shards import Local, all_to_all, axis_name
from lowering.shards import fmt_local as fmt_local  # re-exported: its old home
from namedmesh.contract import varying_axes
from namedmesh.primitive import Aval


@dataclass(frozen=True)
class Op:
    """One instruction's row (see the module's docstring)."""

    abstract: Callable
    run: Callable
    traffic: Callable | None = None  # (n, S) -> bytes sent per device; None: no collective
    hlo: str | None = None
    hlo_bytes: Callable | None = None  # (n, S) -> the HLO result's bytes
    groups: bool = True  # the HLO op names replica groups (a permute names pairs)
    hlo_pieces: bool = False  # its HLO result may be a tuple of one piece per peer
    backward: tuple | None = None  # (kind, (n, S) -> bytes in) of its transpose
    logs: str | None = None  # the collective kind recorded (None: this row's, if any)
    transposes: bool = True  # False: the transpose of what `logs` records is local
    rate: str | None = None  # the measured kind that prices it (None: its own)
    measure: Callable | None = None  # (x, k) -> y on mesh axis "all": its microbenchmark
    measure_in: Callable = lambda nbytes, k: nbytes  # bytes each device puts in there


# --- jax implementations -------------------------------------------------------------
def axis_index(axes: tuple[str, ...], sizes: dict[str, int]):
    """This device's position along the mesh axes `axes`, major to minor."""
    idx = 0
    for a in axes:
        idx = idx * sizes[a] + jax.lax.axis_index(a)
    return idx


def slice_to(x, axes: tuple[str, ...], dim: int, sizes: dict[str, int]):
    """This device's block of dim `dim` when `axes` split it further (no communication)."""
    if not axes:
        return x
    n = x.shape[dim] // math.prod(sizes[a] for a in axes)
    return jax.lax.dynamic_slice_in_dim(x, axis_index(axes, sizes) * n, n, axis=dim)


def psum(x, axes: tuple[str, ...]):
    """The sum of `x` over the devices of `axes`, in `x`'s dtype: bools are ORed (their
    sum in NumPy), where jax.lax.psum would make them int32 counts. A bool that a rule
    psums (a gather's or slice's block, zero elsewhere; device 0's copy) must stay bool,
    or `~x` downstream is a bitwise not of an integer."""
    if x.dtype == jnp.bool_:
        return jax.lax.pmax(x, axis_name(axes))
    return jax.lax.psum(x, axis_name(axes))


def psum_scatter(x, axes: tuple[str, ...], dim: int):
    """The block along `dim` of the sum of `x` over the devices of `axes`, in `x`'s dtype:
    bools are ORed (counted in int32, which no mesh wraps), where jax.lax.psum_scatter
    refuses them."""
    name = axis_name(axes)
    if x.dtype == jnp.bool_:
        counts = jax.lax.psum_scatter(x.astype(jnp.int32), name, scatter_dimension=dim,
                                      tiled=True)  # fmt: skip
        return counts != 0
    return jax.lax.psum_scatter(x, name, scatter_dimension=dim, tiled=True)


def make_invarying(x, axes: tuple[str, ...], sizes: dict[str, int]):
    """`x`, equal on every device along `axes` but typed varying there, as a value that
    shard_map may return replicated: a psum of device 0's copy. (A slice and gather back
    would move half the bytes, but XLA folds it into the gather that made `x`, and the
    plan would no longer be what runs.)"""
    first = axis_index(axes, sizes) == 0
    return psum(jnp.where(first, x, jnp.zeros_like(x)), axes)


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


def ppermute(x, axes: tuple[str, ...], perm, sizes: dict[str, int]):
    """`x` sent along the mesh axes `axes` by `perm`, pairs (source, destination) of
    positions numbered as `axis_index(axes, sizes)` numbers them: the tuple's order, major
    to minor, the order of a PartitionSpec's blocks and of all_gather, psum_scatter and
    all_to_all over the tuple. jax.lax.ppermute alone reads a permutation over several
    axes in the mesh's axis order whatever the tuple's order (jax 0.10), so the pairs
    are renumbered here, for every rule, and the axes passed in mesh order."""
    in_mesh = tuple(a for a in sizes if a in axes)
    at = lambda p: mesh_position(p, axes, sizes)
    return jax.lax.ppermute(x, axis_name(in_mesh), [(at(s), at(d)) for s, d in perm])


def all_gather(x, axes: tuple[str, ...], dim: int):
    """Undo the split of dim `dim` by `axes` (the minor-most axes of its split). The
    result stays varying over `axes`, so that its transpose is a reduce-scatter (FSDP's
    gradient); `make_invarying` fixes up results that leave replicated."""
    return jax.lax.all_gather(x, axis_name(axes), axis=dim, tiled=True)


def gather_stacked(x, axes: tuple[str, ...]):
    """Every device's `x` along `axes`, stacked on a new leading dim; invariant, so its
    transpose is a local slice."""
    return jax.lax.all_gather(x, axis_name(axes), axis=0, to="invarying")


def run_local(*xs, local_op, **params):
    """A primitive's jax implementation on local shards, its results held to the shape
    rule's dtypes (jax may widen: argmax gives int64 under jax_enable_x64) and, where
    empty, to varying where the shards are (`abstract_local`)."""
    prim, dtypes, _ = local_op
    out = prim.jax_impl(*xs, **params)
    outs = out if prim.multiple_results else (out,)
    outs = tuple(o if o.dtype == t else o.astype(t) for o, t in zip(outs, dtypes, strict=True))
    if any(o.size == 0 for o in outs):
        vma = set().union(*(varying_axes(x) for x in xs))
        outs = tuple(_varying(o, vma) if o.size == 0 else o for o in outs)
    return outs


def _varying(x, vma: set):
    """An empty `x` typed varying over `vma`: jax makes some ops' empty results afresh,
    invariant (jnp.where's: an integer floor_divide, top_k's sort keys), where the plan
    has them varying as their inputs are (a PlanMismatch; unchecked, raw errors)."""
    missing = tuple(sorted(vma - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


# --- abstract rules: (Locals, the mesh's sizes, params) -> Local(s) ------------------------
def _vma(xs) -> frozenset:
    return xs[0].vma if len(xs) == 1 else frozenset().union(*(x.vma for x in xs))


def _span(sizes, axes) -> int:
    return math.prod(sizes[a] for a in axes)


def _scaled(shape, dim: int, by: float) -> tuple[int, ...]:
    return tuple(int(n * by) if i == dim else n for i, n in enumerate(shape))


def _permuted(xs, mesh, axes=(), **_):
    """Shape and dtype kept, varying over `axes` even where `x` is not: each device
    receives another's block (jax types a ppermute's result so; a block made alike on
    every device, as `nm.full` over a split dim is, typed invariant, gave a PlanMismatch
    and without the check a raw ValueError of a pcast to varying)."""
    (x,) = xs
    return Local(x.shape, x.dtype, x.vma | set(axes))


def _reduced(xs, mesh, axes, **_):
    """Shape kept, invariant over `axes` (an all-reduce)."""
    (x,) = xs
    return Local(x.shape, x.dtype, x.vma - set(axes))


def _cast(xs, mesh, axes, **_):
    (x,) = xs
    return Local(x.shape, x.dtype, x.vma | set(axes))


def _astype(xs, mesh, dtype):
    (x,) = xs
    return Local(x.shape, np.dtype(dtype), x.vma)


def _axis_index(xs, mesh, axes, **_):
    return Local((), np.dtype(np.int32), frozenset(axes))


def _scattered(xs, mesh, axes, dim):
    """Varying over `axes`, as each device's block is (and as jax types it, its input
    typed invariant there or not)."""
    (x,) = xs
    return Local(_scaled(x.shape, dim, 1 / _span(mesh, axes)), x.dtype, x.vma | set(axes))


def _sliced(xs, mesh, axes, dim, **_):
    (x,) = xs
    return Local(_scaled(x.shape, dim, 1 / _span(mesh, axes)), x.dtype, x.vma | set(axes))


def _gathered(xs, mesh, axes, dim):
    """Varying over `axes` even where `x` is not (a block made alike on every device, as
    `nm.full` over a split dim is): jax types an all_gather's result so (as it does a
    reduce-scatter's and an all_to_all's: `_scattered`, `_moved`)."""
    (x,) = xs
    return Local(_scaled(x.shape, dim, _span(mesh, axes)), x.dtype, x.vma | set(axes))


def _stacked(xs, mesh, axes):
    (x,) = xs
    return Local((_span(mesh, axes), *x.shape), x.dtype, x.vma - set(axes))


def _moved(xs, mesh, axes, dim, to):
    (x,) = xs
    n = _span(mesh, axes)
    return Local(_scaled(_scaled(x.shape, dim, n), to, 1 / n), x.dtype, x.vma | set(axes))


def _given(xs, mesh, shape, dtype, **_):
    """A result of the given shape and dtype, varying where its inputs do."""
    return Local(tuple(shape), np.dtype(dtype), _vma(xs))


def abstract_local(xs, mesh, local_op, **params) -> tuple[Local, ...]:
    """A primitive on local shards: its shape rule on their local avals."""
    prim, dtypes, in_dims = local_op
    kw = tuple(params.items())
    shards = tuple((tuple(x.shape), np.dtype(x.dtype)) for x in xs)
    try:
        shapes = local_shapes(prim, in_dims, shards, kw)
    except TypeError:  # a param that does not hash
        shapes = local_shapes.__wrapped__(prim, in_dims, shards, kw)
    vma = _vma(xs) if xs else frozenset()
    return tuple(Local(shape, np.dtype(t), vma) for shape, t in zip(shapes, dtypes, strict=True))


@memo()  # the same local op on the same shards recurs in many candidate layouts
def local_shapes(prim, in_dims, shards, kw) -> tuple:
    """The result shapes of `prim`'s shape rule on local shards (shape, dtype) of values
    of dims `in_dims`, with params `kw` (items)."""
    avals = [Aval(d, shape, dt) for d, (shape, dt) in zip(in_dims, shards, strict=False)]
    out = prim.shape_rule(*avals, **dict(kw))
    return tuple(tuple(o.shape) for o in (out if prim.multiple_results else (out,)))


# --- the table -----------------------------------------------------------------------
def _all_reduce(n, s):
    return 2 * (n - 1) / n * s


def _as_is(n, s):
    return s


def _others_share(n, s):  # what the n - 1 other devices get of S
    return (n - 1) / n * s


def _ring(k) -> list:
    return [(j, (j + 1) % k) for j in range(k)]


_ALL = ("all",)  # the one mesh axis of the rates' microbenchmarks

OPS: dict[str, Op] = {
    "local": Op(abstract_local, run_local),
    "astype": Op(_astype, lambda x, dtype: x.astype(dtype)),
    "axis_index": Op(_axis_index, axis_index),
    "slice_to": Op(_sliced, slice_to),
    "pvary": Op(  # a free cast to varying; the backward pass psums the gradient
        _cast, lambda x, axes: jax.lax.pcast(x, axes, to="varying"), logs="pvary",
        backward=("psum", _as_is),
    ),
    "psum": Op(
        _reduced, psum, _all_reduce, "all-reduce", _as_is,
        measure=lambda x, k: psum(x, _ALL),
    ),
    "pmax": Op(_reduced, lambda x, axes: jax.lax.pmax(x, axes), _all_reduce, "all-reduce", _as_is,
               rate="psum"),
    "pmin": Op(_reduced, lambda x, axes: jax.lax.pmin(x, axes), _all_reduce, "all-reduce", _as_is,
               rate="psum"),
    "make_invarying": Op(_reduced, make_invarying, logs="psum"),
    "psum_scatter": Op(
        _scattered, psum_scatter, _others_share, "reduce-scatter",
        lambda n, s: s // n, backward=("all_gather", lambda n, s: s // n),
        measure=lambda x, k: jnp.tile(psum_scatter(x, _ALL, 0), k),
    ),
    "all_gather": Op(
        _gathered, all_gather, lambda n, s: (n - 1) * s, "all-gather", lambda n, s: s * n,
        backward=("psum_scatter", lambda n, s: s * n),
        measure=lambda x, k: all_gather(x[: x.size // k], _ALL, 0),
        measure_in=lambda nbytes, k: nbytes // k,
    ),
    "gather_stacked": Op(_stacked, gather_stacked, logs="all_gather", transposes=False),
    "all_to_all": Op(
        _moved, all_to_all, _others_share, "all-to-all", _as_is, hlo_pieces=True,
        backward=("all_to_all", _as_is), measure=lambda x, k: all_to_all(x, _ALL, 0, 0),
    ),
    # each device's rows to their groups' devices and back, in rounds of three
    # all_to_all (rows, their groups, results), which the rule logs
    "routed": Op(_given, routed),
    "ppermute": Op(
        _permuted, ppermute, _as_is, "collective-permute", _as_is, groups=False,
        backward=("ppermute", _as_is),
        measure=lambda x, k: ppermute(x, _ALL, _ring(k), {"all": k}),
    ),
}  # fmt: skip


def logged(name: str) -> str | None:
    """The collective kind the plan records when instruction `name` runs."""
    op = OPS[name]
    return op.logs or (name if op.traffic is not None else None)


def rate_of(kind: str) -> str:
    """The measured collective kind whose bytes/s prices collective `kind`."""
    return OPS[kind].rate or kind


# the collectives measured on a mesh, each at its own rate (lowering/rates.py)
MEASURED = tuple(name for name, op in OPS.items() if op.measure is not None)
# the HLO ops the plan's collectives compile to (lowering/hlo.py), and those whose tuple
# result is one collective, a piece per peer
HLO_KINDS = tuple(dict.fromkeys(op.hlo for op in OPS.values() if op.hlo))
HLO_PIECES = frozenset(op.hlo for op in OPS.values() if op.hlo_pieces)
