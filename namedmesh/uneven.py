"""Uneven pipeline stages: a scan of L iterations over a dim that a layout splits into S
stages where S does not divide L (DeepSeek-V3's 61 layers on 16 stages) runs as a scan
of S * ceil(L/S) iterations, its stack padded inside the program.

The lowering (`lower`) traces a program under `scan_stages({dim: (axes, S)})`; a
`scan` over such a dim whose length S does not divide then deals its L iterations to
the S stages as `lowering.stages.assign_stages` does (sizes differ by at most one, the
larger stages first) and fills each stage's block of K = ceil(L/S) with copies of the
stage's last layer, flagged not real. A padded iteration is the identity: the body's
carry is replaced by the one it was given (`where` on the flag), so its values and the
gradients of its inputs (zero: its results are dropped) do not change the step. The
stack is padded by slices and a concat of the scanned inputs, whose transposes drop the
pad's gradients, and the ys are sliced back to the L real iterations. The user's
parameters stay L long."""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import numpy as np

from namedmesh.creation import tensor
from namedmesh.elementwise import where
from namedmesh.errors import LayoutError
from namedmesh.structural import gather, rename
from namedmesh.tensor import Tensor

# ({dim: (mesh axes, stages)} of the scans being traced, the dims padded so far); empty
# outside `lower`
_STAGES: contextvars.ContextVar[tuple] = contextvars.ContextVar("scan_stages", default=({}, set()))


@contextlib.contextmanager
def scan_stages(stages: dict):
    """Within it, a `scan` over a dim of `stages` ({dim: (mesh axes, S)}) whose length S
    does not divide is padded to S equal stages (this module's docstring). Yields the
    set of dims padded, filled as the scans are traced."""
    padded: set = set()
    token = _STAGES.set((dict(stages), padded))
    try:
        yield padded
    finally:
        _STAGES.reset(token)


def uneven_stages(dim: str, length: int) -> int:
    """The stages S a scan of `length` over `dim` is padded to, or 0 when it is not
    (no stages for `dim`, or S divides `length`); LayoutError naming the dim, its size
    and mesh axes when there are fewer iterations than stages."""
    stages, padded = _STAGES.get()
    axes, s = stages.get(dim, ((), 1))
    if s <= 1 or length % s == 0:
        return 0
    if length < s:
        raise LayoutError(
            f"scan over {dim!r}: dim {dim!r} of size {length} has fewer iterations than the "
            f"{s} stages of mesh axes {tuple(axes)} (rule {dim}:{','.join(axes)}); each stage "
            f"needs one layer at least"
        )
    padded.add(dim)
    return s


def deal(length: int, stages: int) -> list[tuple[int, int]]:
    """(first layer, layers) of each stage: `length` layers dealt as evenly as they go,
    the larger stages first (as lowering.stages.assign_stages deals one stack)."""
    base, extra = divmod(length, stages)
    sizes = [base + 1] * extra + [base] * (stages - extra)
    starts = np.cumsum([0, *sizes[:-1]])
    return [(int(a), n) for a, n in zip(starts, sizes, strict=True)]


def padded_scan(scan, f, init, xs, dim: str, length: int, stages: int, **kw):
    """`scan(f, init, xs, dim, **kw)` run as `stages` equal blocks of ceil(L/S)
    iterations, the padded ones the identity (this module's docstring)."""
    k = math.ceil(length / stages)
    blocks = deal(length, stages)
    real = np.array([j < n for _, n in blocks for j in range(k)])

    # padded position s*K + j holds the stage's layer j, or (a pad) its last real one
    src = np.array([a + min(j, n - 1) for a, n in blocks for j in range(k)], np.int32)
    at = np.array([s * k + j for s, (_, n) in enumerate(blocks) for j in range(n)], np.int32)

    def body(carry, x):
        inner, flag = x
        new, y = f(carry, inner)
        kept = _tree_map(lambda a, b: where(flag, a, b), new, carry)
        return kept, y

    padded = _tree_map(lambda x: _taken(x, dim, src), xs)
    flags = tensor(real, (dim,))
    carry, ys = scan(body, init, (padded, flags), dim, **kw)
    return carry, _tree_map(lambda y: _taken(y, dim, at), ys)


def _taken(x: Tensor, dim: str, index: np.ndarray) -> Tensor:
    """`x` at the positions `index` along `dim`: one gather, so that no part of it is
    laid out over the stages before the whole (a concat of slices would be gathered)."""
    other = f"{dim}~"  # (a gather's indices must not have the gathered dim)
    return gather(rename(x, {dim: other}), other, tensor(index, (dim,)))


def _tree_map(fn, *trees):
    """`jax.tree_util.tree_map` over Tensor leaves."""
    return jax.tree_util.tree_map(fn, *trees, is_leaf=lambda x: isinstance(x, Tensor))
