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
import math
import threading

import jax
import jax.numpy as jnp

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
    """Elements XLA:CPU copies to run `lhs x rhs -> out` (dims tuples) as one dot_general
    with `lhs` on the left: the left operand unless its dims run batch, free, summed;
    the right unless they run batch then summed and free in either order; the result
    unless batch, left free, right free is its order."""
    batch = [d for d in lhs if d in rhs and d in out]
    summed = [d for d in lhs if d in rhs and d not in out]
    l_free = [d for d in lhs if d not in rhs]
    r_free = [d for d in rhs if d not in lhs]
    size = lambda dims: math.prod(sizes[d] for d in dims)
    n = 0
    if list(lhs) != batch + l_free + summed:
        n += size(lhs)
    if list(rhs) not in (batch + summed + r_free, batch + r_free + summed):
        n += size(rhs)
    if list(out) != batch + l_free + r_free:
        n += size(out)
    return n


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


def _run(dims, names) -> tuple[int, int] | None:
    """(first, last + 1) of `names`' positions in `dims` when they are adjacent there in
    this order, else None."""
    at = [dims.index(d) for d in names]
    return (at[0], at[-1] + 1) if at == list(range(at[0], at[0] + len(at))) else None


# The largest free size of a left operand that XLA:CPU's dot runs faster read summed
# dim first ([K, M]) than summed dim last ([M, K]): measured 119-141 GFLOP/s against 57
# at M = 64, about equal at 512, 0.6-0.8x at 2048 (docs/benchmarks.md, "Dot rates per
# shape").
SUMMED_FIRST_MAX = 512


def _summed_together(x, dims, summed, free, left: bool):
    """(x, its dims) transposed to batch dims (those neither summed nor `free`), then
    `summed` together in this order and `free`: summed first for the right operand or a
    left one of free size <= SUMMED_FIRST_MAX, else last. On CPU behind an optimization
    barrier, or XLA folds the transpose back into the dot, where several summed dims
    make it copy in its own order."""
    free = [d for d in dims if d in free]
    batch = [d for d in dims if d not in summed and d not in free]
    free_size = math.prod(x.shape[dims.index(d)] for d in free)
    first = not left or free_size <= SUMMED_FIRST_MAX
    order = batch + (list(summed) + free if first else free + list(summed))
    x = jnp.transpose(x, [dims.index(d) for d in order])
    if jax.default_backend() == "cpu":
        x = jax.lax.optimization_barrier(x)
    return x, tuple(order)


def _one_summed_dim(a, b, a_dims, b_dims, summed):
    """(a, b, a_dims, b_dims, summed) with the summed dims merged into one (a reshape, no
    copy) where they are adjacent and in the same order in both operands; where they
    are in one operand and not the other, the other is transposed first (a copy XLA
    would make anyway, in the order that runs faster: `_summed_together`).

    XLA:CPU runs a dot of several contracting dims as a transposed copy of each operand
    to [batch, free, contracting] and a dot of that, but one contracting dim in place,
    wherever it is: a weight's gradient x[b, t, i] * g[b, t, o] -> [i, o] measured 137
    GFLOP/s summed over (b, t) and 159 over b*t, attention's key gradient summed over
    (query group, length) 75 and 125 (docs/benchmarks.md, "Dot rates per shape")."""
    if len(summed) < 2:
        return a, b, a_dims, b_dims, summed
    if _run(a_dims, summed) and not _run(b_dims, summed):
        free = [d for d in b_dims if d not in a_dims]
        b, b_dims = _summed_together(b, b_dims, summed, free, left=False)
    elif not _run(a_dims, summed) and _run(b_dims, in_b := [d for d in b_dims if d in summed]):
        summed = in_b
        free = [d for d in a_dims if d not in b_dims]
        a, a_dims = _summed_together(a, a_dims, summed, free, left=True)
    if not (ra := _run(a_dims, summed)) or not (rb := _run(b_dims, summed)):
        return a, b, a_dims, b_dims, summed
    merged = tuple(summed)  # a tuple, never equal to a dim's name (a str)
    size = math.prod(a.shape[ra[0] : ra[1]])
    a = a.reshape(a.shape[: ra[0]] + (size,) + a.shape[ra[1] :])
    b = b.reshape(b.shape[: rb[0]] + (size,) + b.shape[rb[1] :])
    a_dims = a_dims[: ra[0]] + (merged,) + a_dims[ra[1] :]
    b_dims = b_dims[: rb[0]] + (merged,) + b_dims[rb[1] :]
    return a, b, a_dims, b_dims, [merged]


def _dot(a, b, a_dims, b_dims, out, precision):
    """`a x b -> out` as one dot_general (every dim of a and b is in the other or in
    `out`), the operands in `left_first`'s order, then transposed to `out`."""
    sizes = tuple(sorted(dict(zip(a_dims + b_dims, a.shape + b.shape, strict=True)).items()))
    if not left_first(a_dims, b_dims, out, sizes):
        a, b, a_dims, b_dims = b, a, b_dims, a_dims
    summed = [d for d in a_dims if d in b_dims and d not in out]
    a, b, a_dims, b_dims, summed = _one_summed_dim(a, b, a_dims, b_dims, summed)
    batch = [d for d in a_dims if d in b_dims and d in out]
    numbers = (
        ([a_dims.index(d) for d in summed], [b_dims.index(d) for d in summed]),
        ([a_dims.index(d) for d in batch], [b_dims.index(d) for d in batch]),
    )
    y = jax.lax.dot_general(a, b, numbers, precision=precision)
    got = batch + [d for d in a_dims if d not in b_dims] + [d for d in b_dims if d not in a_dims]
    perm = tuple(got.index(d) for d in out)
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
    return _contract(a, b, a_dims, b_dims, out, precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _contract(a, b, a_dims, b_dims, out, precision=None):
    return _dot(a, b, a_dims, b_dims, out, precision)


def _forward(a, b, a_dims, b_dims, out, precision):
    return _dot(a, b, a_dims, b_dims, out, precision), (a, b)


def _backward(a_dims, b_dims, out, precision, saved, g):
    a, b = saved
    return (
        _contract(g, b, out, b_dims, a_dims, precision),
        _contract(a, g, a_dims, out, b_dims, precision),
    )


_contract.defvjp(_forward, _backward)
