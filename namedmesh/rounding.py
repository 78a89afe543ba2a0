"""`round(x, decimals)`: NumPy's `np.round`, composed of elementwise ops, so that it traces,
lowers and differentiates as they do.

Floats round half to even at 10**-decimals as NumPy does (scale by 10**|decimals|, round,
unscale, in x's dtype: float16 and bfloat16 in float32, as jax does, since their products
overflow at 65,504 and lose digits). Where NumPy's scaling overflows, which it returns as
inf or NaN (np.round(float32(1e37), 2) is inf), the value is already as rounded as its
dtype holds: x itself, or for negative decimals the multiple of 10**-decimals toward 0.
Integers round half to even to a multiple of 10**-decimals, exactly, in their own dtype;
where the nearest multiple does not fit the dtype, to the one toward 0 (NumPy wraps
around: int8 127 to -1 decimals gave -126). Bools take no decimals but 0 (NumPy refuses).
"""

from __future__ import annotations

import operator

import numpy as np

from namedmesh import elementwise as ew
from namedmesh.errors import ArgumentError, DtypeError, fmt_dims
from namedmesh.primitive import is_inexact
from namedmesh.tensor import Tensor, native_dtype

_HALF = ("float16", "bfloat16")


def round(x: Tensor, decimals: int = 0) -> Tensor:
    """`x` rounded half to even to `decimals` decimal places (negative: to tens,
    hundreds, ...), as np.round(x, decimals); see the module docstring for overflow."""
    try:
        decimals = operator.index(decimals)
    except TypeError:
        raise ArgumentError(
            f"round: decimals must be an int, got {type(decimals).__name__} {decimals!r}"
        ) from None
    if not isinstance(x, Tensor):  # a Python or NumPy scalar: a 0-d tensor
        x = ew.operands(x, op="round")[0]
    if decimals == 0:
        return ew.round(x)
    if x.dtype == np.dtype(bool):
        raise DtypeError(
            f"round of the bool tensor {fmt_dims(x.dims, x.shape)} to decimals={decimals}: "
            "bools take decimals=0 only (NumPy refuses them); use astype first"
        )
    if not is_inexact(x.dtype):
        return x if decimals > 0 else _round_integer(x, 10**-decimals)
    with np.errstate(over="ignore", invalid="ignore"):  # eagerly: the overflows handled
        if x.dtype.name in _HALF:
            return ew.astype(_round_float(ew.astype(x, np.float32), decimals), x.dtype)
        return _round_float(x, decimals)


round.primitive = ew.round.primitive  # the primitive it binds (registry_steps.public_op)


def _round_float(x: Tensor, decimals: int) -> Tensor:
    try:
        with np.errstate(over="ignore"):  # (to inf, handled below)
            f = np.asarray(10.0 ** abs(decimals)).astype(native_dtype(x.dtype))
    except OverflowError:  # beyond float64's range, so beyond every dtype's
        f = np.asarray(np.inf)
    if not np.isfinite(f):  # 10**|decimals| overflows the dtype: no digit is kept or dropped
        return x if decimals > 0 else ew.where(ew.isfinite(x), x * 0, x)  # (0 keeps the sign)
    # Each division by f is by a value XLA cannot fold to a constant: it rewrites a
    # division by a constant as a product with its reciprocal, an ulp off (31 / 10 gave
    # 3.1000001, NumPy's 3.1); the lanes that divide by 1 instead are the non-finite ones
    f = f.item()
    if decimals > 0:
        scaled = x * f
        finite = ew.isfinite(scaled)
        return ew.where(finite, ew.round(scaled) / ew.where(finite, f, 1.0), x)
    scaled = x / ew.where(ew.isfinite(x), f, 1.0)
    out = ew.round(scaled) * f
    toward_zero = ew.sign(scaled) * ew.floor(ew.abs(scaled)) * f  # a finite x's, in range
    return ew.where(ew.isfinite(out) | ~ew.isfinite(x), out, toward_zero)


def _round_integer(x: Tensor, f: int) -> Tensor:
    """x to the nearest multiple of f, ties to the even multiple, toward 0 where the
    nearest does not fit x's dtype; every step in x's dtype without overflow."""
    info = np.iinfo(x.dtype)
    if f > info.max:  # the nearest multiple that fits is 0
        return x * 0
    m = ew.mod(x, f)  # in [0, f)
    r = ew.where((x < 0) & (m != 0), m - f, m)  # the remainder toward 0: |r| < f
    base = x - r  # the multiple of f toward 0 (between 0 and x: it fits)
    a = ew.abs(r)
    odd = ew.mod(ew.floor_divide(base, f), 2) != 0
    away = (a > f - a) | ((a == f - a) & odd)
    fits = ew.where(x < 0, base >= info.min + f, base <= info.max - f)
    # (the step away wraps around in the lanes where it does not fit, which keep base)
    return ew.where(away & fits, ew.where(x < 0, base - f, base + f), base)
