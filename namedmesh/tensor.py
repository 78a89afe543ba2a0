"""`Tensor`: an N-d array whose axes have unique names."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import jax
import numpy as np

from namedmesh import habits as _habits  # needs only errors: the decorators below use it
from namedmesh.checks import names_not_positions, require_dims
from namedmesh.errors import ShapeError
from namedmesh.primitive import TRACE_STACK, Aval, Var, _fmt_aval, _is_jax

DimsLike = str | Iterable[str]


def parse_dims(dims: DimsLike, what: str = "dims", have=None) -> tuple[str, ...]:
    """`"batch d"` or `("batch", "d")` -> `("batch", "d")`; names must be unique strings.
    A position (an int) is a ShapeError naming `what` and, given `have` (the tensor's
    dims), the name at that position."""
    names_not_positions(dims, what, have)
    out = tuple(dims.split()) if isinstance(dims, str) else tuple(dims)
    for d in out:
        if not isinstance(d, str) or not d:
            raise ShapeError(f"{what}: dim names must be non-empty strings, got {d!r} in {out}")
    if len(set(out)) != len(out):
        dup = sorted({d for d in out if out.count(d) > 1})
        raise ShapeError(f"{what}: repeated dim name(s) {dup} in {out}")
    return out


class Tensor:
    """An array plus `.dims`, a tuple of unique names, one per axis.

    `.data` is a NumPy array when eager, a jax.Array under jit/grad or after lowering,
    and an abstract `Var` inside `nm.trace`. Tensor is a JAX pytree: data is the leaf,
    dims are static.
    """

    __slots__ = ("data", "dims")
    __array_priority__ = 100  # numpy scalars on the left defer to Tensor's operators

    def __init__(self, data, dims: DimsLike):
        """`data` (array-like) with one name per axis; ShapeError when the count differs."""
        dims = parse_dims(dims, "nm.tensor(data, dims)")
        if not isinstance(data, np.ndarray | Var | jax.ShapeDtypeStruct) and not _is_jax(data):
            data = np.asarray(data)
        if data.ndim != len(dims):
            raise ShapeError(
                f"data of shape {tuple(data.shape)} has {data.ndim} axes but {len(dims)} "
                f"dims were named: {dims}"
            )
        if isinstance(data, Var) and data.dims != dims:
            if TRACE_STACK:  # re-wrapping a traced value under new names is a rename
                from namedmesh.structural import rename

                data = rename(
                    Tensor._make(data, data.dims), dict(zip(data.dims, dims, strict=True))
                ).data
        self.data = data
        self.dims = dims

    @classmethod
    def _make(cls, data, dims: tuple[str, ...]) -> Tensor:
        """Unchecked constructor for internal use and pytree unflattening."""
        t = object.__new__(cls)
        t.data = data
        t.dims = dims
        return t

    # --- shape --------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """The positional shape, one size per dim in `.dims` order."""
        return tuple(self.data.shape)

    @property
    def sizes(self) -> dict[str, int]:
        """dim name -> size, in `.dims` order."""
        return dict(zip(self.dims, self.data.shape, strict=True))

    @property
    def dtype(self) -> np.dtype:
        """The NumPy dtype of the data (bfloat16 is ml_dtypes' NumPy dtype)."""
        return np.dtype(self.data.dtype)

    @property
    def ndim(self) -> int:
        """The number of dims."""
        return len(self.dims)

    @property
    def size(self) -> int:
        """The number of elements (1 for a 0-d Tensor)."""
        return math.prod(self.shape)

    @property
    def aval(self) -> Aval:
        """The abstract value: dims, shape and dtype, without data."""
        return Aval(self.dims, self.shape, self.dtype)

    def size_of(self, dim: str) -> int:
        """The size of `dim`, or a ShapeError naming the dims this tensor has."""
        names_not_positions(dim, "size_of", self.dims)
        require_dims("size_of", [dim], self.dims)
        return self.data.shape[self.dims.index(dim)]

    def __array__(self, dtype=None, copy=None):
        arr = np.asarray(self.data)
        return arr if dtype is None else arr.astype(dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        """`np.exp(t)`, `np.maximum(t, 0)`, `a + t` with an ndarray `a`: the named op of the
        same name (namedmesh/numpy_dispatch.py); a typed error where there is none."""
        return _npd.apply_ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        """`np.sum(t, axis="d")`, `np.where(c, t, 0)`, ...: the named op, by dim name."""
        return _npd.apply_function(func, args, kwargs)

    def __len__(self) -> int:
        if not self.dims:
            raise TypeError("len() of a 0-d Tensor")
        return self.shape[0]

    def __bool__(self) -> bool:
        return bool(np.asarray(self.data))

    def __float__(self) -> float:
        return float(np.asarray(self.data))

    def __int__(self) -> int:
        return int(np.asarray(self.data))

    def item(self):
        """The value of a one-element Tensor as a Python scalar (reads the data)."""
        return np.asarray(self.data).item()

    def __repr__(self) -> str:
        head = f"<namedmesh.Tensor {_fmt_aval(self.aval)}>"
        if isinstance(self.data, Var):
            return head + " (traced)"
        if isinstance(self.data, jax.ShapeDtypeStruct):
            return head + " (abstract)"
        if _is_jax(self.data) and isinstance(self.data, jax.core.Tracer):
            return head + f" ({type(self.data).__name__})"
        return head + "\n" + np.array2string(np.asarray(self.data), threshold=50, edgeitems=2)

    __hash__ = None  # == is elementwise

    # --- methods that forward to ops ------------------------------------------------
    def __add__(self, o):
        return _ew.add(self, o)

    def __radd__(self, o):
        return _ew.add(o, self)

    def __sub__(self, o):
        return _ew.subtract(self, o)

    def __rsub__(self, o):
        return _ew.subtract(o, self)

    def __mul__(self, o):
        return _ew.multiply(self, o)

    def __rmul__(self, o):
        return _ew.multiply(o, self)

    def __truediv__(self, o):
        return _ew.divide(self, o)

    def __rtruediv__(self, o):
        return _ew.divide(o, self)

    def __floordiv__(self, o):
        return _ew.floor_divide(self, o)

    def __rfloordiv__(self, o):
        return _ew.floor_divide(o, self)

    def __mod__(self, o):
        return _ew.mod(self, o)

    def __rmod__(self, o):
        return _ew.mod(o, self)

    def __pow__(self, o):
        return _ew.power(self, o)

    def __rpow__(self, o):
        return _ew.power(o, self)

    def __neg__(self):
        return _ew.negative(self)

    def __pos__(self):
        return self

    def __abs__(self):
        return _ew.abs(self)

    def __invert__(self):
        return _ew.logical_not(self)

    def __and__(self, o):
        return _ew.logical_and(self, o)

    def __rand__(self, o):
        return _ew.logical_and(o, self)

    def __or__(self, o):
        return _ew.logical_or(self, o)

    def __ror__(self, o):
        return _ew.logical_or(o, self)

    def __xor__(self, o):
        return _ew.logical_xor(self, o)

    def __rxor__(self, o):
        return _ew.logical_xor(o, self)

    def __eq__(self, o):  # type: ignore[override]
        return _ew.equal(self, o)

    def __ne__(self, o):  # type: ignore[override]
        return _ew.not_equal(self, o)

    def __lt__(self, o):
        return _ew.less(self, o)

    def __le__(self, o):
        return _ew.less_equal(self, o)

    def __gt__(self, o):
        return _ew.greater(self, o)

    def __ge__(self, o):
        return _ew.greater_equal(self, o)

    def astype(self, dtype) -> Tensor:
        """The Tensor converted to `dtype` (same dims); see nm.astype."""
        return _ew.astype(self, dtype)

    @_habits.dim_keyword
    def sum(self, dims: DimsLike | None = None) -> Tensor:
        """The sum over `dims` (names; all dims when None); the reduced dims leave."""
        return _red.sum(self, dims)

    @_habits.dim_keyword
    def mean(self, dims: DimsLike | None = None) -> Tensor:
        """The mean over `dims` (names; all dims when None), in a floating dtype."""
        return _red.mean(self, dims)

    @_habits.dim_keyword
    def max(self, dims: DimsLike | None = None) -> Tensor:
        """The maximum over `dims` (names; all dims when None); NaN wins, as in NumPy."""
        return _red.max(self, dims)

    @_habits.dim_keyword
    def min(self, dims: DimsLike | None = None) -> Tensor:
        """The minimum over `dims` (names; all dims when None); NaN wins, as in NumPy."""
        return _red.min(self, dims)

    @_habits.dim_keyword
    def prod(self, dims: DimsLike | None = None) -> Tensor:
        """The product over `dims` (names; all dims when None); the reduced dims leave."""
        return _red.prod(self, dims)

    def argmax(self, dim: str) -> Tensor:
        """The int32 index of the first maximum along the one dim `dim`, which leaves."""
        return _red.argmax(self, dim)

    def argmin(self, dim: str) -> Tensor:
        """The int32 index of the first minimum along the one dim `dim`, which leaves."""
        return _red.argmin(self, dim)

    @_habits.dim_keyword
    def all(self, dims: DimsLike | None = None) -> Tensor:
        """True where every element over `dims` (all dims when None) is true; see nm.all."""
        return _red.all(self, dims)

    @_habits.dim_keyword
    def any(self, dims: DimsLike | None = None) -> Tensor:
        """True where any element over `dims` (all dims when None) is true; see nm.any."""
        return _red.any(self, dims)

    @_habits.dim_keyword
    def var(self, dims: DimsLike | None = None, ddof: int = 0) -> Tensor:
        """The variance over `dims` (all when None), divisor count - ddof; see nm.var."""
        return _sel.var(self, dims, ddof)

    @_habits.dim_keyword
    def std(self, dims: DimsLike | None = None, ddof: int = 0) -> Tensor:
        """The standard deviation over `dims` (all when None); see nm.std."""
        return _sel.std(self, dims, ddof)

    def isel(self, indexers=None, **kw) -> Tensor:
        """Select (an int drops the dim) or slice by dim name, as xarray; see nm.isel."""
        return _sel.isel(self, indexers, **kw)

    def squeeze(self, dims: DimsLike | None = None) -> Tensor:
        """Without the size-1 `dims` (all size-1 dims when None); see nm.squeeze."""
        return _sel.squeeze(self, dims)

    def expand_dims(self, dims) -> Tensor:
        """With new leading dims (names, or name -> size); see nm.expand_dims."""
        return _sel.expand_dims(self, dims)

    def rename(self, mapping: Mapping[str, str] | None = None, **names: str) -> Tensor:
        """The Tensor with dims renamed (`{"old": "new"}` or old="new"); data untouched."""
        return _st.rename(self, mapping, **names)

    def transpose(self, *dims: str) -> Tensor:
        """The Tensor with its axes in the order `dims` (all of them; `...` for the rest)."""
        return _st.transpose(self, *dims)

    @property
    def values(self) -> np.ndarray:
        """The data as a NumPy array (xarray's `.values`)."""
        return np.asarray(self)

    def __matmul__(self, o):
        """`a @ b`: sum the dims a and b share (xarray.dot); see nm.einsum."""
        return _habits.matmul(self, o)

    def __rmatmul__(self, o):
        return _habits.matmul(o, self)

    def sel(self, *args, **kwargs):
        """No labels to select by: a HabitError naming `isel` (positions by dim name)."""
        _habits.by_label(self, "sel")

    @property
    def loc(self):
        """No labels to select by: a HabitError naming `isel`."""
        _habits.by_label(self, "loc")

    def to_xarray(self, coords=None, name=None):
        """An xarray.DataArray of the values (copied to NumPy) with these dims."""
        from namedmesh.interop import to_xarray

        return to_xarray(self, coords=coords, name=name)


jax.tree_util.register_pytree_node(
    Tensor,
    lambda t: ((t.data,), t.dims),
    lambda dims, children: Tensor._make(children[0], dims),
)

from namedmesh import elementwise as _ew  # noqa: E402  (ops import Tensor)
from namedmesh import numpy_dispatch as _npd  # noqa: E402
from namedmesh import reductions as _red  # noqa: E402
from namedmesh import selection as _sel  # noqa: E402
from namedmesh import structural as _st  # noqa: E402
