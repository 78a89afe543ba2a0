"""Elementwise ops, broadcasting by name as xarray does.

The result has the union of the operands' dims, the first operand's order first,
then each later operand's new dims in its own order. A dim shared by two operands
must have one size. Python scalars broadcast and take the tensor's dtype when they
fit it (a float scalar with an integer tensor gives float32).
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import scipy.special

from namedmesh.checks import agreed_sizes, fits_dtype, warn_near_misses
from namedmesh.eager import remembered
from namedmesh.errors import ArgumentError, DtypeError, fmt_dims
from namedmesh.primitive import (
    Aval,
    Cost,
    bind,
    default_cost,
    float_result,
    is_inexact,
    primitive,
    result_dtype,
)
from namedmesh.tensor import Tensor, native_dtype

_FLOAT32 = np.dtype(np.float32)
_BOOL = np.dtype(bool)


def _scalar_dtype(s, dt: np.dtype) -> np.dtype:
    if isinstance(s, bool):
        return dt
    if isinstance(s, int):
        return dt if dt.kind in "iu" or is_inexact(dt) else np.dtype(np.int32)
    if isinstance(s, float):
        return dt if is_inexact(dt) else _FLOAT32
    if isinstance(s, complex):
        return dt if dt.kind == "c" else np.dtype(np.complex64)
    raise TypeError(f"cannot combine a {type(s).__name__} with a Tensor")


def _default_dtype(s) -> np.dtype:
    return {bool: _BOOL, int: np.dtype(np.int32), float: _FLOAT32}.get(type(s), np.dtype(complex))


def operands(*xs, op: str, like_from: int = 0) -> list[Tensor]:
    """Tensors as they are; Python and 0-d NumPy scalars as 0-d tensors of a fitting dtype."""
    tensor = next((x for x in xs[like_from:] if isinstance(x, Tensor)), None)
    if tensor is None:
        tensor = next((x for x in xs if isinstance(x, Tensor)), None)
    like = None if tensor is None else tensor.dtype
    out = []
    for x in xs:
        if isinstance(x, Tensor):
            out.append(x)
            continue
        if isinstance(x, jax.Array) and x.ndim == 0:  # a jax scalar, traced under jit too
            out.append(Tensor._make(x, ()))
            continue
        if isinstance(x, np.ndarray | np.generic) and np.ndim(x) == 0:
            x = x.item()
        if not isinstance(x, bool | int | float | complex):
            raise ArgumentError(
                f"{op}: operands must be Tensors or scalars, got {type(x).__name__}"
                + (
                    f" of shape {x.shape}; give it dims with nm.tensor(data, dims)"
                    if hasattr(x, "shape")
                    else ""
                )
            )
        dt = _default_dtype(x) if like is None else _scalar_dtype(x, like)
        if like is not None:
            whose = f", the dtype of the tensor {fmt_dims(tensor.dims, tensor.shape)}"
            fits_dtype(op, "the scalar", x, dt, whose if dt == like else "")
        out.append(Tensor._make(np.asarray(x, dtype=dt), ()))
    return out


def fmt_operands(xs) -> str:
    """The operands as their dims and sizes, for an error message."""
    return ", ".join(fmt_dims(x.dims, x.shape) for x in xs)


def broadcast_dims(xs, op: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Union of dims in order of first appearance; ShapeError on a size disagreement, a
    DimNameWarning for a new dim that looks like a typo of another operand's."""
    sizes = agreed_sizes(op, xs)
    warn_near_misses(op, xs)
    return tuple(sizes), tuple(sizes.values())


@functools.lru_cache(maxsize=4096)
def _alignment(dims: tuple[str, ...], out_dims: tuple[str, ...]):
    """Permutation and new axes that put an array with `dims` in `out_dims` broadcast order."""
    present = [d for d in out_dims if d in dims]
    perm = tuple(dims.index(d) for d in present)
    missing = tuple(i for i, d in enumerate(out_dims) if d not in dims)
    return (None if perm == tuple(range(len(dims))) else perm), missing


