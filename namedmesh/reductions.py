"""Reductions, normalizations and scans over named dims.

`dims=None` means every dim; a string may name several dims separated by spaces.
Reduced dims leave the result; softmax, log_softmax and cumsum keep them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import scipy.special

from namedmesh.checks import axis_of, integer, require_dims, require_nonempty
from namedmesh.eager import remembered
from namedmesh.errors import ShapeError
from namedmesh.ordering import sort_key
from namedmesh.primitive import (
    Aval,
    Cost,
    bind,
    default_cost,
    float_result,
    is_inexact,
    primitive,
)
from namedmesh.tensor import DimsLike, Tensor, parse_dims

_INT32 = np.dtype(np.int32)


def axes_of(x, dims: DimsLike | None, op: str) -> tuple[int, ...]:
    """Positions of `dims` in `x`, with a ShapeError naming any dim `x` lacks."""
    if dims is None:
        return tuple(range(len(x.dims)))
    names = parse_dims(dims, op, have=x.dims)
    require_dims(op, names, x.dims)
    return tuple(x.dims.index(d) for d in names)


def _kept(x, axes):
    keep = [i for i in range(len(x.dims)) if i not in axes]
    return tuple(x.dims[i] for i in keep), tuple(x.shape[i] for i in keep)


def _reduction_cost(in_avals, out_avals, params) -> Cost:
    return default_cost(in_avals, out_avals, params)._replace(flops=math.prod(in_avals[0].shape))


def wide_accumulation(np_fn):
    """`np_fn(x, ...)`, a NumPy sum or mean, on a 16-bit float x computed in float32 and
    cast back, as XLA accumulates them (jit and lowered): NumPy adds bfloat16 in bfloat16,
    where a sum of 4096 values of 0.1 stalls at 32 (and float16's running sums at 256)."""

    def run(x, *args, **kwargs):
        if not (is_inexact(x.dtype) and np.dtype(x.dtype).itemsize == 2):
            return np_fn(x, *args, **kwargs)
        return np.asarray(np_fn(x.astype(np.float32), *args, **kwargs)).astype(x.dtype)

    return run


def _make_reduction(
    name,
    np_fn,
    jnp_fn,
    dtype_rule=lambda dt: dt,
    reads="nothing",
    saves=0,
    ufunc=None,
    identity=True,
    wide=False,
):
    """A reduction primitive and its public op; `ufunc`, the one whose `reduce` `np_fn`
    calls on an ndarray (np.sum's np.add), is the eager kernel, without np_fn's Python.
    A reduction without an `identity` (max, min) refuses a dim of size 0; a `wide` one
    accumulates 16-bit floats in float32 eagerly, as jax does (`wide_accumulation`)."""
    np_fn = wide_accumulation(np_fn) if wide else np_fn
    kernel = wide_accumulation if wide else (lambda k: k)

    def shape_rule(x, axes):
        dims, shape = _kept(x, axes)
        return Aval(dims, shape, dtype_rule(x.dtype))

    prim = primitive(
        name,
        shape_rule,
        lambda x, axes: np_fn(x, axis=axes),
        lambda x, axes: jnp_fn(x, axis=axes),
        cost_rule=_reduction_cost,
        backward_reads=reads,
        backward_saves=saves,
        float_valued=dtype_rule is float_result,
        numpy_kernel=None
        if ufunc is None
        else lambda axes: kernel(functools.partial(ufunc.reduce, axis=axes)),
    )

    def op(x: Tensor, dims: DimsLike | None = None) -> Tensor:
        axes = axes_of(x, dims, name)
        if not identity:
            require_nonempty(name, x, axes)
        return bind(prim, x, axes=axes)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"`{name}` over `dims` (all dims when None); the reduced dims leave the result."
    op.primitive = prim
    return remembered(op)


def _sum_dtype(dt):
    """Sums of bools and of integers narrower than 32 bits accumulate in 32 bits, as in JAX."""
    if dt.kind == "b" or (dt.kind == "i" and dt.itemsize < 4):
        return np.dtype(np.int32)
    return np.dtype(np.uint32) if dt.kind == "u" and dt.itemsize < 4 else dt


sum = _make_reduction("sum", np.sum, jnp.sum, _sum_dtype, ufunc=np.add, wide=True)


def _prod_jax(x, axis):
    """jnp.prod, but over a dim of size 0 the product's ones made from x's empty sum
    (zeros typed as x): inside shard_map jax's gradient of a prod over nothing is typed
    invariant, which the transpose of a psum or pvary of it then refuses (JAX 0.10, a raw
    ValueError from the gradient of a lowered program)."""
    if 0 not in (x.shape[a] for a in axis):
        return jnp.prod(x, axis=axis)
    empty = jnp.sum(x, axis=axis)
    return (empty * 0 + 1).astype(jax.eval_shape(lambda: jnp.prod(x, axis=axis)).dtype)


prod = _make_reduction(
    "prod", np.prod, _prod_jax, _sum_dtype, reads="both", ufunc=np.multiply, wide=True
)
max = _make_reduction("max", np.max, jnp.max, reads="both", ufunc=np.maximum, identity=False)
min = _make_reduction("min", np.min, jnp.min, reads="both", ufunc=np.minimum, identity=False)
mean = _make_reduction("mean", np.mean, jnp.mean, float_result, wide=True)
any = _make_reduction("any", np.any, jnp.any, lambda dt: np.dtype(bool))
all = _make_reduction("all", np.all, jnp.all, lambda dt: np.dtype(bool))


def _scipy(fn):
    """A scipy.special function on bfloat16 (which scipy cannot take) run in float32; the
    result is cast back to the shape rule's dtype."""

    def run(x, axis):
        return fn(x.astype(np.float32) if x.dtype.kind == "V" else x, axis=axis)

    return run


def _logsumexp_np(x, axis):
    """scipy's logsumexp (`_scipy`); over no elements -inf (the log of an empty sum), as
    jax gives, where scipy indexed the shape by a tuple of axes: a raw IndexError."""
    if x.size == 0:
        return np.full(np.sum(x, axis=axis).shape, -np.inf, np.float32)
    return _scipy(scipy.special.logsumexp)(x, axis)


logsumexp = _make_reduction(
    "logsumexp", _logsumexp_np, jax.nn.logsumexp, float_result, reads="both"
)
logsumexp.__doc__ = "log(sum(exp(x))) over `dims`, computed stably (max subtracted first)."


def _same_rule(x, axes, **_):
    return Aval(x.dims, x.shape, float_result(x.dtype))


def normalization_cost(in_avals, out_avals, params) -> Cost:
    """Four flops per input element (a max or mean, a subtract, an exp or square, a sum)."""
    return default_cost(in_avals, out_avals, params)._replace(
        flops=4 * math.prod(in_avals[0].shape)
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _softmax_float(x, axes):
    return jax.nn.softmax(x, axis=axes)


@_softmax_float.defjvp
def _softmax_jvp(axes, primals, tangents):
    # y (t - sum(y t)): linear in t with y its only residual. jax 0.10 differentiates
    # jax.nn.softmax through exp and the division (jax_softmax_custom_jvp is off), and
    # the backward pass then keeps exp(x - max) beside y: attention's probabilities
    # saved twice, the largest residual of a training step
    (x,), (t,) = primals, tangents
    y = _softmax_float(x, axes)
    return y, y * (t - jnp.sum(y * t, axis=axes, keepdims=True))


def softmax_jax(x, axes):
    """softmax over `axes` in jax, its derivative from its output alone (floats; an
    integer x has no tangent: jax's own softmax, in float32)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return _softmax_float(x, axes)
    return jax.nn.softmax(x, axis=axes)


def _normalization_np(fn):
    """scipy's softmax or log_softmax; an empty x as it is (scipy's max of nothing raises
    where jax's softmax gives the empty result)."""
    run = _scipy(fn)
    return lambda x, axes: x.astype(float_result(x.dtype)) if x.size == 0 else run(x, axes)


_softmax = primitive(
    "softmax",
    _same_rule,
    _normalization_np(scipy.special.softmax),
    softmax_jax,
    cost_rule=normalization_cost,
    backward_reads="nothing",
    backward_saves=1,
    least_reads="output",
    float_valued=True,
)
_log_softmax = primitive(
    "log_softmax",
    _same_rule,
    _normalization_np(scipy.special.log_softmax),
    lambda x, axes: log_softmax_jax(x, axes),
    cost_rule=normalization_cost,
    backward_reads="nothing",
    backward_saves=1,
    least_reads="output",
    float_valued=True,
)


def finite_shift(x, m):
    """x - m, or x where the max m is infinite (or NaN): the shift of scipy's log_softmax
    and logsumexp, whose semantics on infinities the reference has."""
    return x - jnp.where(jnp.isfinite(m), m, jnp.zeros((), m.dtype))


def log_softmax_jax(x, axes):
    """scipy.special.log_softmax's formula in jax (jax.nn.log_softmax differs on
    infinities: [0, inf] gives [-inf, nan] here and in scipy, [nan, nan] there)."""
    x = x.astype(float_result(np.dtype(x.dtype)))
    m = jnp.max(x, axis=axes, keepdims=True, initial=-jnp.inf)  # (initial: an empty x)
    shifted = finite_shift(x, jax.lax.stop_gradient(m))
    return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=axes, keepdims=True))


