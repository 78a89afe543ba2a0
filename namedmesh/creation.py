"""Constructors: `tensor`, `zeros`, `ones`, `full`, `arange`, and their `_like` forms."""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from namedmesh.checks import fits_dtype
from namedmesh.errors import ShapeError
from namedmesh.primitive import Aval, Cost, bind, primitive
from namedmesh.tensor import DimsLike, Tensor, native_dtype, parse_dims, parse_sizes

_FLOAT32 = np.dtype(np.float32)


def tensor(data, dims: DimsLike) -> Tensor:
    """A Tensor of `data` (array-like) with axes named `dims` (tuple or "a b c")."""
    return Tensor(data, dims)


_full = primitive(
    "full",
    lambda dims, shape, value, dtype: Aval(dims, shape, dtype),
    lambda dims, shape, value, dtype: np.full(shape, value, dtype),
    lambda dims, shape, value, dtype: jnp.full(shape, value, dtype),
    cost_rule=lambda i, o, p: Cost(0, o[0].nbytes),
    backward_reads="nothing",
)


def full(sizes: Mapping[str, int], value, dtype=None) -> Tensor:
    """A tensor of `sizes` (dim -> size, in order) filled with `value`."""
    dims, shape = parse_sizes(sizes, "full")
    if dtype is None:
        dtype = {bool: bool, int: np.int32, float: np.float32}.get(
            type(value), np.result_type(value)
        )
    dtype = native_dtype(dtype)
    fits_dtype("full", "value", value, dtype)
    return bind(_full, dims=dims, shape=shape, value=value, dtype=dtype)


def zeros(sizes: Mapping[str, int], dtype=_FLOAT32) -> Tensor:
    """A tensor of zeros (float32 unless `dtype` says otherwise)."""
    return full(sizes, 0, dtype)


def ones(sizes: Mapping[str, int], dtype=_FLOAT32) -> Tensor:
    """A tensor of ones (float32 unless `dtype` says otherwise)."""
    return full(sizes, 1, dtype)


def zeros_like(x: Tensor, dtype=None) -> Tensor:
    """Zeros with `x`'s dims and sizes, in `x`'s dtype unless `dtype` is given."""
    return full(x.sizes, 0, x.dtype if dtype is None else dtype)


def ones_like(x: Tensor, dtype=None) -> Tensor:
    """Ones with `x`'s dims and sizes, in `x`'s dtype unless `dtype` is given."""
    return full(x.sizes, 1, x.dtype if dtype is None else dtype)


def full_like(x: Tensor, value, dtype=None) -> Tensor:
    """`value` everywhere, with `x`'s dims and sizes, in `x`'s dtype unless `dtype`."""
    return full(x.sizes, value, x.dtype if dtype is None else dtype)


_iota = primitive(
    "iota",
    lambda dim, start, step, n, dtype: Aval((dim,), (n,), dtype),
    lambda dim, start, step, n, dtype: (start + step * np.arange(n)).astype(dtype),
    lambda dim, start, step, n, dtype: (start + step * jnp.arange(n)).astype(dtype),
    cost_rule=lambda i, o, p: Cost(o[0].shape[0], o[0].nbytes),
    backward_reads="nothing",
)


def arange(dim: str, n: int, start=0, step=1, dtype=None) -> Tensor:
    """A 1-d tensor along `dim` of size `n`: start, start + step, ... (int32 unless floats)."""
    (dim,) = parse_dims((dim,), "arange")
    if not isinstance(n, int | np.integer) or n < 0:
        raise ShapeError(f"arange: size of dim {dim!r} must be a non-negative int, got {n!r}")
    if dtype is None:
        dtype = np.float32 if isinstance(start, float) or isinstance(step, float) else np.int32
    dtype = native_dtype(dtype)
    if n:  # (the values run from the first to the last: both must fit an integer dtype)
        fits_dtype("arange", "start", start, dtype)
        fits_dtype("arange", "the last value", start + step * (int(n) - 1), dtype)
    return bind(_iota, dim=dim, start=start, step=step, n=int(n), dtype=dtype)


def abstract(sizes: Mapping[str, int], dtype=_FLOAT32) -> Tensor:
    """A Tensor with dims, sizes and dtype but no values (its data is a
    jax.ShapeDtypeStruct): enough to trace, plan and report a program, and to build
    models of any size with `jax.eval_shape`, without allocating memory."""
    import jax

    dims, shape = parse_sizes(sizes, "abstract")
    return Tensor._make(jax.ShapeDtypeStruct(shape, native_dtype(dtype)), dims)


# How the property strategies' random programs apply these (Primitive.example)
_full.example = lambda a, b, d, k: a + full({d: a.size_of(d)}, 0.25 * (k % 4))
_iota.example = lambda a, b, d, k: a * arange(d, a.size_of(d), start=k % 3)
