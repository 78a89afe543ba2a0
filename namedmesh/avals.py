"""Abstract values: what a Tensor's data is when it is not an array.

`Aval` is a value's dims, shape and dtype without data; `Var` is the data of a Tensor
under `nm.trace` (an Aval with an identity); `TRACES.frames` holds this thread's open
traces.
`namedmesh.tensor` and `namedmesh.primitive` both read these, so they live below both.
"""

from __future__ import annotations

import itertools
import math
import threading
from typing import Any, NamedTuple

import jax
import numpy as np

from namedmesh.errors import NamedMeshError


class Aval(NamedTuple):
    """Abstract value: dims, positional shape and dtype, no data."""

    dims: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def sizes(self) -> dict[str, int]:
        """dim name -> size."""
        return dict(zip(self.dims, self.shape, strict=True))

    @property
    def nbytes(self) -> int:
        """Bytes of a value with this shape and dtype."""
        return math.prod(self.shape) * self.dtype.itemsize


class Var:
    """The data of a Tensor under `nm.trace`: an abstract value with an identity."""

    __slots__ = ("dims", "shape", "dtype", "count", "const")
    _counter = itertools.count(1)  # (next() is atomic: two threads tracing get distinct counts)

    def __init__(self, aval: Aval, const=None):
        self.dims, self.shape, self.dtype = aval
        self.const = const
        self.count = next(Var._counter)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def aval(self) -> Aval:
        return Aval(self.dims, self.shape, self.dtype)

    def __array__(self, dtype=None, copy=None):
        raise NamedMeshError(
            f"cannot read the values of a traced tensor {fmt_aval(self.aval)} inside "
            "nm.trace: the function must not convert its inputs to NumPy"
        )

    def __repr__(self) -> str:
        return f"Var({fmt_aval(self.aval)})"


def fmt_aval(a: Aval) -> str:
    """`f32[batch=8, d=16]`: dtype and sizes by name, for messages and reprs."""
    dt = np.dtype(a.dtype)
    short = {"f": "f", "i": "i", "u": "u", "b": "bool", "c": "c"}.get(dt.kind, dt.kind)
    name = short if dt.kind == "b" else f"{short}{dt.itemsize * 8}"
    return name + "[" + ", ".join(f"{d}={s}" for d, s in zip(a.dims, a.shape, strict=True)) + "]"


class _Traces(threading.local):
    """The trace frames of `nm.trace` open in this thread, innermost last (`frames`; a
    frame has `record(prim, args, params, avals)`). Per thread, as jax's own trace state:
    a thread's eager ops run eagerly while another thread traces, and two threads trace
    at once, each into its own graph."""

    def __init__(self):
        self.frames: list[Any] = []


TRACES = _Traces()


def is_jax_array(x) -> bool:
    """Whether `x` is a jax array (a tracer under jit or grad too), not a NumPy array."""
    return not isinstance(x, np.ndarray) and isinstance(x, jax.Array)
