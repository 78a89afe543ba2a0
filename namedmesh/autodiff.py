"""`nm.grad` and `nm.value_and_grad`: jax.grad for losses that return a 0-d Tensor.

`jax.grad` needs a scalar array; a namedmesh loss returns a 0-d Tensor (a pytree whose
leaf is that scalar). These unwrap it, and a loss with dims left is a ShapeError that
says which dims to reduce. Gradients come back as Tensors with the arguments' dims;
lowered functions (`lowering.lower`) compose the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from namedmesh.avals import Var
from namedmesh.errors import DtypeError, ShapeError, TracedValueError, fmt_dims
from namedmesh.tensor import Tensor


def _is_tensor(x) -> bool:
    return isinstance(x, Tensor)


def _differentiable(args, argnums, op: str) -> None:
    """DtypeError naming the argument whose leaf is not a float (jax raises a bare
    TypeError that names no argument); TracedValueError for a traced argument (`op` run
    inside nm.trace or lowering.lower, which record named ops only)."""
    for leaf in jax.tree_util.tree_leaves(args, is_leaf=_is_tensor):
        if isinstance(leaf, Tensor) and isinstance(leaf.data, Var):
            raise TracedValueError(
                f"{op}: argument {fmt_dims(leaf.dims, leaf.shape)} is traced (the "
                f"function is being traced by nm.trace or lowered by lowering.lower), "
                f"which records named ops, not gradients. Lower the loss itself and take "
                f"the gradient of the lowered function: jax.grad(lambda *xs: "
                f"lower(loss, mesh, layout)(*xs).data)"
            )
    for n in (argnums,) if isinstance(argnums, int) else tuple(argnums):
        if not -len(args) <= n < len(args):
            continue  # (jax's own error names the position)
        for leaf in jax.tree_util.tree_leaves(args[n], is_leaf=lambda x: isinstance(x, Tensor)):
            dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
            if not jax.dtypes.issubdtype(dtype, np.inexact):
                dims = f" {fmt_dims(leaf.dims, leaf.shape)}" if isinstance(leaf, Tensor) else ""
                raise DtypeError(
                    f"{op}: argument {n}{dims} is {dtype}, which has no gradient; "
                    "differentiate with respect to float arguments only (argnums=)"
                )


def _scalar(out, op: str, has_aux: bool):
    loss, aux = out if has_aux else (out, None)
    if isinstance(loss, Tensor):
        if loss.dims:
            raise ShapeError(
                f"{op}: the function must return a 0-d Tensor, got one with dims "
                f"{loss.dims}; reduce them first, e.g. loss.mean({' '.join(loss.dims)!r})"
            )
        loss = loss.data
    return (loss, aux) if has_aux else loss


def value_and_grad(
    fn: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable:
    """`fn`'s value (a 0-d Tensor) and its gradient with respect to the arguments at
    `argnums` (Tensors, or pytrees of them, with the arguments' dims), as
    `jax.value_and_grad`; with `has_aux`, `fn` returns (loss, aux) and the value is
    (loss, aux)."""

    def unwrapped(*args):
        return _scalar(fn(*args), "nm.value_and_grad", has_aux)

    vg = jax.value_and_grad(unwrapped, argnums=argnums, has_aux=has_aux)

    def run(*args):
        _differentiable(args, argnums, "nm.value_and_grad")
        value, grads = vg(*args)
        if has_aux:
            return (Tensor._make(value[0], ()), value[1]), grads
        return Tensor._make(value, ()), grads

    return run


def grad(fn: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """The gradient of `fn`, a function returning a 0-d Tensor, with respect to the
    arguments at `argnums`, as `jax.grad`: Tensors with the arguments' dims. A loss with
    dims left is a ShapeError naming them."""

    def unwrapped(*args):
        return _scalar(fn(*args), "nm.grad", has_aux)

    g = jax.grad(unwrapped, argnums=argnums, has_aux=has_aux)

    def run(*args):
        _differentiable(args, argnums, "nm.grad")
        return g(*args)

    return run