@remembered
def softmax(x: Tensor, dims: DimsLike) -> Tensor:
    """exp(x) / sum(exp(x)) over `dims`; the result keeps x's dims."""
    return bind(_softmax, x, axes=axes_of(x, dims, "softmax"))


@remembered
def log_softmax(x: Tensor, dims: DimsLike) -> Tensor:
    """x - logsumexp(x, dims); the result keeps x's dims."""
    return bind(_log_softmax, x, axes=axes_of(x, dims, "log_softmax"))


def _arg_rule(x, axis):
    dims, shape = _kept(x, (axis,))
    return Aval(dims, shape, _INT32)


_argmax = primitive(
    "argmax",
    _arg_rule,
    lambda x, axis: np.argmax(x, axis=axis),
    lambda x, axis: jnp.argmax(x, axis=axis),
    cost_rule=_reduction_cost,
    least_reads="nothing",  # no gradient flows through it
)
_argmin = primitive(
    "argmin",
    _arg_rule,
    lambda x, axis: np.argmin(x, axis=axis),
    lambda x, axis: jnp.argmin(x, axis=axis),
    cost_rule=_reduction_cost,
    least_reads="nothing",
)


@remembered
def argmax(x: Tensor, dim: str) -> Tensor:
    """Index (int32) of the largest value along `dim`, first one on ties."""
    axis = axis_of(x, dim, "argmax")
    require_nonempty("argmax", x, (axis,))
    return bind(_argmax, x, axis=axis)


