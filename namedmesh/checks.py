"""The checks every op makes on its arguments, in one place, as xarray does: dims given
as names (not positions), dims the tensor has, and sizes that agree between operands.
Each message names the op, the dims at fault and, for an unknown name, the closest
known one ("did you mean")."""

from __future__ import annotations

import difflib
import functools
import inspect
import os
import warnings
from collections.abc import Iterable, Sequence

import numpy as np

from namedmesh.errors import ArgumentError, DtypeError, ShapeError, fmt_dims


def integer(op: str, what: str, value, low: int | None = None) -> int:
    """`value` as an int: an int or NumPy integer (as NumPy reads sizes and indices),
    never a float cut to its integer part nor a bool; ArgumentError naming `what` of
    `op` otherwise, ShapeError below `low`."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ArgumentError(f"{op}: {what} must be an int, got {value!r}")
    if low is not None and value < low:
        raise ShapeError(f"{op}: {what} must be >= {low}, got {int(value)}")
    return int(value)


def fits_dtype(op: str, what: str, value, dtype, whose: str = "") -> None:
    """DtypeError when `value`, an int or float, is outside the integer `dtype`'s range
    once truncated, or NaN (NumPy and jax raise a bare OverflowError, or fill in the
    dtype's minimum). A float in range is truncated toward 0, as NumPy converts it.
    `whose` says where the dtype is from."""
    dt = np.dtype(dtype)
    if dt.kind not in "iu" or isinstance(value, bool | np.bool_):
        return
    if not isinstance(value, int | float | np.integer | np.floating):
        return  # (a Tensor or array value is the op's to check)
    info = np.iinfo(dt)
    finite = not isinstance(value, float | np.floating) or bool(np.isfinite(value))
    if not finite or not info.min <= int(value) <= info.max:  # (int(): toward 0)
        raise DtypeError(
            f"{op}: {what} {value} does not fit {dt.name}{whose} (from {info.min} to "
            f"{info.max}); use a wider dtype (astype) or a value in range"
        )


def require_arity(op: str, fn, n: int) -> None:
    """An ArgumentError naming `op` and `fn` when `fn` cannot be called with `n`
    positional arguments (a program traced or lowered with an input too many or too
    few), before it runs; nothing for a callable without a signature."""
    try:
        sig = inspect.signature(fn, follow_wrapped=False)  # a wrapper's own, as it is called
    except (TypeError, ValueError):  # a builtin or C callable
        return
    try:
        sig.bind(*range(n))
    except TypeError as e:
        name = getattr(fn, "__name__", repr(fn))
        raise ArgumentError(f"{op}: {name}{sig} was given {n} input(s): {e}") from None


def boolean(op: str, what: str, value) -> bool:
    """`value` as a bool: True or False (NumPy's too), never a truthy 1, "yes" or None;
    ArgumentError naming `what` of `op` otherwise."""
    if not isinstance(value, bool | np.bool_):
        raise ArgumentError(f"{op}: {what} must be True or False, got {value!r}")
    return bool(value)


class DimNameWarning(UserWarning):
    """A broadcast that adds a dim whose name is one letter or two away from a dim the
    other operand has: most often a typo ("class" for "classes")."""


def closest(name: str, options: Iterable[str]) -> str | None:
    """The option most like `name` (difflib's ratio >= 0.6), or None."""
    found = difflib.get_close_matches(str(name), [str(o) for o in options], n=1)
    return found[0] if found else None


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """`"; did you mean 'x'?"` for the closest option to `name`, or `""`."""
    best = closest(name, options)
    return f"; did you mean {best!r}?" if best is not None else ""


def _is_position(d) -> bool:
    return isinstance(d, int | np.integer) and not isinstance(d, bool)


def names_not_positions(dims, op: str, have: Sequence[str] | None = None) -> None:
    """ShapeError when `dims` (one dim or a sequence) holds an int where a name is
    expected: namedmesh selects axes by name only. With `have` (the tensor's dims), the
    message suggests the name at that position."""
    items = dims if isinstance(dims, list | tuple) else [dims]
    for d in items:
        if _is_position(d):
            hint = ""
            if have is not None and -len(have) <= int(d) < len(have):
                hint = f"; the dim at position {int(d)} is {have[int(d)]!r}: pass that name"
            shown = "" if have is None else f" of the tensor {fmt_dims(have)}"
            raise ShapeError(
                f"{op}: dims are selected by name, not by position; got {d!r}{shown}{hint}"
            )
    if dims is not None and not isinstance(dims, str | list | tuple) and not _iterable(dims):
        raise ShapeError(f"{op}: expected a dim name or a sequence of names, got {dims!r}")


def _iterable(x) -> bool:
    try:
        iter(x)
    except TypeError:
        return False
    return True


def require_dims(
    op: str, names: Iterable[str], have: Sequence[str], what: str = "the tensor"
) -> None:
    """ShapeError when any of `names` is not among `have`, naming the op, the dims and
    the closest name."""
    missing = [d for d in names if d not in have]
    if missing:
        raise ShapeError(
            f"{op}: dim(s) {missing} not in {what}'s dims {tuple(have)}"
            + did_you_mean(missing[0], have)
        )


def agreed_sizes(op: str, operands: Sequence, labels: Sequence[str] | None = None) -> dict:
    """dim -> size over all `operands` (objects with .dims and .shape); ShapeError when a
    dim has two sizes, naming both operands."""
    labels = labels or [f"operand {i}" for i in range(len(operands))]
    sizes: dict[str, int] = {}
    where: dict[str, int] = {}
    for i, x in enumerate(operands):
        for d, s in zip(x.dims, x.shape, strict=True):
            if sizes.setdefault(d, s) != s:
                j = where[d]
                raise ShapeError(
                    f"{op}: dim {d!r} has size {sizes[d]} in {labels[j]} "
                    f"{fmt_dims(operands[j].dims, operands[j].shape)} but {s} in {labels[i]} "
                    f"{fmt_dims(x.dims, x.shape)}"
                )
            where.setdefault(d, i)
    return sizes


# How many near-miss warnings were given: an op whose call gave one is not remembered
# (namedmesh/eager.py), so that every such call warns
NEAR_MISSES_WARNED = [0]


def warn_near_misses(op: str, operands: Sequence) -> None:
    """A DimNameWarning when broadcasting adds to one operand a dim that is not in the
    others but is a near-miss of one of theirs (difflib ratio >= 0.8: "class" and
    "classes", "bacth" and "batch"). Broadcasting by name is what xarray does and is
    kept (a refusal would break every legitimate outer broadcast); a near-miss is
    almost always a typo, so it is flagged where it is made."""
    if len(operands) < 2:
        return
    for i, d, near in _near_misses(tuple(tuple(x.dims) for x in operands)):
        NEAR_MISSES_WARNED[0] += 1
        warnings.warn(
            f"{op}: dim {d!r} of operand {i} {fmt_dims(operands[i].dims)} is in no other "
            f"operand and is broadcast as a new dim; did you mean {near!r}?",
            DimNameWarning,
            stacklevel=_user_stacklevel(),  # shown at the user's line
        )


def _user_stacklevel() -> int:
    """The stacklevel of the first caller outside the namedmesh package."""
    frame, level = inspect.currentframe(), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level - 1


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=4096)
def _near_misses(dims: tuple[tuple[str, ...], ...]) -> tuple:
    """(operand, dim, near name) per near-miss pair, each pair once."""
    found = []
    pairs = set()
    for i, own in reversed(list(enumerate(dims))):  # the later operand brings the new dim
        others = {d for j, o in enumerate(dims) if j != i for d in o} - set(own)
        for d in own:
            if any(d in o for j, o in enumerate(dims) if j != i):
                continue
            near = difflib.get_close_matches(d, sorted(others), 1, 0.8)
            if near and frozenset((d, near[0])) not in pairs:
                pairs.add(frozenset((d, near[0])))
                found.append((i, d, near[0]))
    return tuple(found)


def require_nonempty(op: str, x, axes: Iterable[int]) -> None:
    """ShapeError when `op`, a reduction with no identity (max, min, argmax, argmin),
    reduces `x` over a dim of size 0: NumPy and jax raise a bare ValueError there."""
    empty = [x.dims[a] for a in axes if x.shape[a] == 0]
    if empty:
        raise ShapeError(
            f"{op}: dim {empty[0]!r} of the tensor {fmt_dims(x.dims, x.shape)} has size 0, "
            f"and {op} over no elements has no value"
        )


def axis_of(x, dim: str, op: str) -> int:
    """The position of the one dim `dim` in `x` (an object with .dims); ShapeError for a
    position, several names, or a dim `x` lacks (with the closest name)."""
    names_not_positions(dim, op, x.dims)
    if not isinstance(dim, str) or " " in dim:
        raise ShapeError(f"{op}: takes one dim name, got {dim!r}")
    require_dims(op, [dim], x.dims)
    return x.dims.index(dim)
