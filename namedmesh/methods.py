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
from namedmesh import habits, interop, rounding
from namedmesh import reductions as red
from namedmesh import selection as sel
from namedmesh import structural as st
from namedmesh.tensor import Tensor

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
# Python's round(t, n) (a Tensor, as NumPy's round(array, n) is an array)
DUNDER = {"round": lambda t, ndigits=None: rounding.round(t, ndigits or 0)}
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
    "round": rounding.round,  # t.round(decimals), as NumPy's arrays
}
# `t.sum("d")`, and xarray's `t.sum(dim="d")` (a HabitError for NumPy's `axis=`)
REDUCTIONS = {
    "sum": red.sum,
    "mean": red.mean,
    "max": red.max,
    "min": red.min,
    "prod": red.prod,
    "all": red.all,
    "any": red.any,
    "var": sel.var,
    "std": sel.std,
}


def _reflected(op):
    def method(self, other):
        return op(other, self)

    return method


class Methods:
    """The named methods of Tensor, each the op of its name; bound onto Tensor by name."""

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
    for name, op in {**COMPARISONS, **UNARY, **DUNDER}.items():
        setattr(Tensor, f"__{name}__", op)
    for name, op in OPS.items():
        setattr(Tensor, name, op)
    for name, op in REDUCTIONS.items():
        setattr(Tensor, name, habits.dim_keyword(op))
    for name, member in vars(Methods).items():
        if not name.startswith("__"):
            setattr(Tensor, name, member)


bind_methods()