@remembered
def argmin(x: Tensor, dim: str) -> Tensor:
    """Index (int32) of the smallest value along `dim`, first one on ties."""
    axis = axis_of(x, dim, "argmin")
    require_nonempty("argmin", x, (axis,))
    return bind(_argmin, x, axis=axis)


def _top_k_rule(x, axis, k, new_dim):
    dims = x.dims[:axis] + (new_dim,) + x.dims[axis + 1 :]
    shape = x.shape[:axis] + (k,) + x.shape[axis + 1 :]
    return Aval(dims, shape, x.dtype), Aval(dims, shape, _INT32)


def _top_k_np(x, axis, k, new_dim):
    # Descending and stable (the lower index first on ties), NaN largest, as jax.lax.top_k;
    # sorting the reversed array ascending avoids negating unsigned or boolean values.
    n = x.shape[axis]
    order = np.flip(np.argsort(np.flip(x, axis), axis=axis, kind="stable"), axis)
    idx = (n - 1 - np.take(order, np.arange(k), axis=axis)).astype(np.int32)
    return np.take_along_axis(x, idx, axis=axis), idx


def _top_k_jax(x, axis, k, new_dim):
    # Ranked by NumPy's order (sort_key: NaN largest, -0.0 == 0.0), values taken as they are.
    xm = jnp.moveaxis(x, axis, -1)
    _, idx = jax.lax.top_k(sort_key(xm), k)
    vals = jnp.take_along_axis(xm, idx, axis=-1)
    return jnp.moveaxis(vals, -1, axis), jnp.moveaxis(idx, -1, axis).astype(jnp.int32)


