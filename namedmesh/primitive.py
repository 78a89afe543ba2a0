"""Primitives, their registry, and `bind`: the one place where an op meets its data.

A primitive declares, once: its shape rule (input avals -> output avals, raising
`ShapeError`), its NumPy implementation (the reference), its jax.numpy
implementation, its cost rule, and the flags the lowering reads (elementwise,
combines its inputs, a contraction, pins a layout, aliases its input, what its
backward pass reads); `lowering` keeps its SPMD rules in its own table keyed by the
primitive. `bind` runs the shape rule, then either records an equation
(under `nm.trace`) or runs NumPy (all inputs NumPy) or jax (any input a jax array).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np

from namedmesh.errors import NamedMeshError


class Aval(NamedTuple):
    """Abstract value: dims, positional shape and dtype, no data."""

    dims: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def sizes(self) -> dict[str, int]:
        """dim name -> size."""
        return dict(zip(self.dims, self.shape, strict=True))

    @property
    def nbytes(self) -> int:
        """Bytes of a value with this shape and dtype."""
        return math.prod(self.shape) * self.dtype.itemsize


def is_inexact(dtype) -> bool:
    """Whether `dtype` is a float or complex type, bfloat16 included (NumPy files
    bfloat16 under kind 'V', so `dtype.kind in "fc"` misses it)."""
    return _is_inexact(np.dtype(dtype))


# Cached: every shape rule and the planner's abstract ops ask these of a few dtypes, and
# jax's type lattice takes microseconds per question
@functools.cache
def _is_inexact(dtype: np.dtype) -> bool:
    return bool(jax.numpy.issubdtype(dtype, jax.numpy.inexact))


def result_dtype(*dtypes) -> np.dtype:
    """NumPy promotion, except that integers never widen a float (int32 * float32 is
    float32, as in JAX), so eager NumPy and jax agree."""
    return _result_dtype(tuple(np.dtype(d) for d in dtypes))


@functools.cache
def _result_dtype(dts: tuple[np.dtype, ...]) -> np.dtype:
    floats = [d for d in dts if _is_inexact(d)]
    if not floats:
        return np.result_type(*dts)
    return np.dtype(functools.reduce(jax.numpy.promote_types, floats))


def float_result(*dtypes) -> np.dtype:
    """The dtype of a float-valued op's result (exp, divide, softmax, mean, var...): the
    operands' promoted dtype when it is inexact (bfloat16 too), else float32."""
    dt = result_dtype(*dtypes)
    return dt if _is_inexact(dt) else np.dtype(np.float32)


def in_float(impl: Callable) -> Callable:
    """`impl` run on its inputs cast to the float result's dtype (`float_result`) where they
    are integer or bool: a float-valued op computes in the result's dtype, never in an
    integer one (softmax's max subtracted in int8 wraps; NumPy's exp of int8 is float16),
    and bools reach ops that refuse them (x - max) as 0.0 and 1.0."""

    @functools.wraps(impl)
    def run(*xs, **params):
        dt = float_result(*(x.dtype for x in xs))
        return impl(*(x if _is_inexact(np.dtype(x.dtype)) else x.astype(dt) for x in xs), **params)

    return run


class Cost(NamedTuple):
    """Per-call cost on one device: floating-point operations and bytes read + written."""

    flops: float
    bytes: float


def default_cost(in_avals, out_avals, params) -> Cost:
    """One flop per output element; every input and output byte touched once."""
    flops = sum(math.prod(a.shape) for a in out_avals)
    return Cost(flops, sum(a.nbytes for a in in_avals) + sum(a.nbytes for a in out_avals))


def zero_flops_cost(in_avals, out_avals, params) -> Cost:
    """Data movement only (transposes, slices, concatenation)."""
    return Cost(0, sum(a.nbytes for a in in_avals) + sum(a.nbytes for a in out_avals))


# What the backward pass of a primitive reads of its forward values (what reverse mode
# saves for it), declared on each primitive as `backward_reads`; the training-step
# memory estimate (lowering/memory.py) counts these values as kept.
READS_INPUTS = "inputs"  # its inputs: a nonlinear op whose derivative is written in x
READS_OUTPUT = "output"  # its output: exp, tanh (the derivative is written in y)
READS_BOTH = "both"  # its inputs and its output
READS_NOTHING = "nothing"  # a linear op (its transpose needs the cotangent alone), or no gradient
READS_OTHERS = "others"  # a product: for each input a gradient flows to, the other inputs
READS_CONSTANT = "constant"  # the inputs no gradient flows to (a select's condition)
BACKWARD_READS = (READS_INPUTS, READS_OUTPUT, READS_BOTH, READS_NOTHING, READS_OTHERS,
                  READS_CONSTANT)  # fmt: skip


