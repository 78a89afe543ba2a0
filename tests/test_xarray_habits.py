"""xarray habits on Tensor, with xarray itself as the oracle: `dim=` in reductions,
`...` in transpose, `a @ b` (xarray.dot), `.values`, `.sizes`; and the typed errors
where a habit cannot mean the same."""

import numpy as np
import pytest
import xarray as xr

import namedmesh as nm
from namedmesh.errors import ParameterError
from namedmesh.habits import HabitError

RNG = np.random.default_rng(0)
X = RNG.normal(size=(2, 3, 4)).astype(np.float32)
DIMS = ("batch", "pos", "ch")


def pair(data=X, dims=DIMS):
    return nm.tensor(data, dims), xr.DataArray(data, dims=dims)


def same(ours: nm.Tensor, theirs: xr.DataArray) -> None:
    assert ours.dims == theirs.dims
    np.testing.assert_allclose(ours.data, theirs.values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod", "var", "std"])
@pytest.mark.parametrize("dim", ["pos", ["batch", "ch"], ("pos", "batch")])
def test_reductions_take_xarrays_dim_keyword(op, dim):
    t, a = pair()
    same(getattr(t, op)(dim=dim), getattr(a, op)(dim=dim))


@pytest.mark.parametrize("op", ["all", "any"])
def test_boolean_reductions_take_dim(op):
    t, a = pair(X > 0)
    same(getattr(t, op)(dim="ch"), getattr(a, op)(dim="ch"))


def test_ddof_still_follows_dim():
    t, a = pair()
    same(t.std(dim="pos", ddof=1), a.std(dim="pos", ddof=1))


@pytest.mark.parametrize("order", [("ch", ...), (..., "batch"), ("pos", ..., "batch"), (...,)])
def test_transpose_takes_the_ellipsis_as_xarray(order):
    t, a = pair()
    same(t.transpose(*order), a.transpose(*order))


@pytest.mark.parametrize(
    "left, right",
    [
        (("batch", "pos", "ch"), ("ch", "out")),  # one shared dim
        (("batch", "pos", "ch"), ("pos", "ch")),  # two shared
        (("pos", "ch"), ("batch", "out")),  # none shared: the outer product
    ],
)
def test_matmul_contracts_the_shared_dims_as_xarray_dot(left, right):
    sizes = {"batch": 2, "pos": 3, "ch": 4, "out": 5}
    a = RNG.normal(size=[sizes[d] for d in left]).astype(np.float32)
    b = RNG.normal(size=[sizes[d] for d in right]).astype(np.float32)
    ours = nm.tensor(a, left) @ nm.tensor(b, right)
    same(ours, xr.dot(xr.DataArray(a, dims=left), xr.DataArray(b, dims=right)))


def test_values_and_sizes_as_xarray():
    t, a = pair()
    assert isinstance(t.values, np.ndarray)
    np.testing.assert_array_equal(t.values, a.values)
    assert dict(t.sizes) == dict(a.sizes)


def test_habits_that_cannot_mean_the_same_name_the_namedmesh_way():
    t, _ = pair()
    with pytest.raises(HabitError, match=r"axis=0.*dim=.*'batch', 'pos', 'ch'"):
        t.mean(axis=0)
    with pytest.raises(HabitError, match=r"no coordinates.*isel"):
        t.sel(pos=1)
    with pytest.raises(HabitError, match=r"isel"):
        t.loc[0]
    with pytest.raises(HabitError, match=r"ndarray.*nm.tensor"):
        t @ np.ones(4)
    with pytest.raises(ParameterError, match="both given"):
        t.sum("pos", dim="ch")
