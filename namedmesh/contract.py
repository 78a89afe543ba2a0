"""The two-operand einsum as one `jax.lax.dot_general`, in the operand order XLA:CPU runs
fastest, with a reverse-mode rule that writes each operand's gradient the same way.

XLA:CPU multiplies [batch, M, K] x [batch, K, N] (the right operand's K and N in either
order); a left operand whose summed dims are not its last ones is copied transposed
first, and so is a result whose dims the einsum wants in another order. jax's own
gradient of a dot_general is a dot_general of the cotangent and the other operand
followed by a transpose, which XLA:CPU runs with a transposed copy of the larger
operand: a weight's gradient `x[t, i], g[t, o] -> w[i, o]` came out as g copied to
[o, t] and a dot at half the speed of `x.T @ g` (the step's largest matmul, the output
projection's, took twice its forward time). Here every contraction, a gradient's too,
takes the operand order whose transposed copies move the fewest bytes
(`left_first`); on CPU a result wanted in another order is transposed after an
optimization barrier, since XLA:CPU would fold that transpose into the dot in the
refused order.

A custom vjp has no forward mode: inside `jax_gradients()` (a context for tracing)
einsums, and dot_product_attention's "auto" kernel, are left to jax's own rules, for
`jax.jvp`, `jax.jacfwd` and `jax.hessian`.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp

from namedmesh import dot_layout

_JAX_RULES = threading.local()


@contextlib.contextmanager
def jax_gradients():
    """Within this context (while a program is traced: jax.jit caches what it traced
    before), namedmesh's ops are differentiated by jax's own rules, forward mode
    included, not by the custom vjps that make reverse mode fast on XLA:CPU:

        with nm.jax_gradients():
            h = jax.hessian(loss)(w)
    """
    before = getattr(_JAX_RULES, "on", False)
    _JAX_RULES.on = True
    try:
        yield
    finally:
        _JAX_RULES.on = before


def custom_gradients() -> bool:
    """Whether ops may use their custom vjps now (not inside `jax_gradients()`)."""
    return not getattr(_JAX_RULES, "on", False)


def varying_axes(x) -> set[str]:
    """The mesh axes over which shard_map types `x` as varying (its `vma`; none outside
    shard_map)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:  # jax 0.10 keeps it in the aval's manual axis type
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
    return set(vma)


def _copied(lhs, rhs, out, sizes) -> int:
    """Elements copied to run `lhs x rhs -> out` (dims tuples) as one dot_general with
    `lhs` on the left (`namedmesh.dot_layout.plan`: operands read in place wherever
    their dims group as a canonical dot's)."""
    return dot_layout.plan(lhs, rhs, out, tuple(sorted(sizes.items()))).copied


@functools.lru_cache(maxsize=4096)
def left_first(a_dims, b_dims, out, sizes) -> bool:
    """Whether operand a goes on the left of the dot_general: unless b there copies
    fewer elements (ties keep the einsum's order)."""
    sizes = dict(sizes)
    return _copied(a_dims, b_dims, out, sizes) <= _copied(b_dims, a_dims, out, sizes)


def _natural(lhs, rhs, keep) -> tuple:
    """The dims `keep` of `lhs x rhs` in the order one dot_general writes them: batch
    (in lhs's order), then lhs's free dims, then rhs's."""
    batch = [d for d in lhs if d in rhs and d in keep]
    return (*batch, *(d for d in lhs if d not in rhs), *(d for d in rhs if d not in lhs))


@functools.lru_cache(maxsize=4096)
def dot_order(a_dims, b_dims, keep, sizes) -> tuple:
    """The dims `keep` of `a x b` in the order XLA:CPU's dot writes them, the operands
    in the order that copies the fewest elements: a result in this order needs no
    transposed copy (`_dot`'s optimization barrier and transpose). Ties keep a on the
    left, as `left_first` does, so `left_first` picks the same operand order for it."""
    sizes = dict(sizes)
    a_dims = tuple(d for d in a_dims if d in b_dims or d in keep)
    b_dims = tuple(d for d in b_dims if d in a_dims or d in keep)
    ab, ba = _natural(a_dims, b_dims, keep), _natural(b_dims, a_dims, keep)
    if _copied(b_dims, a_dims, ba, sizes) < _copied(a_dims, b_dims, ab, sizes):
        return ba
    return ab