@dataclass(eq=False)
class Primitive:
    """One op. `shape_rule(*inputs, **params)` sees objects with .dims/.shape/.dtype."""

    name: str
    shape_rule: Callable[..., Aval | tuple[Aval, ...]]
    numpy_impl: Callable[..., Any]
    jax_impl: Callable[..., Any]
    cost_rule: Callable[..., Cost] = default_cost
    multiple_results: bool = False
    # a contraction: what remat policy "dots" keeps; its backward pass costs its forward
    # flops once per input the gradient flows to (one product per operand's gradient),
    # other ops' backward passes cost their forward flops once
    matmul: bool = False
    # What the lowering must know about the op (lowering keeps its SPMD rules in its own
    # table, keyed by the primitive object):
    # acts on each element alone, broadcasting by name: lowered on the output's layout
    elementwise: bool = False
    # its result mixes all its inputs (einsum, elementwise): where any input varies over a
    # mesh axis, all are typed varying there, so the backward pass sums their gradients
    combines_inputs: bool = False
    # its result's layout is the one its `layout` param pins (nm.constrain)
    pins_layout: bool = False
    # its jax implementation returns its one input as it is (rename, constrain): the
    # result is the same local array, which the lowering's casts and moves reuse
    aliases_input: bool = False
    # no gradient flows through it (stop_gradient)
    stops_gradient: bool = False
    # a loop: runs its `body` param (a Graph) `length` times, carrying `n_carry` values
    # (nm.scan); what its backward pass reads and where gradients flow are its body's
    loop: bool = False
    # What its backward pass reads of the forward values: one of BACKWARD_READS
    backward_reads: str = READS_INPUTS
    # and how many values of its first input's size, made inside its jax implementation,
    # jax's autodiff saves besides (softmax's exponentials, gelu's tanh and products)
    backward_saves: int = 0
    # What textbook reverse mode must read at the least, where that is not
    # `backward_reads` (jax's residuals: relu's input, where its output would do): one
    # of BACKWARD_READS, or None for `backward_reads`. The memory benchmark's ideal.
    least_reads: str | None = None
    # its result is a float whatever its inputs' dtype (`float_result`), computed from the
    # inputs cast to that dtype (`in_float`): NumPy, jax and the lowering's local code alike
    float_valued: bool = False

    def __repr__(self) -> str:
        return f"Primitive({self.name})"


REGISTRY: dict[str, Primitive] = {}


def primitive(name: str, shape_rule, numpy_impl, jax_impl, **kw) -> Primitive:
    """Create and register a primitive; names are unique."""
    if name in REGISTRY:
        raise ValueError(f"primitive {name!r} is already registered")
    for reads in ("backward_reads", "least_reads"):
        if kw.get(reads, READS_INPUTS) not in (*BACKWARD_READS, None):
            raise ValueError(f"primitive {name!r}: {reads} must be one of {BACKWARD_READS}")
    if kw.get("float_valued"):
        numpy_impl, jax_impl = in_float(numpy_impl), in_float(jax_impl)
    p = Primitive(name, shape_rule, numpy_impl, jax_impl, **kw)
    REGISTRY[name] = p
    return p


class Var:
    """The data of a Tensor under `nm.trace`: an abstract value with an identity."""

    __slots__ = ("dims", "shape", "dtype", "count", "const")
    _counter = 0

    def __init__(self, aval: Aval, const=None):
        self.dims, self.shape, self.dtype = aval
        self.const = const
        Var._counter += 1
        self.count = Var._counter

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def aval(self) -> Aval:
        return Aval(self.dims, self.shape, self.dtype)

    def __array__(self, dtype=None, copy=None):
        raise NamedMeshError(
            f"cannot read the values of a traced tensor {_fmt_aval(self.aval)} inside "
            "nm.trace: the function must not convert its inputs to NumPy"
        )

    def __repr__(self) -> str:
        return f"Var({_fmt_aval(self.aval)})"


def _fmt_aval(a: Aval) -> str:
    dt = np.dtype(a.dtype)
    short = {"f": "f", "i": "i", "u": "u", "b": "bool", "c": "c"}.get(dt.kind, dt.kind)
    name = short if dt.kind == "b" else f"{short}{dt.itemsize * 8}"
    return name + "[" + ", ".join(f"{d}={s}" for d, s in zip(a.dims, a.shape, strict=True)) + "]"


# The trace frames of `nm.trace`, innermost last. A frame has `record(prim, args, params, avals)`.
TRACE_STACK: list[Any] = []


def _is_jax(x) -> bool:
    return not isinstance(x, np.ndarray) and isinstance(x, jax.Array)


def bind(prim: Primitive, *args, **params):
    """Apply `prim` to Tensors `args`: record under a trace, else run NumPy or jax."""
    from namedmesh.tensor import Tensor

    out = prim.shape_rule(*args, **params)
    avals = out if prim.multiple_results else (out,)
    if TRACE_STACK:
        outs = TRACE_STACK[-1].record(prim, args, params, avals)
    else:
        datas = [a.data for a in args]
        for d in datas:
            if isinstance(d, Var):
                raise NamedMeshError(
                    f"{prim.name}: a tensor {d!r} from a finished nm.trace was used outside it"
                )
        if any(_is_jax(d) for d in datas):
            res = prim.jax_impl(*datas, **params)
            outs = _coerce_jax(res if prim.multiple_results else (res,), avals)
        else:
            res = prim.numpy_impl(*datas, **params)
            outs = _coerce_numpy(res if prim.multiple_results else (res,), avals)
    tensors = tuple(Tensor._make(o, a.dims) for o, a in zip(outs, avals, strict=True))
    return tensors if prim.multiple_results else tensors[0]


def _coerce_jax(outs, avals):
    """jax promotes some dtypes NumPy keeps (a bool's square, relu or power is int32 in
    jax, bool in NumPy and in the shape rule): hold it to the shape rule's dtype, as the
    lowering's local ops are (lowering/emit.py), so eager jax, jit and lowered agree."""
    canonical = jax.dtypes.canonicalize_dtype
    return [o if o.dtype == canonical(a.dtype) else o.astype(a.dtype) for o, a in
            zip(outs, avals, strict=True)]  # fmt: skip


def _coerce_numpy(outs, avals):
    """NumPy widens some dtypes (int32 sums become int64); hold it to the shape rule's dtype."""
    fixed = []
    for o, a in zip(outs, avals, strict=True):
        if type(o) is not np.ndarray:
            o = np.asarray(o)
        if o.dtype != a.dtype:
            o = o.astype(a.dtype)
        fixed.append(o)
    return fixed
