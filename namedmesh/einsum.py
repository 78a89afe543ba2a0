"""`einsum`: every contraction, by dim name.

Dims shared by operands and absent from `out` are summed. `out` fixes the result's
dims and their order; when it is None the result keeps the dims that occur in
exactly one operand, in order of first occurrence. Three or more operands are
contracted pairwise in the order opt_einsum finds, each pair one `einsum`
equation, so the lowering only ever sees one- and two-operand einsums.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import opt_einsum

from namedmesh.checks import agreed_sizes, did_you_mean
from namedmesh.contract import contract, custom_gradients, dot_order
from namedmesh.eager import remembered
from namedmesh.errors import ArgumentError, DtypeError, ParameterError, ShapeError, fmt_dims
from namedmesh.primitive import Aval, Cost, bind, primitive, result_dtype
from namedmesh.tensor import DimsLike, Tensor, parse_dims


def _sizes(operands) -> dict[str, int]:
    return agreed_sizes("einsum", operands)


def output_dims(in_dims: tuple[tuple[str, ...], ...], out: DimsLike | None) -> tuple[str, ...]:
    """The result dims of an einsum of operands with `in_dims`."""
    if out is not None:
        out = parse_dims(out, "einsum out")
        known = {d for dims in in_dims for d in dims}
        missing = [d for d in out if d not in known]
        if missing:
            raise ShapeError(
                f"einsum: out dim(s) {missing} are in no operand; operands have "
                + ", ".join(fmt_dims(d) for d in in_dims)
                + did_you_mean(missing[0], sorted(known - set(out)) or sorted(known))
            )
        return out
    counts: dict[str, int] = {}
    for dims in in_dims:
        for d in dims:
            counts[d] = counts.get(d, 0) + 1
    return tuple(d for d, c in counts.items() if c == 1)


def _einsum_rule(*xs, out, in_dims, preferred=None, precision=None):
    sizes = _sizes(xs)
    dtype = result_dtype(*(x.dtype for x in xs)) if preferred is None else preferred
    return Aval(out, tuple(sizes[d] for d in out), dtype)


@functools.lru_cache(maxsize=4096)
def spec(in_dims: tuple[tuple[str, ...], ...], out: tuple[str, ...]) -> str:
    """The positional einsum string, `"ab,bc->ac"`, for named dims."""
    letters: dict[str, str] = {}
    for dims in (*in_dims, out):
        for d in dims:
            letters.setdefault(d, opt_einsum.get_symbol(len(letters)))
    sub = lambda dims: "".join(letters[d] for d in dims)
    return ",".join(sub(d) for d in in_dims) + "->" + sub(out)


class _MatmulPlan(NamedTuple):
    """How a two-operand einsum runs as one batched `np.matmul`: sum the dims only one
    operand has, transpose each to (batch, free, contracted), reshape to 3-d, multiply,
    and reshape and transpose back. None or False marks a step that would not change the
    array, so a plain matrix product is the matmul alone."""

    a_sum: tuple[int, ...]
    b_sum: tuple[int, ...]
    a_perm: tuple[int, ...] | None
    b_perm: tuple[int, ...] | None
    n_batch: int
    n_a_free: int
    n_b_free: int
    reshape_in: bool  # some group (free or contracted) is not exactly one dim
    out_perm: tuple[int, ...] | None
    plain: bool  # no step but the matmul


def _unless_identity(perm: tuple[int, ...]) -> tuple[int, ...] | None:
    return None if perm == tuple(range(len(perm))) else perm


@functools.lru_cache(maxsize=4096)
def _matmul_plan(a_dims, b_dims, out) -> _MatmulPlan:
    """The `_MatmulPlan` of an einsum of operands with dims `a_dims`, `b_dims` to `out`."""
    batch = tuple(d for d in a_dims if d in b_dims and d in out)
    contract = tuple(d for d in a_dims if d in b_dims and d not in out)
    a_free = tuple(d for d in a_dims if d not in b_dims and d in out)
    b_free = tuple(d for d in b_dims if d not in a_dims and d in out)
    a_sum = tuple(i for i, d in enumerate(a_dims) if d not in b_dims and d not in out)
    b_sum = tuple(i for i, d in enumerate(b_dims) if d not in a_dims and d not in out)
    a_left = tuple(d for i, d in enumerate(a_dims) if i not in a_sum)
    b_left = tuple(d for i, d in enumerate(b_dims) if i not in b_sum)
    a_perm = tuple(a_left.index(d) for d in batch + a_free + contract)
    b_perm = tuple(b_left.index(d) for d in batch + contract + b_free)
    mm_dims = batch + a_free + b_free
    out_perm = tuple(mm_dims.index(d) for d in out)
    reshape = not (len(a_free) == len(b_free) == len(contract) == 1)
    a_perm, b_perm, out_perm = map(_unless_identity, (a_perm, b_perm, out_perm))
    plain = not (a_sum or b_sum or reshape) and a_perm is b_perm is out_perm is None
    return _MatmulPlan(a_sum, b_sum, a_perm, b_perm, len(batch), len(a_free), len(b_free),
                       reshape, out_perm, plain)  # fmt: skip


def _einsum_np(*xs, out, in_dims, preferred=None, precision=None):
    if preferred is not None:  # the product of the operands' exact values, summed there
        xs = [x.astype(np.promote_types(preferred, np.float32)) for x in xs]
    if len(xs) == 1:
        return np.einsum(spec(in_dims, out), xs[0])
    a, b = xs
    plan = _matmul_plan(*in_dims, out)
    if plan.a_sum:
        a = a.sum(axis=plan.a_sum)
    if plan.b_sum:
        b = b.sum(axis=plan.b_sum)
    if plan.a_perm is not None:
        a = a.transpose(plan.a_perm)
    if plan.b_perm is not None:
        b = b.transpose(plan.b_perm)
    if not plan.reshape_in:
        r = np.matmul(a, b)
    else:
        nb, na, nf = plan.n_batch, plan.n_a_free, plan.n_b_free
        bs, fa, fb = a.shape[:nb], a.shape[nb : nb + na], b.shape[b.ndim - nf :]
        k = math.prod(a.shape[nb + na :])
        r = np.matmul(a.reshape(bs + (math.prod(fa), k)), b.reshape(bs + (k, math.prod(fb))))
        r = r.reshape(bs + fa + fb)
    return r if plan.out_perm is None else r.transpose(plan.out_perm)


def _einsum_kernel(out, in_dims, preferred=None, precision=None):
    """The NumPy function of an einsum's operands: `np.matmul` itself for a plain
    (batched) matrix product, else `_einsum_np` with these params."""
    if preferred is None and len(in_dims) == 2:
        if _matmul_plan(*in_dims, out).plain:
            return np.matmul
    return functools.partial(_einsum_np, out=out, in_dims=in_dims, preferred=preferred)


def _einsum_jax(*xs, out, in_dims, preferred=None, precision=None):
    if len(xs) == 2 and _one_float(xs, preferred) and custom_gradients():
        return _contract_jax(*xs, out=out, in_dims=in_dims, precision=precision)
    return jnp.einsum(
        spec(in_dims, out), *xs, preferred_element_type=preferred, precision=precision
    )


def _one_float(xs, preferred) -> bool:
    """Whether `contract` runs this einsum: operands of one floating dtype, summed in it."""
    dt = xs[0].dtype
    return (
        jnp.issubdtype(dt, jnp.floating)
        and xs[1].dtype == dt
        and (preferred is None or np.dtype(preferred) == dt)
    )


def _contract_jax(a, b, out, in_dims, precision):
    """A two-operand einsum by `contract.contract` (XLA:CPU's fastest dot_general and
    gradients), a dim that only one operand has and `out` lacks summed first."""
    a_dims, b_dims = in_dims
    plan = _matmul_plan(a_dims, b_dims, out)
    if plan.a_sum:
        a, a_dims = a.sum(plan.a_sum), tuple(d for d in a_dims if d in b_dims or d in out)
    if plan.b_sum:
        b, b_dims = b.sum(plan.b_sum), tuple(d for d in b_dims if d in a_dims or d in out)
    return contract(a, b, a_dims, b_dims, out, precision)


def _einsum_cost(in_avals, out_avals, params) -> Cost:
    sizes = {d: s for a in in_avals for d, s in zip(a.dims, a.shape, strict=True)}
    summed = any(d not in params["out"] for d in sizes)
    flops = math.prod(sizes.values()) * (2 if summed and len(in_avals) == 2 else 1)
    return Cost(flops, sum(a.nbytes for a in in_avals) + out_avals[0].nbytes)


_einsum = primitive(
    "einsum",
    _einsum_rule,
    _einsum_np,
    _einsum_jax,
    cost_rule=_einsum_cost,
    matmul=True,
    backward_reads="others",
    combines_inputs=True,
    numpy_kernel=_einsum_kernel,
)


@functools.lru_cache(maxsize=1024)
def _path(in_dims, out, shapes):
    _, info = opt_einsum.contract_path(spec(in_dims, out), *shapes, shapes=True, optimize="auto")
    return info.contraction_list


_PRECISIONS = (None, "default", "high", "highest")


@functools.lru_cache(maxsize=4096)
def _signature(in_dims, out, preferred_element_type, precision) -> dict:
    """The params of an einsum of operands with `in_dims` (out, in_dims, how it multiplies
    and sums), checked; cached, so the same einsum in a loop is checked once."""
    acc = _accumulation(preferred_element_type, precision)
    return {"out": output_dims(in_dims, out), "in_dims": in_dims, **acc}


def _not_tensors(operands) -> None:
    """ArgumentError naming the first operand that is not a Tensor."""
    for i, x in enumerate(operands):
        if not isinstance(x, Tensor):
            raise ArgumentError(
                f"einsum: operand {i} is a {type(x).__name__}, not a Tensor"
                + ("; give it dims with nm.tensor(data, dims)" if hasattr(x, "shape") else "")
            )


def _accumulation(preferred_element_type, precision) -> dict:
    """The einsum's params for how it multiplies and sums, checked."""
    if precision not in _PRECISIONS:
        raise ParameterError(f"einsum: precision must be one of {_PRECISIONS}, got {precision!r}")
    if preferred_element_type is None:
        return {"preferred": None, "precision": precision}
    dt = np.dtype(preferred_element_type)
    if not jnp.issubdtype(dt, jnp.floating):
        raise DtypeError(f"einsum: preferred_element_type must be a floating dtype, got {dt.name}")
    return {"preferred": dt, "precision": precision}