def _sizes(a, b, a_dims, b_dims) -> tuple:
    return tuple(sorted(dict(zip(a_dims + b_dims, a.shape + b.shape, strict=True)).items()))


def _read_order(a_dims, b_dims, out, sizes) -> tuple[tuple, tuple]:
    """The dims of a and of b in the order the dot of `a x b -> out` reads them: their
    own, unless its plan copies one transposed (`namedmesh.dot_layout.plan`)."""
    if left_first(a_dims, b_dims, out, sizes):
        p = dot_layout.plan(a_dims, b_dims, out, sizes)
        return p.lhs, p.rhs
    p = dot_layout.plan(b_dims, a_dims, out, sizes)
    return p.rhs, p.lhs


def _dot(a, b, a_dims, b_dims, out, precision):
    """`a x b -> out` as one dot_general (every dim of a and b is in the other or in
    `out`), the operands in `left_first`'s order, then transposed to `out`."""
    sizes = _sizes(a, b, a_dims, b_dims)
    if not left_first(a_dims, b_dims, out, sizes):
        a, b, a_dims, b_dims = b, a, b_dims, a_dims
    plan = dot_layout.plan(a_dims, b_dims, out, sizes)
    y = dot_layout.dot(a, b, a_dims, b_dims, plan, dict(sizes), precision)
    perm = tuple(plan.result.index(d) for d in out)
    if perm == tuple(range(len(perm))):
        return y
    if jax.default_backend() == "cpu":
        # else XLA:CPU folds the transpose back into the dot, in the order `left_first`
        # refused (a tied embedding's [vocab, d] gradient: 33 ms, 25 ms with the barrier);
        # GPU and TPU dots read transposed operands in place, so there it may fold
        y = jax.lax.optimization_barrier(y)
    return jnp.transpose(y, perm)


def contract(a, b, a_dims, b_dims, out, precision=None):
    """`a x b -> out` by dim names (tuples): one dot_general in XLA:CPU's fastest operand
    order, its gradients the same. a and b have one floating dtype, and every dim of
    each is in the other or in `out` (sum one-sided dims first). Inside shard_map an
    operand invariant over a mesh axis the other varies over is cast varying first, as
    dot_general does, so that its gradient is summed over that axis (the cast's
    transpose, a psum)."""
    va, vb = varying_axes(a), varying_axes(b)
    if va != vb:
        a = jax.lax.pcast(a, tuple(sorted(vb - va)), to="varying") if vb - va else a
        b = jax.lax.pcast(b, tuple(sorted(va - vb)), to="varying") if va - vb else b
    return _contract(a, b, a_dims, b_dims, out, precision, _sizes(a, b, a_dims, b_dims))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _contract(a, b, a_dims, b_dims, out, precision, sizes):
    return _dot(a, b, a_dims, b_dims, out, precision)


def _forward(a, b, a_dims, b_dims, out, precision, sizes):
    # the operands saved as the dot read them: one it copied transposed is not copied
    # again for the gradients' dots (attention's rotated queries and keys, heads first)
    read_a, read_b = _read_order(a_dims, b_dims, out, sizes)
    a, b = dot_layout.transposed(a, a_dims, read_a), dot_layout.transposed(b, b_dims, read_b)
    return _dot(a, b, read_a, read_b, out, precision), (a, b)


def _backward(a_dims, b_dims, out, precision, sizes, saved, g):
    a, b = saved
    read_a, read_b = _read_order(a_dims, b_dims, out, sizes)
    return (
        _contract(g, b, out, read_b, a_dims, precision, sizes),
        _contract(a, g, read_a, out, b_dims, precision, sizes),
    )


_contract.defvjp(_forward, _backward)
