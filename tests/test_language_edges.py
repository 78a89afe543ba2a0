"""The language's edges that a fuzz of dtypes, sizes and values found silently different
from NumPy (or failing with a bare NumPy/jax error), each held to NumPy on every path:
integer division by 0, var/std with ddof >= the count, reductions without an identity
over an empty dim, Python scalars that do not fit an integer dtype, nm.random.integers'
range and uniform's upper bound in low precision."""

import functools
import re

import jax
import ml_dtypes
import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, lower

MESH = Mesh({"x": 4})
INTS = ["bool", "int8", "uint8", "int16", "int32", "uint32"]
NUMER = [7, -7, -128, -128, 0, 5, 127, -1]  # (clipped into each dtype's range)
DENOM = [0, 0, -1, 0, 0, -3, -1, 2]  # zeros, and -1 below the minimum (wraps in NumPy)


def ints(dtype, values):
    if dtype == "bool":
        return np.array(values, dtype=np.int64) != 0
    info = np.iinfo(dtype)
    return np.clip(np.array(values), info.min, info.max).astype(dtype)


def divisions(xs, ys):
    return {d: (nm.floor_divide(xs[d], ys[d]), nm.mod(xs[d], ys[d])) for d in INTS}


@functools.cache
def division_paths():
    """floor_divide and mod of every integer dtype: one program per path."""
    xs = {d: nm.tensor(ints(d, NUMER), "i") for d in INTS}
    ys = {d: nm.tensor(ints(d, DENOM), "i") for d in INTS}
    return {
        "eager": divisions(xs, ys),
        "jit": jax.jit(divisions)(xs, ys),
        "lowered": lower(divisions, MESH, "i:x")(xs, ys),
    }


@pytest.mark.parametrize("path", ["eager", "jit", "lowered"])
def test_integer_floor_divide_and_mod_by_zero_equal_numpy(path):
    """x // 0 and x % 0 are 0 for integers in NumPy; XLA's division gave -2 (-1 floored),
    and all ones unsigned, under jit and lowered."""
    for dtype, (quotient, remainder) in division_paths()[path].items():
        a, b = ints(dtype, NUMER), ints(dtype, DENOM)
        with np.errstate(all="ignore"):
            want_q, want_r = np.floor_divide(a, b), np.mod(a, b)
        assert quotient.dtype == remainder.dtype == a.dtype  # (NumPy's bool // bool: int8)
        np.testing.assert_array_equal(np.asarray(quotient.data).astype(int), want_q, dtype)
        np.testing.assert_array_equal(np.asarray(remainder.data).astype(int), want_r, dtype)


@pytest.mark.filterwarnings("ignore:Degrees of freedom", "ignore::RuntimeWarning")
def test_var_and_std_with_ddof_at_least_the_count_equal_numpy():
    """NumPy divides by max(count - ddof, 0): inf, or NaN for 0 / 0; jax gave NaN."""
    x = nm.tensor(np.array([[1, 2, 3, 4, 5, 6, 7, 8], [3] * 8], np.float32), "r d")
    moments = lambda t: [f(t, "d", ddof=k) for f in (nm.var, nm.std) for k in (7, 8, 9)]
    want = [
        f(x.data.astype(np.float64), axis=1, ddof=k) for f in (np.var, np.std) for k in (7, 8, 9)
    ]
    with np.errstate(all="ignore"):
        paths = {
            "eager": moments(x),
            "jit": jax.jit(moments)(x),
            "lowered": lower(moments, MESH, "d:x")(x),
        }
    for path, got in paths.items():
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g.data), w, rtol=1e-6, err_msg=path)


