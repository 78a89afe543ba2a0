"""xarray interop. Tensors carry no coordinates: `from_xarray` drops them and
`to_xarray` attaches only the coordinates it is given."""

from __future__ import annotations

import numpy as np

from namedmesh.tensor import Tensor


def from_xarray(da) -> Tensor:
    """A Tensor with the DataArray's values and dims (coordinates and attrs are dropped)."""
    import xarray as xr

    if not isinstance(da, xr.DataArray):
        raise TypeError(f"from_xarray takes an xarray.DataArray, got {type(da).__name__}")
    return Tensor(np.asarray(da.values), tuple(str(d) for d in da.dims))


def to_xarray(t: Tensor, coords=None, name=None):
    """An xarray.DataArray of `t`'s values (copied to NumPy) with its dims, and `coords`
    when given."""
    import xarray as xr

    return xr.DataArray(np.asarray(t.data), dims=t.dims, coords=coords, name=name)
