"""Oracles computed without namedmesh, for the semantics the property suites and tests
hold every path to (issue 38): `power` of every integer/float combination and where
`update_slice` writes for any start."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def power_dtype(x_dtype, y_dtype) -> np.dtype:
    """jax's promotion of the operands' dtypes: integers never widen a float."""
    return np.dtype(jnp.promote_types(x_dtype, y_dtype))


def power_oracle(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x ** y as documented (docs/language.md): with a float result, the float64 power of
    the operands converted to it, rounded to it; with an integer result, Python's exact
    power wrapped to the dtype for y >= 0 and 1 / x**-y truncated toward 0 for y < 0 (0
    for x = 0); bools: x or not y."""
    dt = power_dtype(x.dtype, y.dtype)
    x, y = np.broadcast_arrays(x, y)
    if dt == np.bool_:
        return np.logical_or(x, np.logical_not(y))
    if dt.kind not in "iu":
        with np.errstate(all="ignore"):
            wide = np.power(x.astype(dt).astype(np.float64), y.astype(dt).astype(np.float64))
            return wide.astype(dt)
    bits = 8 * dt.itemsize
    out = []
    for a, b in zip(x.astype(dt).ravel().tolist(), y.astype(dt).ravel().tolist(), strict=True):
        if b >= 0:
            v = pow(a, b, 2**bits)
            out.append(v - 2**bits if dt.kind == "i" and v >= 2 ** (bits - 1) else v)
        else:
            out.append(1 if a == 1 else (-1) ** (-b) if a == -1 else 0)
    return np.array(out, dtype=dt).reshape(x.shape)


def window_start(start: int, size: int, n: int) -> int:
    """Where update_slice's window of `n` along a dim of `size` begins for `start`: a
    negative start counts from the end, then the window is clamped to fit."""
    start = int(start)
    if start < 0:
        start += size
    return min(max(start, 0), size - n)


__all__ = ["power_dtype", "power_oracle", "window_start"]
