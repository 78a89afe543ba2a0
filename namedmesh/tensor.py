"""`Tensor`: an N-d array whose axes have unique names.

The op modules import this one; the methods that are ops (`a + b`, `t.sum("d")`) are
bound onto Tensor from above them, by namedmesh/methods.py."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import jax
import numpy as np

from namedmesh import numpy_dispatch
from namedmesh.avals import TRACES, Aval, Var, fmt_aval, is_jax_array
from namedmesh.checks import names_not_positions, require_dims
from namedmesh.errors import DtypeError, ShapeError

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


def parse_sizes(sizes: Mapping[str, int], op: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(dims, shape) of a `sizes` argument (dim -> size, in order, or a Tensor, whose
    sizes), a ShapeError naming `op` for anything else or a size that is not a
    non-negative int."""
    if isinstance(sizes, Tensor):
        sizes = sizes.sizes
    if not isinstance(sizes, Mapping):
        raise ShapeError(f"{op}: sizes must be a mapping dim -> size, got {sizes!r}")
    dims = parse_dims(tuple(sizes), op)
    for d, s in sizes.items():
        if not isinstance(s, int | np.integer) or isinstance(s, bool) or s < 0:
            raise ShapeError(f"{op}: size of dim {d!r} must be a non-negative int, got {s!r}")
    return dims, tuple(int(s) for s in sizes.values())


def native_order(array: np.ndarray) -> np.ndarray:
    """`array` in the machine's byte order: a big-endian array ('>f4', as some files and
    network formats give) converted, so that no op meets a byte order jax refuses (its
    type promotion and arrays take native dtypes only) or a dtype that compares unequal
    to the shape rule's ('>f4' != '<f4')."""
    dt = array.dtype
    return array if dt.isnative else array.astype(dt.newbyteorder("="))


def native_dtype(dtype) -> np.dtype:
    """np.dtype(dtype) in the machine's byte order: a dtype argument of '>f4' makes the
    native float32, as `native_order` makes its arrays."""
    try:
        dt = np.dtype(dtype)
    except TypeError as e:  # (NumPy's "data type 'foo' not understood")
        raise DtypeError(f"{dtype!r} is not a dtype: {e}") from None
    return dt if dt.isnative else dt.newbyteorder("=")


# Object, string, bytes and date dtypes: jax has none of them (bfloat16's kind, "V", is
# numbers)
_NOT_NUMBERS = "OUSMm"


def _as_array(data) -> np.ndarray:
    try:
        return np.asarray(data)
    except ValueError as e:  # (a ragged list: "inhomogeneous shape")
        raise ShapeError(f"nm.tensor(data, dims): data is not an array: {e}") from None


# nm.rename, which Tensor(traced value, new dims) records: namedmesh/structural.py,
# which defines it above Tensor (it binds a primitive), registers it on import, so that
# Tensor imports nothing above it (that import would close a circle through eager.py)
_RENAME: list = []


def renames_with(rename) -> None:
    """Record a traced value re-wrapped under new dims as `rename(tensor, mapping)`."""
    _RENAME[:] = [rename]


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
        if dims is None:
            raise ShapeError("nm.tensor(data, dims): dims must name every axis, got None")
        dims = parse_dims(dims, "nm.tensor(data, dims)")
        if not isinstance(data, np.ndarray | Var | jax.ShapeDtypeStruct) and not is_jax_array(data):
            data = _as_array(data)
        if isinstance(data, np.ndarray):
            data = native_order(data)
            if data.dtype.kind in _NOT_NUMBERS:
                raise DtypeError(
                    f"nm.tensor(data, dims): data of dtype {data.dtype} ({dims}) is not "
                    "numbers or bools, which no op computes on"
                )
        if data.ndim != len(dims):
            raise ShapeError(
                f"data of shape {tuple(data.shape)} has {data.ndim} axes but {len(dims)} "
                f"dims were named: {dims}"
            )
        if isinstance(data, Var) and data.dims != dims:
            if TRACES.frames:  # re-wrapping a traced value under new names is a rename
                data = _RENAME[0](
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
        return numpy_dispatch.apply_ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        """`np.sum(t, axis="d")`, `np.where(c, t, 0)`, ...: the named op, by dim name."""
        return numpy_dispatch.apply_function(func, args, kwargs)

    def __len__(self) -> int:
        if not self.dims:
            raise TypeError("len() of a 0-d Tensor")
        return self.shape[0]

    def __bool__(self) -> bool:
        return bool(self._one("bool", "use nm.any or nm.all"))

    def __float__(self) -> float:
        return float(self._one("float"))

    def __int__(self) -> int:
        return int(self._one("int"))

    def _one(self, what: str, hint: str = "select one with isel or reduce first"):
        """The data of a one-element Tensor; a ShapeError naming the dims otherwise
        (NumPy's error names neither the tensor nor the way out)."""
        if math.prod(self.shape) != 1:
            raise ShapeError(
                f"{what}() of a Tensor {fmt_aval(self.aval)} takes one element, it has "
                f"{math.prod(self.shape)}: {hint}"
            )
        return np.asarray(self.data).reshape(())  # (NumPy 2 converts 0-d arrays only)

    def item(self):
        """The value of a one-element Tensor as a Python scalar (reads the data)."""
        return np.asarray(self.data).item()

    def __repr__(self) -> str:
        head = f"<namedmesh.Tensor {fmt_aval(self.aval)}>"
        if isinstance(self.data, Var):
            return head + " (traced)"
        if isinstance(self.data, jax.ShapeDtypeStruct):
            return head + " (abstract)"
        if is_jax_array(self.data) and isinstance(self.data, jax.core.Tracer):
            return head + f" ({type(self.data).__name__})"
        return head + "\n" + np.array2string(np.asarray(self.data), threshold=50, edgeitems=2)

    __hash__ = None  # == is elementwise

    def __pos__(self):
        return self

    @property
    def values(self) -> np.ndarray:
        """The data as a NumPy array (xarray's `.values`)."""
        return np.asarray(self)


jax.tree_util.register_pytree_node(
    Tensor,
    lambda t: ((t.data,), t.dims),
    lambda dims, children: Tensor._make(children[0], dims),
)