@pytest.mark.parametrize("op", ["max", "min", "argmax", "argmin"])
def test_reductions_without_identity_over_an_empty_dim_raise_shape_error(op):
    """NumPy and jax raise a bare ValueError; so did namedmesh, eagerly and traced."""
    x = nm.zeros({"r": 2, "d": 0})
    for call in (
        lambda: getattr(nm, op)(x, "d"),
        lambda: nm.trace(lambda t: getattr(nm, op)(t, "d"), x),
    ):
        with pytest.raises(
            nm.ShapeError, match=rf"{op}: dim 'd' of the tensor \(r: 2, d: 0\) has size 0"
        ):
            call()
    assert getattr(nm, op)(nm.zeros({"r": 0, "d": 2}), "d").shape == (0,)  # as NumPy


def test_python_ints_that_do_not_fit_an_integer_dtype_raise_dtype_error():
    u8 = nm.tensor(np.array([1, 5, 250], np.uint8), "i")
    cases = [
        (
            lambda: u8 + 300,
            "add: the scalar 300 does not fit uint8, the dtype of the tensor (i: 3)",
        ),
        (lambda: u8 * -1, "multiply: the scalar -1 does not fit uint8"),
        (lambda: nm.full({"i": 2}, 128, np.int8), "full: value 128 does not fit int8"),
        (lambda: nm.full({"i": 2}, float("nan"), np.int32), "full: value nan does not fit int32"),
        (lambda: nm.pad(u8, {"i": 1}, value=np.inf), "pad: value inf does not fit uint8"),
        (lambda: nm.pad(u8, {"i": 1}, value=-1), "pad: value -1 does not fit uint8"),
        (lambda: nm.shift(u8, "i", 1, fill=256), "shift: fill 256 does not fit uint8"),
        (lambda: nm.arange("i", 3, start=2**31 - 2), "arange: the last value 2147483648 does"),
        (lambda: nm.random.integers(0, {"i": 2}, 0, 1000, np.int8), "integers: high - 1 999"),
    ]
    for call, message in cases:
        with pytest.raises(nm.DtypeError, match=re.escape(message)):
            call()
    assert nm.full({"i": 2}, -2.7, np.int8).data.tolist() == [-2, -2]  # in range: truncated
    # A clip bound beyond the dtype's range bounds nothing, as np.clip
    np.testing.assert_array_equal(nm.clip(u8, -2, 300).data, np.clip(u8.data, -2, 300))
    np.testing.assert_array_equal(nm.clip(u8, -2, 3).data, np.clip(u8.data, -2, 3))
    with pytest.raises(nm.DtypeError, match="'float33' is not a dtype"):
        u8.astype("float33")


def test_random_integers_cover_wide_ranges_evenly_and_stay_inside_them():
    """The hash word modulo the range's width favoured low values (a third of [0, 3 * 2**30)
    drew half the values) and, added in int32, wrapped past its top to negative values."""
    wide = nm.random.integers(1, {"n": 60_000}, 0, 3 * 2**30, np.uint32).data.astype(np.int64)
    assert abs(np.mean(wide < 2**30) - 1 / 3) < 0.01 and abs(np.mean(wide >= 2**31) - 1 / 3) < 0.01
    top = nm.random.integers(2, {"n": 60_000}, 2**31 - 3 * 2**29, 2**31 - 1).data.astype(np.int64)
    assert top.min() >= 2**31 - 3 * 2**29 and abs(np.mean(top < 2**31 - 2**30) - 1 / 3) < 0.01
    every = nm.random.integers(3, {"n": 60_000}, -(2**31), 2**31).data  # 2**32 values
    assert every.dtype == np.int32 and every.min() < -(2**30) and every.max() > 2**30
    small = nm.random.integers(4, {"n": 70_000}, -3, 4, np.int8).data
    assert small.dtype == np.int8 and np.all(np.abs(np.bincount(small + 3) / 70_000 - 1 / 7) < 0.01)
    with pytest.raises(nm.DtypeError, match="integers: dtype must be an integer dtype"):
        nm.random.integers(0, {"n": 2}, 0, 3, np.float32)


