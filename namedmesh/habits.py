"""xarray habits on Tensor, where they mean what they mean in xarray: reductions'
`dim=` keyword (a name or a list of names), `a @ b` contracting the dims the two share
(`xarray.dot`), `.values`; and a typed error naming the namedmesh way where a habit
cannot mean the same (`axis=` positions, label-based `.sel`/`.loc` without coordinates).
`transpose("c", ...)` and `.sizes` are Tensor's own."""

from __future__ import annotations

import functools

from namedmesh.einsum import einsum
from namedmesh.errors import ArgumentError, ParameterError
from namedmesh.tensor import Tensor


class HabitError(ArgumentError):
    """An xarray or NumPy habit that cannot mean the same on a Tensor (positions, labels);
    the message names the namedmesh way."""


def dim_keyword(method):
    """A reduction method that also takes xarray's `dim=` (a name or a list of them) and
    refuses `axis=` (positions) with a HabitError naming the dims."""

    @functools.wraps(method)
    def reduce(self, dims=None, *args, dim=None, axis=None, **kwargs):
        name = method.__name__
        if axis is not None:
            raise HabitError(
                f"Tensor.{name}(axis={axis!r}): reductions are by dim name, not position; "
                f"pass dim= one or a list of {self.dims}"
            )
        if dim is not None:
            if dims is not None:
                raise ParameterError(
                    f"Tensor.{name}: dims {dims!r} and dim={dim!r} both given; pass one"
                )
            dims = (dim,) if isinstance(dim, str) else tuple(dim)
        return method(self, dims, *args, **kwargs)

    return reduce


def matmul(a, b):
    """`a @ b`: the einsum of two Tensors summing the dims they share, the others kept in
    the order they first appear (xarray.dot's)."""
    for x in (a, b):
        if not isinstance(x, Tensor):
            raise HabitError(
                f"`@` contracts the dims two Tensors share; got a {type(x).__name__}: "
                "wrap it with nm.tensor(array, dims), or use nm.einsum"
            )
    shared = set(a.dims) & set(b.dims)
    out = tuple(dict.fromkeys(d for d in a.dims + b.dims if d not in shared))
    return einsum(a, b, out=out)


def by_label(x, name: str):
    raise HabitError(
        f"Tensor.{name}: a Tensor has no coordinates to select by label; select by position "
        f"along a named dim with .isel({x.dims[0] if x.dims else 'dim'}=...)"
    )