@remembered
def einsum(
    *operands: Tensor,
    out: DimsLike | None = None,
    preferred_element_type=None,
    precision: str | None = None,
) -> Tensor:
    """Contract Tensors by dim name.

    Dims shared by operands and absent from `out` are summed. `out` (a tuple or a
    space-separated string) fixes the result's dims and their order; when it is None
    the result keeps the dims that occur in exactly one operand, in order of first
    occurrence. A dim must have one size in every operand (ShapeError otherwise), and
    `out` may only name dims of the operands (ShapeError with the closest name). Three
    or more operands are contracted pairwise in the order opt_einsum finds. matmul,
    dot, outer and batched products and sums over a dim are all einsums:
    `nm.einsum(x, w, out="batch d_ff")` is x @ w over their shared dim `d_model`.

    `preferred_element_type` (a floating dtype) is the dtype the products are summed in
    and the result's dtype: bfloat16 operands with float32 give the float32 sum of
    their exact products (the NumPy reference multiplies in float32). `precision`
    ("default", "high", "highest") is passed to XLA's dot for float32 operands on
    accelerators that would otherwise round them (TPU, GPU TF32)."""
    if not operands:
        raise ShapeError("einsum: needs at least one operand")
    for x in operands:
        if not isinstance(x, Tensor):
            _not_tensors(operands)
    in_dims = tuple([x.dims for x in operands])
    try:  # the same einsum in a loop: dims and params checked once
        params = _signature(in_dims, out, preferred_element_type, precision)
    except TypeError:  # out given as a list, not hashable
        params = _signature.__wrapped__(in_dims, out, preferred_element_type, precision)
    if len(operands) <= 2:
        return bind(_einsum, *operands, **params)
    out, acc = params["out"], _accumulation(preferred_element_type, precision)
    _sizes(operands)  # one error naming the operands, before the pairwise steps
    ops = list(operands)
    shapes = tuple(x.shape for x in operands)
    for pair, *_ in _path(in_dims, out, shapes):
        taken = [ops.pop(i) for i in sorted(pair, reverse=True)][::-1]
        if not ops:
            step_out = out
        else:
            needed = set(out).union(*(x.dims for x in ops))
            seen = dict.fromkeys(d for x in taken for d in x.dims)
            step_out = tuple(d for d in seen if d in needed)
        in_dims = tuple(x.dims for x in taken)
        ops.append(bind(_einsum, *taken, out=step_out, in_dims=in_dims, **acc))
    return ops[0]


