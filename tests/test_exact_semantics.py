"""Issue 13's silent wrong answers along a split dim, each as the issue reported it, with
NumPy as the oracle: max/min (1), argmax/argmin (2), bool einsum (6), bool max pool (8),
softmax with +inf (9), and the flops of work done outside ctx.local (10)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import scipy.special

import namedmesh as nm
from lowering import Mesh, lower

MESH = Mesh({"x": 4})
NAN, INF = np.nan, np.inf


def split(fn, *xs, layout="d:x"):
    """fn(*xs) lowered with `d` split over 4 devices, as NumPy arrays."""
    out = lower(fn, MESH, layout)(*xs)
    return [np.asarray(o.data) for o in out] if isinstance(out, list) else np.asarray(out.data)


def rows(values, dtype):
    return nm.tensor(np.array(values, dtype), "r d")


MAX_MIN_CASES = [  # the cases: wrong through float32, overflowing on ties, NaN lost
    ([[2**24 + 1, 0, 0, 0, 0, 0, 0, 0]], np.int32),
    ([[2**30, 2**30, 0, 1, 5, 6, 7, 8]], np.int32),
    ([[-(2**31), -(2**31), 0, 1, 2, 3, 4, 5]], np.int32),
    ([[60000, 60000, 0, 1, 2, 3, 4, 5]], np.float16),
    ([[3.4e38, 3.4e38, 0, 1, 2, 3, 4, 5]], np.float32),
    ([[1, NAN, 0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 0, 0, 0, NAN]], np.float32),
    ([[127, 127, -128, -128, 0, 0, 0, 0]], np.int8),
    ([[255, 255, 0, 0, 0, 0, 1, 1]], np.uint8),
    ([[True, False, False, False, False, False, False, False]], np.bool_),
    ([[1, 2, 3, 3, -INF, INF, INF, 0]], ml_dtypes.bfloat16),
]


@pytest.mark.parametrize("values, dtype", MAX_MIN_CASES)
@pytest.mark.parametrize("op", ["max", "min"])
def test_max_min_over_a_split_dim_equal_numpy_bit_for_bit(values, dtype, op):
    x = rows(values, dtype)
    got = split(lambda t: getattr(nm, op)(t, "d"), x)
    want = getattr(np, op)(x.data, axis=1)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)  # NaN where NumPy has one


def test_max_gradient_over_a_split_dim_follows_jax_tie_rule():
    x = np.array(
        [[3, 1, 3, 3, 0, 3, 2, 1], [1, NAN, 2, 2, 0, 0, 0, 0], [0, -0.0, -1] + [-2] * 5], np.float32
    )
    loss = lambda t: nm.max(t, "d").sum()
    f = lower(loss, MESH, "d:x")
    got = jax.grad(lambda a: f(nm.tensor(a, "r d")).data)(jnp.asarray(x))
    want = jax.grad(lambda a: jnp.max(a, axis=1).sum())(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.asarray(got)[0].tolist() == [0.25, 0, 0.25, 0.25, 0, 0.25, 0, 0]  # 4 ties


def test_argmin_argmax_over_a_split_dim_break_ties_and_nan_as_numpy():
    x = rows(
        [
            [0.0, -0.0, 1, 2, 3, 4, 5, 6],
            [1, 2, 3, 3, NAN, 4, 5, NAN],
            [-0.0, 0.0, -1, -1, -1, -1, -1, -1],
            [5, 5, 5, 5, 5, 5, 5, 5],
        ],
        np.float32,
    )
    for op in ("argmin", "argmax"):
        got = split(lambda t, op=op: getattr(nm, op)(t, "d"), x)
        np.testing.assert_array_equal(got, getattr(np, op)(x.data, axis=1))
    assert split(lambda t: nm.argmin(t, "d"), x)[0] == 0  # the case


def test_top_k_over_a_split_dim_ranks_as_numpy():
    x = rows([[0.0, -0.0, NAN, 2, -0.0, 0.0, NAN, 2]], np.float32)
    vals, idx = split(lambda t: list(nm.top_k(t, "d", 2, new_dim="k")), x)
    want_vals, want_idx = nm.top_k(x, "d", 2, new_dim="k")  # the NumPy reference
    np.testing.assert_array_equal(idx, want_idx.data)
    assert idx.tolist() == [[2, 6]]  # NaNs first, the first index first
    np.testing.assert_array_equal(vals, want_vals.data)


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.uint8, np.int32])
def test_bool_and_integer_einsums_over_a_split_dim_keep_numpy_dtype_and_wrap(dtype):
    r = np.random.default_rng(0)
    a = r.integers(0, 2, (2, 8)) if dtype == np.bool_ else r.integers(100, 127, (2, 8))
    b = r.integers(0, 2, (8, 3)) if dtype == np.bool_ else r.integers(100, 127, (8, 3))
    a, b = nm.tensor(a.astype(dtype), "r d"), nm.tensor(b.astype(dtype), "d s")
    got = split(lambda x, y: nm.einsum(x, y, out="r s"), a, b)
    want = np.matmul(a.data, b.data)  # NumPy: bool stays bool, int8 wraps
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(got, want)


def test_max_pool_of_bool_along_a_split_dim():
    x = rows([[True, False, False, False, False, False, False, True]], np.bool_)
    got = split(lambda t: nm.pool(t, {"d": 3}, stride=1, padding="SAME"), x)
    padded = np.pad(x.data, ((0, 0), (1, 1)), constant_values=False)  # max's identity
    want = np.max(np.lib.stride_tricks.sliding_window_view(padded, 3, axis=1), axis=-1)
    np.testing.assert_array_equal(got, want)


def test_softmax_log_softmax_logsumexp_with_inf_and_nan_along_a_split_dim():
    x = rows(
        [
            [0, 1, INF, 0, 1, 2, 3, 4],
            [0, -INF, 1, 2, 0, 0, 0, 0],
            [-INF] * 8,
            [0, 1, NAN, 0, 0, 0, 0, 0],
            [INF, -INF, 0, 0, 0, 0, 0, 0],
        ],
        np.float32,
    )
    for op in ("softmax", "log_softmax", "logsumexp"):
        got = split(lambda t, op=op: getattr(nm, op)(t, "d"), x)
        with np.errstate(invalid="ignore", divide="ignore"):
            want = getattr(scipy.special, op)(x.data, axis=1)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # NaN and inf where scipy
    assert np.isnan(split(lambda t: nm.softmax(t, "d"), x)[0]).all()  # the row


@pytest.mark.parametrize("op", ["top_k", "softmax", "argmax", "logsumexp", "max"])
def test_flops_of_an_op_along_a_split_dim_are_counted(op):
    x = nm.tensor(np.random.default_rng(1).normal(size=(8, 64)).astype(np.float32), "b d")
    fn = {"top_k": lambda t: nm.top_k(t, "d", 2, new_dim="k")[0]}.get(
        op, lambda t: getattr(nm, op)(t, "d")
    )
    split_flops = lower(fn, MESH, "d:x").report(x, show=False).flops
    replicated = lower(fn, MESH, "").report(x, show=False).flops
    assert replicated > 0 and split_flops >= replicated / 4  # 8x64 top_k: 512 over 4 devices
