"""`update_slice`: a window of a tensor replaced, at a position known only at run time.

A decoding step writes one position of a KV cache: with `jax.lax.dynamic_update_slice`
on a donated buffer XLA writes those bytes in place, where a one-hot blend
(`cache * (1 - at) + at * new`) reads and writes the whole cache every step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from namedmesh.checks import axis_of
from namedmesh.elementwise import align
from namedmesh.errors import DtypeError, ShapeError, fmt_dims
from namedmesh.primitive import Aval, Cost, bind, primitive
from namedmesh.tensor import Tensor


def _update_rule(x, start, value, axis, dims):
    dim = x.dims[axis]
    if start.dtype.kind not in "iu":
        raise ShapeError(f"update_slice: start must be integers, got {start.dtype} {start.dims}")
    if stray := [d for d in start.dims if d not in x.dims or d == dim]:
        raise ShapeError(
            f"update_slice: start's dim(s) {stray} must be dims of the tensor {x.dims} other "
            f"than {dim!r} (one start per element of those)"
        )
    if value.dims != x.dims:
        raise ShapeError(f"update_slice: value {value.dims} must have the tensor's dims {x.dims}")
    sizes = dict(zip(x.dims, x.shape, strict=True))
    for d, s in zip(value.dims, value.shape, strict=True):
        if s != sizes[d] if d != dim else s > sizes[d]:
            raise ShapeError(
                f"update_slice: value {fmt_dims(value.dims, value.shape)} does not fit the "
                f"tensor {fmt_dims(x.dims, x.shape)}: {d!r} must be "
                + (f"at most {sizes[d]}" if d == dim else f"{sizes[d]}")
            )
    for d, s in zip(start.dims, start.shape, strict=True):
        if s != sizes[d]:
            raise ShapeError(f"update_slice: start has {d}={s} but the tensor {d}={sizes[d]}")
    if value.dtype != x.dtype:
        raise DtypeError(
            f"update_slice: value is {value.dtype} but the tensor is {x.dtype}; astype first"
        )
    return Aval(x.dims, x.shape, x.dtype)


def _starts_axes(x_dims, start_dims) -> tuple[int, ...]:
    return tuple(x_dims.index(d) for d in start_dims)


def window_starts(xp, start, size: int, n: int):
    """Where windows of `n` along a dim of `size` begin, as int32, for integer `start`s
    of any dtype: a negative start counts from the end (start + size, as a gather's
    index and Python's), then the window is clamped to fit ([0, size - n]), as
    `jax.lax.dynamic_update_slice` does. The same arithmetic on NumPy and jax, so that
    every path writes the same window: start is first limited to [-size, size] in its
    own dtype (wide enough), where the int32 cast cannot wrap."""
    if np.dtype(start.dtype).itemsize < 4:
        start = start.astype(np.int32)
    low = -size if np.dtype(start.dtype).kind == "i" else 0
    start = xp.clip(start, low, size).astype(np.int32)
    start = xp.where(start < 0, start + np.int32(size), start)
    return xp.clip(start, 0, size - n)


def _update_np(x, start, value, axis, dims):
    out = x.copy()
    batch = _starts_axes(*dims)
    n = value.shape[axis]
    starts = window_starts(np, np.asarray(start), x.shape[axis], n)
    for idx in np.ndindex(*start.shape):
        at = int(starts[idx])
        where = [slice(None)] * x.ndim
        for a, i in zip(batch, idx, strict=True):
            where[a] = i
        window = list(where)
        where[axis] = slice(at, at + n)
        out[tuple(where)] = value[tuple(window)]
    return out


def _update_jax(x, start, value, axis, dims):
    x_dims, start_dims = dims
    n = value.shape[axis]
    start = window_starts(jnp, jnp.asarray(start), x.shape[axis], n)
    if not start_dims:
        return jax.lax.dynamic_update_slice_in_dim(x, value, start, axis)
    # One start per element of start's dims: a scatter of value's elements at index
    # arrays shaped like value. (A vmapped dynamic_update_slice moves the mapped axes of
    # x to the front: two transposes of the whole tensor, where this writes the window.)
    first = align(start, start_dims, x_dims, jnp)
    index = []
    for a, size in enumerate(value.shape):
        shape = [1] * x.ndim
        shape[a] = size
        idx = jnp.arange(size, dtype=jnp.int32).reshape(shape)
        index.append(first + idx if a == axis else idx)
    return x.at[tuple(index)].set(value, indices_are_sorted=True, unique_indices=True)


def _update_cost(in_avals, out_avals, params) -> Cost:
    """The window's bytes read and written: in place when the tensor's buffer is donated."""
    return Cost(0, 2 * in_avals[2].nbytes + in_avals[1].nbytes)


_update = primitive(
    "update_slice",
    _update_rule,
    _update_np,
    _update_jax,
    cost_rule=_update_cost,
    backward_reads="constant",
)


def update_slice(x: Tensor, dim: str, start: Tensor, value: Tensor) -> Tensor:
    """`x` with `value` written along `dim` from `start`: value has x's dims (in any order)
    with `dim` at most as long; `start` is an int Tensor, 0-d or over other dims of x
    (one start per element of those: a KV cache's write position per batch row).
    A negative start counts from the end (as a gather's index: -1 is the last position),
    then the window is clamped to fit, as `jax.lax.dynamic_update_slice` does: one
    meaning eagerly, under jit and lowered (`window_starts`). The dtypes must be equal
    (DtypeError). Under `jax.jit` with x donated, XLA writes the
    window in place."""
    axis = axis_of(x, dim, "update_slice")
    if set(value.dims) == set(x.dims) and value.dims != x.dims:
        value = value.transpose(*x.dims)
    start = start if isinstance(start, Tensor) else Tensor(np.asarray(start), ())
    return bind(_update, x, start, value, axis=axis, dims=(x.dims, start.dims))


def _update_example(a, b, d, k):
    """The property strategies' update_slice (Primitive.example): a window of a's own
    end written from starts in [-2n, n), one start (0-d) or one per element."""
    n = a.size_of(d)
    if not n:  # no window of an empty dim
        return None
    w = 1 + k % n
    start = a.argmax(d)
    if not k % 2 and start.dims:
        start = start.max(start.dims)
    start = start - (k // 2 % (2 * n + 1))
    return update_slice(a, d, start, a.isel({d: slice(n - w, n)}) * 0.5)


_update.example = _update_example
