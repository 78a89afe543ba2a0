"""`Mesh`: named mesh axes over devices."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import jax
import numpy as np

from namedmesh.errors import MeshError


def check_axis_name(name) -> None:
    """A MeshError unless `name` is an ASCII identifier: the layout syntax's separators
    (":;, ") are not in one, and XLA aborts the process on a name that is not ASCII."""
    if not isinstance(name, str) or not (name.isascii() and name.isidentifier()):
        raise MeshError(
            f"mesh axis names must be ASCII identifiers (letters, digits and _, not "
            f"starting with a digit; no ':', ';', ',' or spaces), got {name!r}"
        )


class Mesh:
    """Named mesh axes, `Mesh({"rows": 2, "cols": 4})`, over the first prod(sizes) of
    `jax.devices()` or over the given devices, in row-major order.

    `Mesh(sizes, devices="abstract")` needs no devices: programs on it can be planned
    and reported (`.plan`, `.report`, `auto_layout`) but not run or compiled.
    """

    def __init__(self, sizes: Mapping[str, int], devices: Sequence | str | None = None):
        if not isinstance(sizes, Mapping) or not sizes:
            raise MeshError(f"a mesh needs a mapping axis -> size, got {sizes!r}")
        for name, n in sizes.items():
            check_axis_name(name)
            if not isinstance(n, int | np.integer) or n < 1:
                raise MeshError(f"mesh axis {name!r} must have a positive int size, got {n!r}")
        self.sizes: dict[str, int] = {k: int(v) for k, v in sizes.items()}
        self.size = math.prod(self.sizes.values())
        self.abstract = isinstance(devices, str)
        if self.abstract:
            if devices != "abstract":
                raise MeshError(f"devices must be a sequence or 'abstract', got {devices!r}")
            shape = tuple(self.sizes.values())
            self.jax_mesh = jax.sharding.AbstractMesh(shape, tuple(self.sizes))
            return
        devices = list(jax.devices() if devices is None else _checked_devices(devices))
        if len(devices) < self.size:
            raise MeshError(
                f"mesh {self} needs {self.size} devices but only {len(devices)} are available"
                " (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before"
                " importing jax)"
            )
        grid = np.array(devices[: self.size], dtype=object).reshape(tuple(self.sizes.values()))
        self.jax_mesh = jax.sharding.Mesh(grid, tuple(self.sizes))

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The mesh axes' names, in order."""
        return tuple(self.sizes)

    def __repr__(self) -> str:
        axes = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
        return f"Mesh({axes}{', abstract' if getattr(self, 'abstract', False) else ''})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Mesh) and other.sizes == self.sizes

    def __hash__(self) -> int:
        return hash(tuple(self.sizes.items()))


def _checked_devices(devices) -> list:
    """`devices` as a list, or a MeshError naming the entry that is not a jax device or
    a device given twice (jax would fail later, inside a collective)."""
    if isinstance(devices, np.ndarray):  # a grid of devices, as jax.sharding.Mesh takes
        devices = devices.ravel()
    if not isinstance(devices, Iterable):
        raise MeshError(f"devices must be a sequence of jax devices, got {devices!r}")
    devices = list(devices)
    seen = {}
    for i, d in enumerate(devices):
        if not isinstance(d, jax.Device):
            raise MeshError(
                f"devices[{i}] is a {type(d).__name__} ({d!r}), not a jax device "
                "(jax.devices() lists them)"
            )
        if d in seen:
            raise MeshError(f"device {d} is given twice, as devices[{seen[d]}] and devices[{i}]")
        seen[d] = i
    return devices


def require_mesh(mesh, where: str) -> Mesh:
    """`mesh` when it is a Mesh; MeshError naming `where` otherwise, with the Mesh to
    write for a dict of axis sizes."""
    if isinstance(mesh, Mesh):
        return mesh
    hint = f"; write Mesh({mesh!r})" if isinstance(mesh, Mapping) else ""
    raise MeshError(f"{where} needs a lowering.Mesh, got {type(mesh).__name__}{hint}")