def einsum_order(a: Tensor, b: Tensor, out: DimsLike) -> tuple[str, ...]:
    """`out`'s dims in the order `einsum(a, b, out=...)` writes them without a transposed
    copy on XLA:CPU: the dims both keep (batch), then one operand's other dims, then the
    other's, the operands in the order whose dot copies the fewest elements. Named dims
    let a caller that does not care about the order (the next ops match dims by name)
    take this one: attention's logits, [batch, heads, length, memory] from q's and k's
    order, go straight to the softmax with no [length, heads] reorder."""
    out = output_dims((a.dims, b.dims), out)
    sizes = tuple(sorted(_sizes((a, b)).items()))
    return dot_order(tuple(a.dims), tuple(b.dims), out, sizes)


def dot(*operands: Tensor, over: DimsLike) -> Tensor:
    """Contract `over` the named dims; every other dim is kept (a shared one as a batch dim)."""
    over = parse_dims(over, "dot over")
    seen = dict.fromkeys(d for x in operands for d in x.dims)
    missing = [d for d in over if d not in seen]
    if missing:
        raise ShapeError(
            f"dot: dim(s) {missing} are in no operand {[x.dims for x in operands]}"
            + did_you_mean(missing[0], seen)
        )
    return einsum(*operands, out=tuple(d for d in seen if d not in over))


def _einsum_example(a, b, d, k):
    """The property strategies' einsum (Primitive.example): of two operands, or three (b
    again) for k >= 32, keeping the dims of their union that k's low bits pick."""
    ops = (a, b, b) if k >= 32 else (a, b)
    union = list(dict.fromkeys(d for t in ops for d in t.dims))
    return einsum(*ops, out=[u for n, u in enumerate(union) if (k >> n) & 1])


_einsum.example = _einsum_example