@pytest.mark.parametrize(
    "dtype, low, high",
    [(ml_dtypes.bfloat16, 0.0, 1.0), (np.float16, 2.0, 3.0), (np.float32, 2.0, 3.0)],
)
def test_random_uniform_stays_below_maxval_in_every_float_dtype(dtype, low, high):
    """lo + u * (hi - lo) rounded to hi in the dtype: bfloat16's 1.0, one in 500 draws."""
    u = nm.random.uniform(5, {"n": 50_000}, low, high, dtype)
    values = u.data.astype(np.float64)
    assert u.dtype == dtype and values.min() >= low and values.max() < high
    with pytest.raises(nm.DtypeError, match="normal: dtype must be a float dtype, got int32"):
        nm.random.normal(0, {"n": 2}, np.int32)


def test_random_key_refuses_a_seed_beyond_64_bits():
    """key(2**64) was key(0): its high bits were dropped."""
    assert not np.array_equal(nm.random.key(2**64 - 1).data, nm.random.key(0).data)
    with pytest.raises(nm.ShapeError, match="seed 18446744073709551616 does not fit 64 bits"):
        nm.random.key(2**64)


BAD_INPUTS = [  # (call, error type, what the message must say)
    (lambda: nm.tensor([[1, 2], [3]], "a b"), nm.ShapeError, "data is not an array"),
    (lambda: nm.tensor(np.array(["a", "b"]), "d"), nm.DtypeError, "dtype <U1 (('d',)) is not"),
    (lambda: nm.tensor(np.ones(2), None), nm.ShapeError, "dims must name every axis"),
    (lambda: nm.grad(lambda t: t.sum())(nm.ones({"d": 2}, np.int32)), nm.DtypeError,
     "nm.grad: argument 0 (d: 2) is int32, which has no gradient"),
    (lambda: nm.trace(lambda t: nm.tensor(t.data.reshape(2), "d"), nm.ones({"d": 2})),
     nm.TracedValueError, "'Var' object has no attribute 'reshape'"),
    (lambda: nm.top_k(nm.ones({"d": 4}), "d", 5), nm.ShapeError, "k=5 must be in [1, 4]"),
    (lambda: bool(nm.ones({"d": 2}) > 0), nm.ShapeError,
     "bool() of a Tensor bool[d=2] takes one element, it has 2: use nm.any or nm.all"),
    (lambda: float(nm.zeros({"d": 0})), nm.ShapeError, "float() of a Tensor f32[d=0]"),
    (lambda: nm.concat([nm.ones({"d": 2}), np.ones(2)], "d"), nm.ArgumentError,
     "concat: item 1 of the list is a ndarray, not a Tensor"),
    (lambda: nm.stack(nm.ones({"d": 2}), "s"), nm.ArgumentError, "stack: takes a list of Tensors"),
    (lambda: nm.split(nm.ones({"d": 4}), "d", 1.5), nm.ArgumentError,
     "split: sizes must be an int or a list of ints, got 1.5"),
    (lambda: nm.zeros({"d": True}), nm.ShapeError, "size of dim 'd' must be a non-negative int"),
    # traced, a one-operand add was recorded and failed in jax when lowered
    (lambda: nm.trace(lambda t: nm.add(t), nm.ones({"d": 2})), nm.ArgumentError,
     "add takes 2 operand(s), got 1"),
    (lambda: nm.constrain(nm.ones({"r": 2, "d": 2}), "r:x,d:y"), nm.LayoutError,
     "rules are separated by ';'"),
]  # fmt: skip


