"""`nm.grad` and `nm.value_and_grad`: jax.grad for losses that return a 0-d Tensor.

`jax.grad` needs a scalar array; a namedmesh loss returns a 0-d Tensor (a pytree whose
leaf is that scalar). These unwrap it, and a loss with dims left is a ShapeError that
says which dims to reduce. Gradients come back as Tensors with the arguments' dims;
lowered functions (`lowering.lower`) compose the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from namedmesh.errors import ShapeError
from namedmesh.tensor import Tensor


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

    return jax.grad(unwrapped, argnums=argnums, has_aux=has_aux)