def align(x, dims: tuple[str, ...], out_dims: tuple[str, ...], xp=np):
    """`x` (with `dims`) transposed and expanded so it broadcasts against `out_dims`."""
    if dims == out_dims:
        return x
    perm, missing = _alignment(dims, out_dims)
    if perm is not None:
        x = xp.transpose(x, perm)
    return xp.expand_dims(x, missing) if missing and len(dims) else x


def _nary(xp_fn, xp):
    def impl(*arrays, in_dims, out_dims, **_):
        return xp_fn(*(align(a, d, out_dims, xp) for a, d in zip(arrays, in_dims, strict=True)))

    return impl


def _nary_kernel(np_fn):
    """The NumPy function itself where every operand has the result's dims in its order
    or none (a scalar's: align passes each through), else the aligning implementation."""
    impl = _nary(np_fn, np)

    def kernel(in_dims, out_dims):
        if all(d == out_dims or not d for d in in_dims):
            return np_fn
        return functools.partial(impl, in_dims=in_dims, out_dims=out_dims)

    return kernel


def _cost(flops_per_element: int):
    def cost(in_avals, out_avals, params) -> Cost:
        c = default_cost(in_avals, out_avals, params)
        return Cost(flops_per_element * c.flops, c.bytes)

    return cost


def _make_nary(
    name: str,
    np_fn,
    jnp_fn,
    dtype_rule,
    flops: int = 1,
    like_from: int = 0,
    reads="inputs",
    saves=0,
    least=None,
    bool_instead: str | None = None,
):
    """One elementwise primitive and its public op. Scalars take the dtype of the first
    Tensor among the operands from position `like_from` on; `reads` and `saves` are
    what its backward pass reads (`Primitive.backward_reads`, `backward_saves`), `least`
    what it must read at the least where that differs (`Primitive.least_reads`). An op
    that bools have no meaning for (NumPy and jax refuse them) names `bool_instead`, the
    op to use: its bool operands are a DtypeError at the call."""

    def shape_rule(*xs, in_dims, out_dims):
        if bool_instead and any(x.dtype == _BOOL for x in xs):
            raise DtypeError(f"{name} of a bool tensor {fmt_operands(xs)}: use {bool_instead}")
        dims, shape = broadcast_dims(xs, name)
        return Aval(dims, shape, dtype_rule(*(x.dtype for x in xs)))

    prim = primitive(
        name,
        shape_rule,
        _nary(np_fn, np),
        _nary(jnp_fn, jnp),
        cost_rule=_cost(flops),
        elementwise=True,
        backward_reads=reads,
        backward_saves=saves,
        least_reads=least,
        combines_inputs=True,
        float_valued=dtype_rule is float_result,
        numpy_kernel=_nary_kernel(np_fn),
    )

    n_operands = _arity(np_fn)

    def op(*xs) -> Tensor:
        if len(xs) != n_operands:  # (traced, nothing else would count them)
            raise ArgumentError(f"{name} takes {n_operands} operand(s), got {len(xs)}")
        ts = operands(*xs, op=name, like_from=like_from)
        out_dims, _ = broadcast_dims(ts, name)
        return bind(prim, *ts, in_dims=tuple(t.dims for t in ts), out_dims=out_dims)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"Elementwise `{name}`, broadcasting by name."
    op.primitive = prim
    return remembered(op)


def _arity(np_fn) -> int:
    """How many operands the NumPy function takes: a ufunc's nin, else its parameters
    without a default (np.round's decimals has one)."""
    if isinstance(np_fn, np.ufunc):
        return np_fn.nin
    if np_fn is np.where:
        return 3
    params = inspect.signature(np_fn).parameters.values()
    return sum(p.default is inspect.Parameter.empty for p in params)


def _same(*dts):
    return result_dtype(*dts)


