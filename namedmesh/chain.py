"""`scan_chain`: consecutive stacks of layers (DeepSeek-V3's 3 dense then 58 MoE layers),
each scanned over the same dim by its own body, as ONE pipeline where a layout splits
that dim into stages.

Unpipelined it is the scans one after another. Within `lower` under a rule that splits
`dim` into S stages (namedmesh/uneven.py `scan_stages`), the stacks' layers are dealt
to the S stages in order, as evenly as they go (`chain_deal`: the planner's deal,
lowering.stages.assign_stages), and the chain runs as one scan of S iterations, one a
stage: stage s runs its slice of each stack in turn (an inner scan each), so the
pipeline has one bubble, not one per stack. Each stack takes K_i slots a stage, the
most any stage holds of it; a stage's slots beyond its layers are pads, copies of a
layer flagged not real, whose body's carry is replaced by the one it was given (the
identity), and which the lowered loop skips (a jax.lax.cond per slot, uneven.Masked: no
layer work, forward or backward; its results dropped, its gradients zero). The ys of each
stack come back L_i long, its real layers in order. A stack given L_i long is gathered
into its slots (whole on every stage device, its gradients all-reduced over the stages);
one padded ahead for the chain (namedmesh.uneven.pad_stacks' `chain`) is read as it
lies, each stage device holding only its K_i slots."""

from __future__ import annotations

import jax
import numpy as np

from namedmesh.control import scan
from namedmesh.creation import tensor
from namedmesh.errors import ParameterError
from namedmesh.structural import gather, rename, reshape
from namedmesh.tensor import Tensor
from namedmesh.uneven import (
    Deal,
    chain_deal,
    chain_slots,
    held_stack,
    masked,
    record,
    splits_of,
    tree_map,
)

__all__ = ["chain_deal", "scan_chain"]

INNER = "{}~stage"  # the dim of a stage's slots of one stack


def scan_chain(steps, init, dim: str, remat: str = "none", unroll: bool | str = False,
               names=None):  # fmt: skip
    """(final carry, [ys of each step]): `nm.scan(f, carry, xs, dim)` for each `(f, xs)`
    of `steps` in turn, the carry of one the init of the next. Pipelined (a layout rule
    splits `dim` into stages), one pipeline over all the stacks (this module's
    docstring). `remat` and `unroll` as nm.scan's, for every stack. `names`: one per
    step ("dense", "MoE"), how the pipeline's report names each stage's layers of each
    stack (default "of stack i")."""
    steps = list(steps)
    if not steps:
        raise ParameterError(f"scan_chain over {dim!r}: no (f, xs) steps")
    if names is not None and (len(names) != len(steps) or not all(isinstance(n, str)
                                                                  for n in names)):  # fmt: skip
        raise ParameterError(f"scan_chain over {dim!r}: names={names!r} must be one str per "
                             f"step ({len(steps)})")  # fmt: skip
    lengths = [_length(xs, dim, i) for i, (_, xs) in enumerate(steps)]
    s = splits_of(dim)
    if s <= 1 or sum(1 for n in lengths if n) < 2:
        ys = []
        for f, xs in steps:
            init, y = scan(f, init, xs, dim, remat=remat, unroll=unroll)
            ys.append(y)
        return init, ys
    return _one_pipeline(steps, init, dim, lengths, s, remat, unroll, names)


def _length(xs, dim: str, i: int) -> int:
    leaves = _leaves(xs)
    if not leaves or any(dim not in x.dims for x in leaves):
        raise ParameterError(f"scan_chain over {dim!r}: step {i}'s xs must all have {dim!r}")
    sizes = {x.size_of(dim) for x in leaves}
    if len(sizes) != 1:
        raise ParameterError(f"scan_chain over {dim!r}: step {i}'s xs disagree: {sorted(sizes)}")
    return sizes.pop()


def _leaves(xs) -> list:
    return jax.tree_util.tree_leaves(xs, is_leaf=lambda x: isinstance(x, Tensor))


def _one_pipeline(steps, init, dim, lengths, stages, remat, unroll, names=None):
    """The chain as one scan of `stages` iterations (this module's docstring)."""
    counts = chain_deal(lengths, stages)
    slots = tuple(max(c[i] for c in counts) for i in range(len(lengths)))
    inner = INNER.format(dim)
    chunks, ats = [], []
    for i, (_, xs) in enumerate(steps):
        src, real, at = chain_slots(lengths, stages, i)
        link = (tuple(lengths), i)  # a PaddedStack's chain (pad_stacks')
        taken = tree_map(lambda x, link=link, src=src: _stage_slots(x, dim, link, stages, src), xs)
        chunks.append((taken, tensor(real.reshape(stages, slots[i]), (dim, inner))))
        ats.append(at)
    record(dim, stages, Deal(tuple(counts), slots, None if names is None else tuple(names)))

    def stage(carry, chunk):
        ys = []
        for (f, _), (xs, flags) in zip(steps, chunk, strict=True):
            if not flags.size_of(inner):
                ys.append(None)
                continue
            carry, y = scan(masked(f), carry, (xs, flags), inner, remat=remat, unroll=unroll)
            ys.append(y)
        return carry, ys

    carry, ys = scan(stage, init, chunks, dim)
    return carry, [_real_ys(y, dim, inner, at) for y, at in zip(ys, ats, strict=True)]


def _stage_slots(x: Tensor, dim: str, chain, stages: int, src) -> Tensor:
    """`x` (stack i's L_i layers along `dim`) as (dim: S, inner: K_i): its padded stack
    itself where `x` is a view of one padded for this chain (pad_stacks' `chain`: each
    stage device holds its block), else a gather of its layers into the slots (the
    stack whole on every stage device, its gradients all-reduced over the stages)."""
    k, inner = len(src) // stages, INNER.format(dim)
    held = held_stack(x)
    if held is not None and held.padding == (dim, *chain, stages):
        return reshape(held.tensor, {dim: stages, inner: k}, dim)
    idx = tensor(src.reshape(stages, k), (dim, inner))
    return gather(rename(x, {dim: f"{dim}~"}), f"{dim}~", idx)


def _real_ys(ys, dim: str, inner: str, at: np.ndarray):
    """Per-slot results (dim, inner, ...) as the stack's real layers (dim, ...)."""
    if ys is None:
        return None

    def real(y: Tensor) -> Tensor:
        flat = reshape(y, {f"{dim}~": y.size_of(dim) * y.size_of(inner)}, (dim, inner))
        return gather(flat, f"{dim}~", tensor(at, (dim,)))

    return tree_map(real, ys)
