"""A local shard as the planner sees it (`Local`), and the jax instructions that lower
modules run on shards too (lowering/expert_routes.py's rounds of all_to_all): below
lowering/ops.py's table, which lists them as instructions, so that the routes need not
import the table that lists them."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np


@dataclass(eq=False, slots=True)  # many per candidate: slots make them cheaper
class Local:
    """A local shard as the planner sees it: its shape, dtype and the mesh axes over
    which shard_map types it varying. Identity is the value's (hashed by id)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    vma: frozenset = frozenset()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        vary = f" varying {','.join(sorted(self.vma))}" if self.vma else ""
        return f"Local({fmt_local(self)}{vary})"


def fmt_local(a) -> str:
    """`f32[4,8]`: the dtype and shape of a local value or aval."""
    return f"{a.dtype.kind}{a.dtype.itemsize * 8}[{','.join(map(str, a.shape))}]"


def axis_name(axes: tuple[str, ...]):
    """The axis name jax.lax takes for the mesh axes `axes`."""
    return axes[0] if len(axes) == 1 else tuple(axes)


def all_to_all(x, axes: tuple[str, ...], dim: int, to: int):
    """The split of dim `to` by `axes` moved to dim `dim`: each device sends its `to`
    blocks to their devices and concatenates what it receives along `dim`."""
    return jax.lax.all_to_all(x, axis_name(axes), split_axis=to, concat_axis=dim, tiled=True)
