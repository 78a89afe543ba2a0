"""Tensor's methods that are named ops: `a + b` is `nm.add(a, b)`, `t.sum("d")` is
`nm.sum(t, "d")`.

`namedmesh.tensor` holds the array itself and sits below the op modules, which import
it; this module sits above them and binds the ops onto the class from the tables
below, as jax binds its Array's operators (jax/_src/numpy/array_methods.py). So no
module imports back into one that imports it, and `import namedmesh` (which any
`import namedmesh.x` runs first) binds them whatever is imported first.
"""

from __future__ import annotations

from namedmesh import elementwise as ew
from namedmesh import habits, interop
from namedmesh import reductions as red
from namedmesh import selection as sel
from namedmesh import structural as st
from namedmesh.tensor import DimsLike, Tensor

# `a <op> b` -> op(a, b), and the reflected `b <op> a` (b not a Tensor) -> op(b, a)
OPERATORS = {
    "add": ew.add,
    "sub": ew.subtract,
    "mul": ew.multiply,
    "truediv": ew.divide,
    "floordiv": ew.floor_divide,
    "mod": ew.mod,
    "pow": ew.power,
    "and": ew.logical_and,
    "or": ew.logical_or,
    "xor": ew.logical_xor,
    "matmul": habits.matmul,  # sums the dims a and b share (xarray.dot)
}
# `a <cmp> b` -> op(a, b); Python reflects these itself (a < b is b > a)
COMPARISONS = {
    "eq": ew.equal,
    "ne": ew.not_equal,
    "lt": ew.less,
    "le": ew.less_equal,
    "gt": ew.greater,
    "ge": ew.greater_equal,
}
UNARY = {"neg": ew.negative, "abs": ew.abs, "invert": ew.logical_not}
# `t.name(...)` -> op(t, ...): the op itself, taking the Tensor first
OPS = {
    "astype": ew.astype,
    "argmax": red.argmax,
    "argmin": red.argmin,
    "isel": sel.isel,
    "squeeze": sel.squeeze,
    "expand_dims": sel.expand_dims,
    "rename": st.rename,
    "transpose": st.transpose,
}


def _reflected(op):
    def method(self, other):
        return op(other, self)

    return method


class Methods:
    """The named methods of Tensor, each the op of its name; bound onto Tensor by name."""

    @habits.dim_keyword
    def sum(self, dims: DimsLike | None = None) -> Tensor:
        """The sum over `dims` (names; all dims when None); the reduced dims leave."""
        return red.sum(self, dims)

    @habits.dim_keyword
    def mean(self, dims: DimsLike | None = None) -> Tensor:
        """The mean over `dims` (names; all dims when None), in a floating dtype."""
        return red.mean(self, dims)

    @habits.dim_keyword
    def max(self, dims: DimsLike | None = None) -> Tensor:
        """The maximum over `dims` (names; all dims when None); NaN wins, as in NumPy."""
        return red.max(self, dims)

    @habits.dim_keyword
    def min(self, dims: DimsLike | None = None) -> Tensor:
        """The minimum over `dims` (names; all dims when None); NaN wins, as in NumPy."""
        return red.min(self, dims)

    @habits.dim_keyword
    def prod(self, dims: DimsLike | None = None) -> Tensor:
        """The product over `dims` (names; all dims when None); the reduced dims leave."""
        return red.prod(self, dims)

    @habits.dim_keyword
    def all(self, dims: DimsLike | None = None) -> Tensor:
        """True where every element over `dims` (all dims when None) is true; see nm.all."""
        return red.all(self, dims)

    @habits.dim_keyword
    def any(self, dims: DimsLike | None = None) -> Tensor:
        """True where any element over `dims` (all dims when None) is true; see nm.any."""
        return red.any(self, dims)

    @habits.dim_keyword
    def var(self, dims: DimsLike | None = None, ddof: int = 0) -> Tensor:
        """The variance over `dims` (all when None), divisor count - ddof; see nm.var."""
        return sel.var(self, dims, ddof)

    @habits.dim_keyword
    def std(self, dims: DimsLike | None = None, ddof: int = 0) -> Tensor:
        """The standard deviation over `dims` (all when None); see nm.std."""
        return sel.std(self, dims, ddof)

    def sel(self, *args, **kwargs):
        """No labels to select by: a HabitError naming `isel` (positions by dim name)."""
        habits.by_label(self, "sel")

    @property
    def loc(self):
        """No labels to select by: a HabitError naming `isel`."""
        habits.by_label(self, "loc")

    def to_xarray(self, coords=None, name=None):
        """An xarray.DataArray of the values (copied to NumPy) with these dims."""
        return interop.to_xarray(self, coords=coords, name=name)


def bind_methods() -> None:
    """Set the operators and ops of the tables above and the methods of `Methods` on
    Tensor; the op functions themselves, so `a + b` costs no call more than
    `nm.add(a, b)`."""
    for name, op in OPERATORS.items():
        setattr(Tensor, f"__{name}__", op)
        setattr(Tensor, f"__r{name}__", _reflected(op))
    for name, op in {**COMPARISONS, **UNARY}.items():
        setattr(Tensor, f"__{name}__", op)
    for name, op in OPS.items():
        setattr(Tensor, name, op)
    for name, member in vars(Methods).items():
        if not name.startswith("__"):
            setattr(Tensor, name, member)


bind_methods()