def _boolean(*dts):
    return _BOOL


def _gelu_np(x):
    c = np.sqrt(2 / np.pi).astype(x.dtype)
    return 0.5 * x * (1 + np.tanh(c * (x + np.asarray(0.044715, x.dtype) * x**3)))


def _reciprocal_np(x):
    return np.true_divide(1, x)


def _reciprocal_jax(x):
    return jnp.true_divide(1, x)


def _relu_np(x):
    return np.maximum(x, np.zeros((), x.dtype))


def _rsqrt_np(x):
    return 1 / np.sqrt(x)


def _silu_np(x):
    return x * scipy.special.expit(x)


def _integer_power(xp, x, y, bits: int):
    """x ** y in the integers' dtype: the exact power wrapped to the dtype for y >= 0 (as
    repeated multiplication wraps), and 1 / x**-y truncated for y < 0 (1 for 1, +-1 for
    -1, else 0; 0 for 0 too, which has no integer answer)."""
    signed = np.dtype(x.dtype).kind == "i"
    e = xp.where(y < 0, xp.zeros((), y.dtype), y) if signed else y
    if xp is np:
        whole = np.power(x, e)  # (NumPy's loop covers every bit of e)
    else:  # jnp.power squares only six times: exponents of 64 and more came out wrong
        whole = jax.lax.fori_loop(0, bits, _square_and_multiply, (xp.ones_like(x), x, e))[0]
    if not signed:
        return whole
    one = xp.ones((), x.dtype)
    odd = (y & 1) == 1
    inverse = xp.where(x == 1, one, xp.where(x == -1, xp.where(odd, -one, one), 0 * one))
    return xp.where(y < 0, inverse, whole)


def _square_and_multiply(_, state):
    """One bit of the exponent `e`, lowest first: `whole` times `base` where it is set."""
    whole, base, e = state
    return jnp.where((e & 1) == 1, whole * base, whole), base * base, e >> 1


def _power(xp):
    """power with one meaning on NumPy and jax: both operands in the result's dtype
    (`result_dtype`, jax's promotion); a float result is the float power of the operands
    converted to it (an integer exponent too, as jax converts it: float16 has no 100001),
    an integer one `_integer_power`'s. NumPy's own rules differ (float32 ** int32 is
    float64; an integer to a negative power raises), and so does jnp.power of integer
    arrays (exponents of 64 and more, negative ones)."""

    def impl(x, y):
        dt = result_dtype(x.dtype, y.dtype)
        if dt == _BOOL:
            return xp.power(x, y)
        if is_inexact(dt):  # (jax keeps an int exponent int: its gradient at x = 0)
            keep = xp is not np and np.dtype(y.dtype).kind in "iub"
            return xp.power(x.astype(dt), y if keep else y.astype(dt))
        return _integer_power(xp, x.astype(dt), y.astype(dt), 8 * dt.itemsize)

    return impl


_power_np = _power(np)
_power_jax = _power(jnp)


def _floor_divide_jax(x, y):
    """jnp.floor_divide, with NumPy's 0 for an integer (or bool) divided by 0: XLA's
    integer division gives -1 there (all ones unsigned), and its floor -2."""
    q = jnp.floor_divide(x, y)
    if is_inexact(q.dtype):
        return q
    return jnp.where(y == 0, jnp.zeros((), q.dtype), q)


def _round_jax(x):
    """jnp.round, and integers and bools as they are (jax refuses to round bools)."""
    return jnp.round(x) if is_inexact(x.dtype) else x


def _gelu_jax(x):
    return jax.nn.gelu(x, approximate=True)


