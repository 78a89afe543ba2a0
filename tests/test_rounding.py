"""round(x, decimals) (namedmesh/rounding.py) against oracles computed apart from it: NumPy's
np.round on the same dtype for float32 (on float32 for the half floats), Python's exact
integer round() for integers; eagerly, under jit and lowered with the dim split; and every
way a user reaches it (np.round, np.around, t.round, Python's round)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import namedmesh as nm
from lowering import Layout, Mesh
from namedmesh.testing import compare
from namedmesh.testing import lowered as cached_lower

BF16 = np.dtype(jnp.bfloat16)
F32_MAX = float(np.finfo(np.float32).max)
FLOATS = [0.5, 1.5, 2.5, -0.5, -2.5, 1.005, 2.675, -0.4, 0.125, 1234.5678, -0.0, 3.14159,
          65000.0, np.nan, np.inf, -np.inf, 0.0, 1e-3]  # fmt: skip
INTS = [0, 1, -1, 5, 15, 25, -15, -25, 35, 45, 7, 99, 127, -128, 126, -126, 255, 250]


def float_oracle(x: np.ndarray, decimals: int) -> np.ndarray:
    """np.round in float32 (the half floats' compute dtype, as jax's); where NumPy's
    scaling overflows and returns inf or NaN for a finite x, x as its dtype holds it,
    and x where it is NaN or infinite (NumPy: NaN, for 10**decimals past float32)."""
    with np.errstate(all="ignore"):
        x32 = x.astype(np.float32)
        want = np.round(x32, decimals)
    broken = ~np.isfinite(want) & np.isfinite(x32)
    assert decimals > 0 or not broken.any()  # (the cases below with decimals < 0 do not)
    return np.where(broken | ~np.isfinite(x32), x32, want).astype(x.dtype)  # inf stays inf


def int_oracle(x: np.ndarray, decimals: int) -> np.ndarray:
    """Python's round (exact, half to even), toward 0 where the dtype cannot hold it."""
    info, f = np.iinfo(x.dtype), 10**-decimals if decimals < 0 else 1
    out = []
    for v in x.tolist():
        r = round(v, decimals)
        out.append(r if info.min <= r <= info.max else int(v / f) * f)
    return np.array(out, x.dtype)


CASES = [  # (dtype, values, decimals, oracle)
    *[(dt, FLOATS, d, float_oracle) for dt in (np.float32, BF16, np.float16)
      for d in (1, 2, -1, -2)],
    (np.float32, [1e37, -3e38, F32_MAX, 1.0], 2, float_oracle),  # NumPy: inf; x
    (np.float32, FLOATS, 45, float_oracle),  # 10**45 overflows float32: x itself
    *[(dt, [v for v in INTS if np.iinfo(dt).min <= v <= np.iinfo(dt).max], d, int_oracle)
      for dt in (np.int8, np.uint8, np.int32) for d in (-1, -2, -3, 2)],
    (np.int32, [2**31 - 1, -(2**31), 2**31 - 5, 1_500_000_000, -1_500_000_000], -9, int_oracle),
    (np.int32, [2**31 - 1, -(2**31), 12345], -10, int_oracle),  # 10**10 > int32: all 0
]  # fmt: skip


@pytest.mark.parametrize("dtype, values, decimals, oracle", CASES)
def test_round_with_decimals_equals_the_oracle_eagerly(dtype, values, decimals, oracle):
    x = np.array(values, dtype=dtype)
    want = nm.tensor(oracle(x, decimals), "d")
    compare(nm.round(nm.tensor(x, "d"), decimals), want, rtol=0.0, what="NumPy eager")
    compare(np.round(nm.tensor(x, "d"), decimals), want, rtol=0.0, what="np.round")
    got = nm.round(nm.tensor(jnp.asarray(x), "d"), decimals)
    compare(nm.tensor(np.asarray(got.data), "d"), want, rtol=0.0, what="jax eager")


def test_float_overflow_toward_zero_for_negative_decimals():
    """float32's max to -35 decimals: NumPy's 3403e35 is inf; the multiple toward 0
    (3402e35), and 10**-39 past float32: 0 of x's sign, infinities kept."""
    x = nm.tensor(np.array([F32_MAX, -F32_MAX, 5.0, -5.0, np.inf], np.float32), "d")
    got = nm.round(x, -35).data
    toward_zero = np.float32(3402) * np.float32(1e35)  # (the multiple as float32 computes it)
    np.testing.assert_array_equal(got[:2], [toward_zero, -toward_zero])
    got = nm.round(x, -39).data
    np.testing.assert_array_equal(got, np.float32([0.0, -0.0, 0.0, -0.0, np.inf]))
    assert np.signbit(got[3]) and not np.signbit(got[2])


@functools.cache
def round_program(decimals):
    return lambda x: nm.round(x, decimals)


@pytest.mark.parametrize(
    "dtype, decimals", [(np.float32, 2), (np.float32, -1), (BF16, 1), (np.int8, -1)]
)
def test_round_jitted_and_lowered_along_a_split_dim(dtype, decimals):
    x = np.resize(np.array(FLOATS if dtype != np.int8 else INTS[:16]), (2, 16)).astype(dtype)
    oracle = int_oracle if dtype == np.int8 else float_oracle
    want = nm.tensor(oracle(x.ravel(), decimals).reshape(x.shape), "r d")
    jitted = jax.jit(lambda a: nm.round(nm.tensor(a, "r d"), decimals).data)(jnp.asarray(x))
    compare(nm.tensor(np.asarray(jitted), "r d"), want, rtol=0.0, what="jit")
    lowered = cached_lower(round_program(decimals), Mesh({"m0": 4}), Layout("d:m0"))
    got = lowered(nm.tensor(x, "r d"))
    compare(nm.tensor(np.asarray(got.data), "r d"), want, rtol=0.0, what="lowered")


def test_every_spelling_of_round_with_decimals_is_numpys():
    data = np.array([1.234, -2.5, 0.55, 1.5], np.float32)
    x = nm.tensor(data, "d")
    want = np.round(data, 1)
    for got in (np.round(x, 1), np.round(x, decimals=1), np.around(x, 1), x.round(1),
                round(x, 1), nm.round(x, decimals=1)):  # fmt: skip
        assert isinstance(got, nm.Tensor) and got.dims == ("d",)
        np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(round(x)), np.round(data))


def test_round_refuses_bad_decimals_and_bools_by_name():
    x = nm.tensor(np.array([True, False]), "flag")
    with pytest.raises(nm.DtypeError, match=r"bool tensor \(flag: 2\).*decimals=1"):
        nm.round(x, 1)
    assert nm.round(x).dtype == np.dtype(bool)
    with pytest.raises(nm.ArgumentError, match="decimals must be an int, got float 1.5"):
        nm.round(nm.tensor(np.ones(2, np.float32), "d"), 1.5)


def test_round_of_a_python_scalar():
    got = nm.round(2.675, 2)
    assert got.dims == () and got.data == np.round(np.float32(2.675), 2)
