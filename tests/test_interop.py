import numpy as np
import pytest
import xarray as xr

import namedmesh as nm


def test_roundtrip_keeps_values_and_dims():
    data = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    da = xr.DataArray(data, dims=("batch", "d"))
    t = nm.from_xarray(da)
    assert t.dims == ("batch", "d")
    np.testing.assert_array_equal(t.data, data)
    back = t.to_xarray()
    xr.testing.assert_identical(back, da)


def test_coordinates_are_dropped_and_can_be_given_back():
    da = xr.DataArray(np.arange(3.0), dims=("x",), coords={"x": [10, 20, 30]}, attrs={"u": 1})
    t = nm.from_xarray(da)
    back = t.to_xarray()
    assert "x" not in back.coords and back.attrs == {}
    with_coords = t.to_xarray(coords={"x": [10, 20, 30]}, name="v")
    xr.testing.assert_equal(with_coords, da.rename("v"))


def test_named_ops_agree_with_xarray_after_roundtrip():
    a = xr.DataArray(np.arange(6.0).reshape(2, 3), dims=("x", "y"))
    b = xr.DataArray(np.arange(3.0), dims=("y",))
    got = (nm.from_xarray(a) * nm.from_xarray(b)).sum("y").to_xarray()
    xr.testing.assert_allclose(got, (a * b).sum("y"))


def test_from_xarray_rejects_other_types():
    with pytest.raises(TypeError, match="DataArray"):
        nm.from_xarray(np.zeros(3))