# Unary: name, NumPy, jax.numpy, dtype rule, flops per element.
negative = _make_nary(
    "negative", np.negative, jnp.negative, _same, reads="nothing", bool_instead="logical_not"
)
abs = _make_nary("abs", np.abs, jnp.abs, _same)
sign = _make_nary("sign", np.sign, jnp.sign, _same, reads="nothing", bool_instead="astype")
square = _make_nary(
    "square", np.square, jnp.square, _same, reads="nothing", saves=1, least="inputs"
)
reciprocal = _make_nary("reciprocal", _reciprocal_np, _reciprocal_jax, float_result, reads="output")
exp = _make_nary("exp", np.exp, jnp.exp, float_result, reads="output")
log = _make_nary("log", np.log, jnp.log, float_result)
log1p = _make_nary("log1p", np.log1p, jnp.log1p, float_result)
expm1 = _make_nary("expm1", np.expm1, jnp.expm1, float_result, reads="output")
sqrt = _make_nary("sqrt", np.sqrt, jnp.sqrt, float_result, reads="output")
rsqrt = _make_nary(
    "rsqrt", _rsqrt_np, jax.lax.rsqrt, float_result, 2, reads="nothing", saves=1, least="output"
)
sin = _make_nary("sin", np.sin, jnp.sin, float_result)
cos = _make_nary("cos", np.cos, jnp.cos, float_result)
tan = _make_nary("tan", np.tan, jnp.tan, float_result)
tanh = _make_nary("tanh", np.tanh, jnp.tanh, float_result, reads="output", saves=1)
erf = _make_nary("erf", scipy.special.erf, jax.scipy.special.erf, float_result)
sigmoid = _make_nary(
    "sigmoid",
    scipy.special.expit,
    jax.nn.sigmoid,
    float_result,
    4,
    reads="nothing",
    saves=1,
    least="output",
)
relu = _make_nary("relu", _relu_np, jax.nn.relu, _same, least="output")
gelu = _make_nary("gelu", _gelu_np, _gelu_jax, float_result, 8, reads="inputs", saves=4)
silu = _make_nary("silu", _silu_np, jax.nn.silu, float_result, 5, reads="inputs", saves=2)
floor = _make_nary("floor", np.floor, jnp.floor, _same, reads="nothing")
ceil = _make_nary("ceil", np.ceil, jnp.ceil, _same, reads="nothing")
round = _make_nary("round", np.round, _round_jax, _same, reads="nothing")
logical_not = _make_nary("logical_not", np.logical_not, jnp.logical_not, _boolean, reads="nothing")
isnan = _make_nary("isnan", np.isnan, jnp.isnan, _boolean, reads="nothing")
isfinite = _make_nary("isfinite", np.isfinite, jnp.isfinite, _boolean, reads="nothing")

# Binary: name, NumPy, jax.numpy, dtype rule.
add = _make_nary("add", np.add, jnp.add, _same, reads="nothing")
subtract = _make_nary(
    "subtract", np.subtract, jnp.subtract, _same, reads="nothing", bool_instead="logical_xor"
)
multiply = _make_nary("multiply", np.multiply, jnp.multiply, _same, reads="others")
divide = _make_nary("divide", np.true_divide, jnp.true_divide, float_result)
floor_divide = _make_nary(
    "floor_divide", np.floor_divide, _floor_divide_jax, _same, reads="nothing"
)
mod = _make_nary("mod", np.mod, jnp.mod, _same, reads="nothing")
power = _make_nary("power", _power_np, _power_jax, _same, reads="both")
maximum = _make_nary("maximum", np.maximum, jnp.maximum, _same)
minimum = _make_nary("minimum", np.minimum, jnp.minimum, _same)
arctan2 = _make_nary("arctan2", np.arctan2, jnp.arctan2, float_result)
equal = _make_nary("equal", np.equal, jnp.equal, _boolean, reads="nothing")
not_equal = _make_nary("not_equal", np.not_equal, jnp.not_equal, _boolean, reads="nothing")
less = _make_nary("less", np.less, jnp.less, _boolean, reads="nothing")
less_equal = _make_nary("less_equal", np.less_equal, jnp.less_equal, _boolean, reads="nothing")
greater = _make_nary("greater", np.greater, jnp.greater, _boolean, reads="nothing")
greater_equal = _make_nary(
    "greater_equal", np.greater_equal, jnp.greater_equal, _boolean, reads="nothing"
)
logical_and = _make_nary("logical_and", np.logical_and, jnp.logical_and, _boolean, reads="nothing")
logical_or = _make_nary("logical_or", np.logical_or, jnp.logical_or, _boolean, reads="nothing")
logical_xor = _make_nary("logical_xor", np.logical_xor, jnp.logical_xor, _boolean, reads="nothing")
where = _make_nary(
    "where", np.where, jnp.where, lambda c, x, y: result_dtype(x, y), like_from=1, reads="constant"
)
where.__doc__ = "`where(cond, x, y)`: x where cond else y, broadcast by name (cond's dims first)."