@pytest.mark.parametrize("call, error, message", BAD_INPUTS)
def test_bad_inputs_raise_typed_errors_that_name_the_culprit(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()
    assert nm.top_k(nm.ones({"d": 4}), "d", np.int64(2))[0].shape == (2,)  # a NumPy int k
    assert int(nm.full({"a": 1, "b": 1}, 3)) == 3  # one element of any rank (NumPy 2: 0-d)
    assert [p.shape for p in nm.split(nm.ones({"d": 4}), "d", np.int64(2))] == [(2,), (2,)]


def saturated(values, dtype) -> list[int]:
    """A float to an integer as XLA converts it: toward 0, held to the dtype's range, NaN 0."""
    info = np.iinfo(dtype)
    clamp = lambda v: int(min(max(v, info.min), info.max))  # (inf clamps before int())
    return [0 if np.isnan(v) else clamp(float(np.trunc(v))) for v in values]


def test_astype_of_floats_an_integer_dtype_cannot_hold_has_one_meaning_on_every_path():
    """NumPy's cast is undefined there (300.0 gave 44 in int8; NaN and inf int32's
    minimum), while jit and lowered saturate: eager NumPy now saturates too."""
    values = [300.0, -1.0, np.nan, 1e10, -1e10, np.inf, -np.inf, -2.7, 255.5, 127.9]
    dtypes = [np.int8, np.uint8, np.int16, np.int32, np.uint32]
    x = nm.tensor(np.array(values + [0.0, 0.0], np.float32), "i")  # (12: the mesh divides)
    casts = lambda t: [t.astype(d) for d in dtypes]
    paths = {"eager": casts(x), "jit": jax.jit(casts)(x), "lowered": lower(casts, MESH, "i:x")(x)}
    for path, got in paths.items():
        for g, dtype in zip(got, dtypes, strict=True):
            want = saturated(x.data.astype(np.float64), dtype)
            assert g.dtype == dtype and np.asarray(g.data).tolist() == want, (path, dtype)


def test_softmax_and_log_softmax_over_an_empty_dim_are_empty_on_every_path():
    """scipy's max of nothing raised eagerly, and jax's under jit and lowered."""
    x = nm.zeros({"r": 4, "d": 0})
    norms = lambda t: [nm.softmax(t, "d"), nm.log_softmax(t, "d"), nm.logsumexp(t, "d")]
    paths = {"eager": norms(x), "jit": jax.jit(norms)(x), "lowered": lower(norms, MESH, "d:x")(x)}
    for path, (sm, lsm, lse) in paths.items():
        assert sm.shape == lsm.shape == (4, 0) and sm.dtype == np.float32, path
        assert np.asarray(lse.data).tolist() == [-np.inf] * 4, path  # scipy's log(0)


def long_sums(t):
    return [nm.sum(t, "d"), nm.mean(t, "d"), nm.cumsum(t, "d"), nm.var(t, "d"),
            nm.pool(t, {"d": 1024}, stride=1024, kind="mean")]  # fmt: skip


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_long_sums_of_16_bit_floats_accumulate_in_float32_on_every_path(dtype):
    """NumPy adds bfloat16 in bfloat16: the sum of 4096 values of 0.1 was 32 eagerly and in
    nm.reference (410 under jit and lowered), its mean 0.0078; float16's cumsum stalled at
    256. Every path now accumulates in float32, as XLA does."""
    a = (0.1 + np.arange(4096) % 3 * 0.25).astype(dtype)
    x = nm.tensor(np.stack([a, a]), "r d")
    wide = np.stack([a, a]).astype(np.float64)
    want = [wide.sum(1), wide.mean(1), np.cumsum(wide, 1), wide.var(1),
            wide.reshape(2, 4, 1024).mean(2)]  # fmt: skip
    paths = {"eager": long_sums(x), "reference": nm.reference(nm.trace(long_sums, x))(x),
             "jit": jax.jit(long_sums)(x), "lowered": lower(long_sums, MESH, "d:x")(x)}  # fmt: skip
    for path, got in paths.items():
        for g, w in zip(got, want, strict=True):
            assert g.dtype == dtype, path
            got_wide = np.asarray(g.data).astype(np.float64)
            np.testing.assert_allclose(got_wide, w, rtol=0.02, err_msg=path)
