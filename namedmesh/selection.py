"""xarray's habits by name: `isel` (select or slice by name), `squeeze`, `expand_dims`,
`var` and `std`.

`squeeze`, `expand_dims`, `var` and `std` are primitives (their SPMD rules are in
lowering/rules/structural.py and reductions.py). `isel` is `slice` (and `squeeze` for
an integer index) by name, so that it lowers by their rules, halo exchange included.
"""

from __future__ import annotations

import builtins
import math
import operator
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from namedmesh.checks import integer, names_not_positions, require_dims
from namedmesh.eager import remembered
from namedmesh.errors import ShapeError
from namedmesh.primitive import Aval, bind, float_result, primitive, zero_flops_cost
from namedmesh.reductions import axes_of, normalization_cost, wide_accumulation
from namedmesh.structural import slice_
from namedmesh.tensor import DimsLike, Tensor, parse_dims


# --- squeeze / expand_dims ---------------------------------------------------------------
def _squeeze_rule(x, axes):
    keep = [i for i in range(len(x.dims)) if i not in axes]
    return Aval(tuple(x.dims[i] for i in keep), tuple(x.shape[i] for i in keep), x.dtype)


_squeeze = primitive(
    "squeeze",
    _squeeze_rule,
    lambda x, axes: np.squeeze(x, axis=axes),
    lambda x, axes: jnp.squeeze(x, axis=axes),
    cost_rule=lambda i, o, p: zero_flops_cost(i, o, p)._replace(bytes=0),
    backward_reads="nothing",
    numpy_kernel=lambda axes: operator.methodcaller("squeeze", axes),  # np.squeeze's call
)


@remembered
def squeeze(x: Tensor, dims: DimsLike | None = None) -> Tensor:
    """`x` without the dims `dims`, each of size 1 (default: every dim of size 1), as
    xarray's `squeeze`; ShapeError naming a dim whose size is not 1."""
    if dims is None:
        axes = tuple(i for i, n in enumerate(x.shape) if n == 1)
    else:
        axes = axes_of(x, dims, "squeeze")
    wide = [f"{x.dims[i]}: {x.shape[i]}" for i in axes if x.shape[i] != 1]
    if wide:
        raise ShapeError(f"squeeze: dim(s) {wide} of {x.dims} have a size other than 1")
    return bind(_squeeze, x, axes=axes) if axes else x


def _expand_rule(x, new):
    return Aval(
        tuple(d for d, _ in new) + x.dims, tuple(n for _, n in new) + tuple(x.shape), x.dtype
    )


def _expand(xp):
    def impl(x, new):
        shape = tuple(n for _, n in new) + tuple(x.shape)
        return xp.broadcast_to(xp.reshape(x, (1,) * len(new) + tuple(x.shape)), shape)

    return impl


_expand_dims = primitive(
    "expand_dims",
    _expand_rule,
    lambda x, new: np.ascontiguousarray(_expand(np)(x, new)),
    _expand(jnp),
    cost_rule=zero_flops_cost,
    backward_reads="nothing",
)


@remembered
def expand_dims(x: Tensor, dims: str | DimsLike | Mapping[str, int]) -> Tensor:
    """`x` with new leading dims, as xarray's `expand_dims`: names (size 1) or a mapping
    name -> size, along which the values repeat. ShapeError for a name `x` has."""
    if isinstance(dims, Mapping):
        names_not_positions(tuple(dims), "expand_dims")
        size = lambda d, n: integer("expand_dims", f"the size of {d!r}", n, 0)
        new = tuple((d, size(d, n)) for d, n in dims.items())
    else:
        new = tuple((d, 1) for d in parse_dims(dims, "expand_dims"))
    parse_dims(tuple(d for d, _ in new), "expand_dims")
    clash = [d for d, _ in new if d in x.dims]
    if clash:
        raise ShapeError(f"expand_dims: new dim(s) {clash} are already dims of {x.dims}")
    bad = [(d, n) for d, n in new if n < 0]
    if bad:
        raise ShapeError(f"expand_dims: sizes must be >= 0, got {bad}")
    return bind(_expand_dims, x, new=new) if new else x


# --- var / std --------------------------------------------------------------------------
def _moment_rule(x, axes, ddof):
    keep = [i for i in range(len(x.dims)) if i not in axes]
    dt = float_result(x.dtype)  # (bfloat16's kind is "V": var of bfloat16 is bfloat16)
    return Aval(tuple(x.dims[i] for i in keep), tuple(x.shape[i] for i in keep), dt)