UNARY_OPS = (
    "negative",
    "abs",
    "sign",
    "square",
    "reciprocal",
    "exp",
    "log",
    "log1p",
    "expm1",
    "sqrt",
    "rsqrt",
    "sin",
    "cos",
    "tan",
    "tanh",
    "erf",
    "sigmoid",
    "relu",
    "gelu",
    "silu",
    "floor",
    "ceil",
    "round",
    "logical_not",
    "isnan",
    "isfinite",
)
BINARY_OPS = (
    "add",
    "subtract",
    "multiply",
    "divide",
    "floor_divide",
    "mod",
    "power",
    "maximum",
    "minimum",
    "arctan2",
    "equal",
    "not_equal",
    "less",
    "less_equal",
    "greater",
    "greater_equal",
    "logical_and",
    "logical_or",
    "logical_xor",
)


def _convert_rule(x, dtype):
    return Aval(x.dims, x.shape, dtype)


def _convert_np(x, dtype):
    """x.astype(dtype), a float to an integer as XLA converts it: toward 0, saturated at
    the integer's range, NaN to 0 (NumPy's cast of a float it cannot hold is undefined:
    300.0 gave 44 in int8, NaN and inf int32's minimum, where jax gives 127, 0, the max)."""
    if not is_inexact(x.dtype) or np.dtype(dtype).kind not in "iu":
        return x.astype(dtype)
    info = np.iinfo(dtype)
    wide = np.trunc(x.astype(np.float64))  # (float64 holds every int32 and uint32 bound)
    return np.nan_to_num(np.clip(wide, info.min, info.max), nan=0).astype(dtype)


_convert = primitive(
    "convert",
    _convert_rule,
    _convert_np,
    lambda x, dtype: x.astype(dtype),
    backward_reads="nothing",
)


@remembered
def astype(x: Tensor, dtype) -> Tensor:
    """`x` converted to `dtype`; `x` itself when it has that dtype (no op recorded, so
    that the memory estimate does not count a copy that jax never makes)."""
    if x.dtype == native_dtype(dtype):
        return x
    return bind(_convert, x, dtype=native_dtype(dtype))


def _int_scalar(v) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)


@remembered
def clip(x: Tensor, lo=None, hi=None) -> Tensor:
    """`x` limited to [lo, hi]; either bound may be None or a Tensor. An int bound beyond
    an integer x's range bounds nothing (NumPy's np.clip), rather than failing to fit."""
    if x.dtype.kind in "iu":
        info = np.iinfo(x.dtype)
        lo = None if _int_scalar(lo) and lo < info.min else lo
        hi = None if _int_scalar(hi) and hi > info.max else hi
    if lo is not None:
        x = maximum(x, lo)
    if hi is not None:
        x = minimum(x, hi)
    return x


# How the property strategies' random programs apply these (Primitive.example): the other
# elementwise ops are derived from their flags
where.primitive.example = lambda a, b, d, k: where(a > 0, a, b)
_convert.example = lambda a, b, d, k: astype(a * 4, np.int32 if k % 2 else jnp.bfloat16)
