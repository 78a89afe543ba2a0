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

import jax.numpy as jnp
import numpy as np
import opt_einsum

from namedmesh.checks import agreed_sizes, did_you_mean
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


@functools.lru_cache(maxsize=4096)
def _matmul_plan(a_dims, b_dims, out):
    """Transposes and reshapes that turn a two-operand einsum into one batched matmul."""
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
    return a_sum, b_sum, a_perm, b_perm, len(batch), len(a_free), len(b_free), out_perm


def _einsum_np(*xs, out, in_dims, preferred=None, precision=None):
    if preferred is not None:  # the product of the operands' exact values, summed there
        xs = [x.astype(np.promote_types(preferred, np.float32)) for x in xs]
    if len(xs) == 1:
        return np.einsum(spec(in_dims, out), xs[0])
    a, b = xs
    a_sum, b_sum, a_perm, b_perm, nb, na, nf, out_perm = _matmul_plan(*in_dims, out)
    if a_sum:
        a = a.sum(axis=a_sum)
    if b_sum:
        b = b.sum(axis=b_sum)
    a, b = a.transpose(a_perm), b.transpose(b_perm)
    bs, fa, fb = a.shape[:nb], a.shape[nb : nb + na], b.shape[b.ndim - nf :]
    k = math.prod(a.shape[nb + na :])
    r = np.matmul(a.reshape(bs + (math.prod(fa), k)), b.reshape(bs + (k, math.prod(fb))))
    return r.reshape(bs + fa + fb).transpose(out_perm)


def _einsum_jax(*xs, out, in_dims, preferred=None, precision=None):
    return jnp.einsum(
        spec(in_dims, out), *xs, preferred_element_type=preferred, precision=precision
    )


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
)


@functools.lru_cache(maxsize=1024)
def _path(in_dims, out, shapes):
    _, info = opt_einsum.contract_path(spec(in_dims, out), *shapes, shapes=True, optimize="auto")
    return info.contraction_list


_PRECISIONS = (None, "default", "high", "highest")


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
    acc = _accumulation(preferred_element_type, precision)
    if not operands:
        raise ShapeError("einsum: needs at least one operand")
    for i, x in enumerate(operands):
        if not isinstance(x, Tensor):
            raise ArgumentError(
                f"einsum: operand {i} is a {type(x).__name__}, not a Tensor"
                + ("; give it dims with nm.tensor(data, dims)" if hasattr(x, "shape") else "")
            )
    in_dims = tuple(x.dims for x in operands)
    out = output_dims(in_dims, out)
    if len(operands) <= 2:
        return bind(_einsum, *operands, out=out, in_dims=in_dims, **acc)
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