def _moment_jax(jnp_fn):
    """jnp.var or jnp.std with NumPy's divisor max(count - ddof, 0) where ddof is at least
    the count (jax gives NaN there: NumPy and the lowering inf, NaN for 0 / 0)."""

    def run(x, axes, ddof):
        count = math.prod(x.shape[a] for a in axes)
        if ddof < count:
            return jnp_fn(x, axis=axes, ddof=ddof)
        var = jnp.var(x, axis=axes) * count  # (the sum of squared deviations)
        out = var / jnp.zeros((), var.dtype)
        return out if jnp_fn is jnp.var else jnp.sqrt(out)

    return run


def _moment(name: str):
    """The primitive of np.var or np.std (same name in NumPy and jax.numpy)."""
    np_fn, jnp_fn = getattr(np, name), getattr(jnp, name)
    return primitive(
        name,
        _moment_rule,
        wide_accumulation(lambda x, axes, ddof: np_fn(x, axis=axes, ddof=ddof)),
        _moment_jax(jnp_fn),
        cost_rule=normalization_cost,  # a mean, then a subtract, square and sum
        float_valued=True,
    )


_var = _moment("var")
_std = _moment("std")


@remembered
def var(x: Tensor, dims: DimsLike | None = None, ddof: int = 0) -> Tensor:
    """The variance over `dims` (all dims when None), with `ddof` delta degrees of
    freedom (divisor: count - ddof), as xarray and NumPy; the reduced dims leave."""
    return bind(_var, x, axes=axes_of(x, dims, "var"), ddof=integer("var", "ddof", ddof, 0))


@remembered
def std(x: Tensor, dims: DimsLike | None = None, ddof: int = 0) -> Tensor:
    """The standard deviation over `dims` (all dims when None), sqrt(var(x, dims, ddof))."""
    return bind(_std, x, axes=axes_of(x, dims, "std"), ddof=integer("std", "ddof", ddof, 0))


# --- isel ---------------------------------------------------------------------------------
@remembered
def isel(x: Tensor, indexers: Mapping[str, int | builtins.slice] | None = None, **kw) -> Tensor:
    """Select by dim name, as xarray's `isel`: `isel(x, batch=0)` drops `batch` (an int,
    negative from the end), `isel(x, d=slice(1, 3))` keeps it (a slice with a positive
    step). ShapeError for an unknown dim (with the closest name) or an index out of
    range."""
    indexers = {**(indexers or {}), **kw}
    names_not_positions(tuple(indexers), "isel", x.dims)
    require_dims("isel", indexers, x.dims)
    drop = []
    for d, i in indexers.items():
        if isinstance(i, builtins.slice):
            x = slice_(x, d, i.start, i.stop, 1 if i.step is None else i.step)
        elif isinstance(i, int | np.integer) and not isinstance(i, bool):
            n = x.size_of(d)
            if not -n <= int(i) < n:
                raise ShapeError(f"isel: index {int(i)} is out of range for dim {d!r} of size {n}")
            k = int(i) % n
            x = slice_(x, d, k, k + 1)
            drop.append(d)
        else:
            raise ShapeError(
                f"isel: index for dim {d!r} must be an int or a slice, got {i!r} (use "
                "nm.gather(t, dim, indices) to select by a Tensor of indices)"
            )
    return squeeze(x, tuple(drop)) if drop else x


# How the property strategies' random programs apply these (Primitive.example)
def _expanded(a, b, d, k):
    """A dim of b that a lacks (so a layout may split it), else a new one squeezed away."""
    new = next((e for e in b.dims if e not in a.dims), None)
    if new is None:
        return squeeze(expand_dims(a * 0.5, "unit"), "unit")
    return expand_dims(a * 0.5, {new: b.size_of(new)}) * b


def _moments(op):
    def example(a, b, d, k):
        red = [x for m, x in enumerate(a.dims) if (k >> m) & 1] or [d]
        many = np.prod([a.size_of(x) for x in red]) > 1
        return op(a, red, ddof=k // 8 % 2 if many else 0)

    return example


_squeeze.example = lambda a, b, d, k: squeeze(expand_dims(a * 0.5, "unit"), "unit")
_expand_dims.example = _expanded
_var.example = _moments(var)
_std.example = _moments(std)
