import jax
import numpy as np
import pytest
import scipy.special
import xarray as xr

import namedmesh as nm
from namedmesh import ShapeError

rng = np.random.default_rng(0)
DATA = rng.normal(size=(2, 3, 4)).astype(np.float32)
T = nm.tensor(DATA, "a b c")
DA = xr.DataArray(DATA, dims=("a", "b", "c"))


def run_both(fn, *args):
    """Eager NumPy result and jax.jit result of fn(T, *args)."""
    return fn(T, *args), jax.jit(lambda t: fn(t, *args))(T)


def check(t, da, rtol=1e-5):
    assert t.dims == tuple(da.dims)
    np.testing.assert_allclose(np.asarray(t.data), da.values, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("name", ["sum", "mean", "max", "min", "prod"])
@pytest.mark.parametrize("dims", [None, "b", "a c", ("c", "a")])
def test_reductions_match_xarray(name, dims):
    xr_dims = None if dims is None else (dims.split() if isinstance(dims, str) else list(dims))
    want = getattr(DA, name)(dim=xr_dims)
    for got in run_both(lambda t, d: getattr(nm, name)(t, d), dims):
        check(got, want)
    check(getattr(T, name)(dims), want)


def test_any_all():
    pos = T > 0
    check(nm.any(pos, "b"), (DA > 0).any("b"))
    check(nm.all(pos, "b c"), (DA > 0).all(["b", "c"]))


def test_argmax_argmin_match_xarray():
    for got in run_both(nm.argmax, "b"):
        check(got, DA.argmax("b"))
        assert got.dtype == np.int32
    check(T.argmin("c"), DA.argmin("c"))


def test_logsumexp_matches_scipy_and_is_stable():
    for got in run_both(nm.logsumexp, "c"):
        np.testing.assert_allclose(got.data, scipy.special.logsumexp(DATA, axis=2), rtol=1e-5)
        assert got.dims == ("a", "b")
    big = nm.tensor(np.array([1000.0, 1000.0], np.float32), "v")
    np.testing.assert_allclose(nm.logsumexp(big, "v").data, 1000 + np.log(2), rtol=1e-6)


def test_softmax_and_log_softmax():
    e = np.exp(DATA - DATA.max(axis=1, keepdims=True))
    want = e / e.sum(axis=1, keepdims=True)
    for got in run_both(nm.softmax, "b"):
        assert got.dims == ("a", "b", "c")
        np.testing.assert_allclose(got.data, want, rtol=1e-5)
    for got in run_both(nm.log_softmax, "b"):
        np.testing.assert_allclose(got.data, np.log(want), rtol=1e-5, atol=1e-6)
    s = nm.softmax(T, "a c")
    np.testing.assert_allclose(s.data.sum(axis=(0, 2)), np.ones(3), rtol=1e-5)


def test_top_k_matches_sort():
    order = np.argsort(-DATA, axis=2)[:, :, :2]
    for vals, idx in run_both(nm.top_k, "c", 2):
        assert vals.dims == idx.dims == ("a", "b", "c") and vals.shape == (2, 3, 2)
        np.testing.assert_array_equal(idx.data, order)
        np.testing.assert_allclose(vals.data, np.take_along_axis(DATA, order, 2))
    vals, idx = nm.top_k(T, "b", 1, new_dim="best")
    assert vals.dims == ("a", "best", "c")
    np.testing.assert_allclose(vals.data[:, 0], DATA.max(axis=1))


def test_cumsum_matches_xarray():
    for got in run_both(nm.cumsum, "b"):
        check(got, DA.cumsum("b"))
    rev = nm.cumsum(T, "c", reverse=True)
    np.testing.assert_allclose(rev.data, np.flip(np.cumsum(np.flip(DATA, 2), 2), 2), rtol=1e-5)
    b = nm.tensor(np.array([True, False, True]), "s")
    np.testing.assert_array_equal(nm.cumsum(b, "s").data, [1, 1, 2])
    np.testing.assert_array_equal(jax.jit(lambda x: nm.cumsum(x, "s"))(b).data, [1, 1, 2])


def test_int_sum_keeps_int32():
    i = nm.tensor(np.arange(6, dtype=np.int32).reshape(2, 3), "a b")
    assert i.sum("b").dtype == np.int32 and i.mean().dtype == np.float32


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: T.sum("z"), r"\['z'\] not in the tensor's dims \('a', 'b', 'c'\)"),
        (lambda: nm.softmax(T, "q"), "'q'"),
        (lambda: nm.argmax(T, "a b"), "one dim"),
        (lambda: nm.top_k(T, "c", 5), r"k=5 must be in \[1, 4\]"),
        (lambda: nm.top_k(T, "c", 2, new_dim="a"), "new_dim 'a'"),
        (lambda: nm.cumsum(T, "zz"), "'zz'"),
    ],
)
def test_reduction_errors_name_the_dims(call, match):
    with pytest.raises(ShapeError, match=match):
        call()


@pytest.mark.parametrize(
    "arr",
    [
        np.array([0, 5, 3, 5], np.uint8),
        np.array([np.iinfo(np.int32).min, 1, 2, 1], np.int32),
        np.array([True, False, True, False]),
        np.array([1.0, np.nan, 3.0, 3.0]),
    ],
)
def test_top_k_numpy_and_jax_agree_on_awkward_dtypes(arr):
    """Descending, lower index first on ties, NaN largest: jax.lax.top_k's order."""
    vals = arr.astype(np.float64)
    nan_first = np.where(np.isnan(vals), np.inf, vals)
    want = sorted(range(arr.size), key=lambda i: (-nan_first[i], i))[:3]
    t = nm.tensor(arr, "a")
    for vals, idx in (nm.top_k(t, "a", 3), jax.jit(lambda t: nm.top_k(t, "a", 3))(t)):
        np.testing.assert_array_equal(np.asarray(idx.data), want)
        np.testing.assert_array_equal(np.asarray(vals.data), arr[want])


def test_narrow_int_sums_accumulate_in_int32():
    i8 = nm.tensor(np.array([100, 100], np.int8), "a")
    assert i8.sum().dtype == np.int32 and int(i8.sum()) == 200
    assert jax.jit(lambda t: t.sum())(i8).dtype == np.int32