_top_k = primitive(
    "top_k",
    _top_k_rule,
    _top_k_np,
    _top_k_jax,
    cost_rule=_reduction_cost,
    multiple_results=True,
    backward_reads="nothing",
)


def top_k(x: Tensor, dim: str, k: int, new_dim: str | None = None) -> tuple[Tensor, Tensor]:
    """The `k` largest values along `dim`, in descending order, and their int32 indices.

    Both results have `dim` replaced, in place, by `new_dim` (default: `dim` itself) of size k.
    """
    axis = axis_of(x, dim, "top_k")
    new_dim = dim if new_dim is None else new_dim
    if new_dim != dim and new_dim in x.dims:
        raise ShapeError(f"top_k: new_dim {new_dim!r} is already a dim of the tensor {x.dims}")
    k = integer("top_k", "k", k)
    if not 1 <= k <= x.shape[axis]:
        raise ShapeError(f"top_k: k={k!r} must be in [1, {x.shape[axis]}], the size of {dim!r}")
    return bind(_top_k, x, axis=axis, k=k, new_dim=new_dim)


@wide_accumulation
def _cumsum_np(x, axis, reverse):
    if reverse:
        return np.flip(np.cumsum(np.flip(x, axis), axis), axis)
    return np.cumsum(x, axis)


def _cumsum_jax(x, axis, reverse):
    """jax.lax.cumsum in the sum's dtype; 16-bit floats in float32, as NumPy's above (jax
    scans them in their own dtype)."""
    dt = _sum_dtype(x.dtype)
    wide = np.float32 if is_inexact(dt) and dt.itemsize == 2 else dt
    return jax.lax.cumsum(x.astype(wide), axis, reverse=reverse).astype(dt)


_cumsum = primitive(
    "cumsum",
    lambda x, axis, reverse: Aval(x.dims, x.shape, _sum_dtype(x.dtype)),
    _cumsum_np,
    _cumsum_jax,
    backward_reads="nothing",
)


@remembered
def cumsum(x: Tensor, dim: str, reverse: bool = False) -> Tensor:
    """Running sum along `dim` (from the end when `reverse`); keeps x's dims."""
    return bind(_cumsum, x, axis=axis_of(x, dim, "cumsum"), reverse=bool(reverse))


# How the property strategies' random programs apply these (Primitive.example)
def _reduced(op, of=lambda a: a):
    def example(a, b, d, k):
        return op(of(a), [x for m, x in enumerate(a.dims) if (k >> m) & 1] or [d])

    return example


def _top_k_example(a, b, d, k):
    if not a.size_of(d):  # no k of an empty dim (a ShapeError)
        return None
    vals, idx = top_k(a, d, 1 + k % a.size_of(d))
    return vals * 0.5 + idx.astype(np.float32) if k % 2 else vals


for _op in (sum, prod, max, min, mean, logsumexp):
    _op.primitive.example = _reduced(_op)
for _op in (any, all):
    _op.primitive.example = _reduced(_op, lambda a: a > 0)
_softmax.example = lambda a, b, d, k: softmax(a, d)
_log_softmax.example = lambda a, b, d, k: log_softmax(a, d)
_argmax.example = lambda a, b, d, k: argmax(a, d)
_argmin.example = lambda a, b, d, k: argmin(a, d)
_top_k.example = _top_k_example
_cumsum.example = lambda a, b, d, k: cumsum(a, d, reverse=bool(k % 2))
del _op
