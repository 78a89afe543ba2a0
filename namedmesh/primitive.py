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
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np

from namedmesh.avals import TRACES, Aval, Var, is_jax_array
from namedmesh.errors import NamedMeshError
from namedmesh.tensor import Tensor


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
    # its backward pass's flops as a multiple of its forward's where not the above (a
    # fused op of several products: each product's two gradients, 2.0); None: the above
    backward_flops: float | None = None
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
    # jax's autodiff saves besides (softmax's exponentials, gelu's tanh and products); or
    # a function of the inputs (objects with .dims, .shape) and params giving that
    # number, where it depends on their shapes (a fused FFN's hidden layers)
    backward_saves: float | Callable = 0
    # and, likewise in its first input's sizes, what its backward pass makes inside it at
    # once beside those saves (a fused FFN's: the saves' cotangents and its hidden layer
    # recomputed, each a product XLA materialises), part of its working set there; an
    # elementwise op's fuse into its backward's ops (0)
    backward_working: float | Callable = 0
    # and, likewise, what its jax implementation holds inside it at once while it runs
    # forward, beside its inputs, its outputs and those saves (a fused FFN's sorted
    # rows' output and its products as made), part of the forward pass's working set
    # there (lowering/memory.py's forward walk: a step can peak in its forward pass)
    forward_working: float | Callable = 0
    # What textbook reverse mode must read at the least, where that is not
    # `backward_reads` (jax's residuals: relu's input, where its output would do): one
    # of BACKWARD_READS, or None for `backward_reads`. The memory benchmark's ideal.
    least_reads: str | None = None
    # Given the params, the NumPy function of the inputs alone (einsum: `np.matmul` itself
    # when no transpose or reshape is needed), made once per eager signature, so its
    # params must be ones whose equal values act alike (not 0.0 and -0.0); None:
    # numpy_impl with the params of each call
    numpy_kernel: Callable[..., Callable] | None = None
    # its result is a float whatever its inputs' dtype (`float_result`), computed from the
    # inputs cast to that dtype (`in_float`): NumPy, jax and the lowering's local code alike
    float_valued: bool = False
    # How the property strategies' random programs (namedmesh/testing/strategies.py) apply
    # it: `example(a, b, d, k) -> Tensor | None`, with a and b float tensors whose shared
    # dims agree in size, d one of a's dims and k a choice in 0..50 (None: not for these
    # tensors); or a str saying why random programs never draw it and what tests it;
    # None: derived from the flags (an elementwise op, through its public op)
    example: Callable[..., Any] | str | None = None

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


class Step(NamedTuple):
    """One eager NumPy bind, as an op being remembered replays it (namedmesh/eager.py)."""

    kernel: Callable  # of the input arrays
    inputs: tuple  # the Tensors bound
    aval: Aval  # of the result
    result: Any  # the Tensor made


class Recording:
    """The binds one call of an op makes in the thread `owner`: Steps, or None for a bind
    that did not run NumPy eagerly."""

    __slots__ = ("owner", "steps")

    def __init__(self, owner: int):
        self.owner, self.steps = owner, []


RECORDINGS: list[Recording] = []  # open recordings, of any thread


def _note(step: Step | None) -> None:
    me = threading.get_ident()
    for rec in RECORDINGS:
        if rec.owner == me:
            rec.steps.append(step)


def bind(prim: Primitive, *args, **params):
    """Apply `prim` to Tensors `args`: record under a trace, else run NumPy or jax."""
    make = Tensor._make
    if not TRACES.frames and (datas := _numpy_datas(args, key := [prim, *params.items()])):
        # eager NumPy, the hot path of small ops: its shape rule and kernel remembered
        key = tuple(key)
        try:
            avals, kernel = _EAGER[key]
        except (KeyError, TypeError):  # TypeError: a param that is not hashable (an array)
            avals, kernel = _remember(key, prim, args, params)
        res = prim.numpy_impl(*datas, **params) if kernel is None else kernel(*datas)
        if not prim.multiple_results:
            a = avals[0]
            if type(res) is not np.ndarray or res.dtype != a.dtype:
                res = coerce_numpy((res,), avals)[0]
            out = make(res, a.dims)
            if RECORDINGS:
                run = kernel or functools.partial(prim.numpy_impl, **params)
                _note(Step(run, args, a, out))
            return out
        outs = coerce_numpy(res, avals)
        if RECORDINGS:
            _note(None)
    else:
        if RECORDINGS:
            _note(None)
        avals = _avals(prim, args, params)
        if frames := TRACES.frames:
            outs = frames[-1].record(prim, args, params, avals)
        else:
            outs = _run_eager(prim, [a.data for a in args], params, avals)
    if not prim.multiple_results:
        return make(outs[0], avals[0].dims)
    return tuple(make(o, a.dims) for o, a in zip(outs, avals, strict=True))


def _run_eager(prim: Primitive, datas, params, avals) -> tuple:
    """The outputs of `prim` on concrete data: jax where any input is a jax array, else NumPy
    held to the shape rule's dtypes; NamedMeshError for a tensor of a finished trace."""
    for d in datas:
        if isinstance(d, Var):
            raise NamedMeshError(
                f"{prim.name}: a tensor {d!r} from a finished nm.trace was used outside it"
            )
    if any(is_jax_array(d) for d in datas):
        res = prim.jax_impl(*datas, **params)
        return _coerce_jax(res if prim.multiple_results else (res,), avals)
    res = prim.numpy_impl(*datas, **params)
    return coerce_numpy(res if prim.multiple_results else (res,), avals)


def _coerce_jax(outs, avals):
    """jax promotes some dtypes NumPy keeps (a bool's square, relu or power is int32 in
    jax, bool in NumPy and in the shape rule): hold it to the shape rule's dtype, as the
    lowering's local ops are (lowering/emit.py), so eager jax, jit and lowered agree."""
    canonical = jax.dtypes.canonicalize_dtype
    return [o if o.dtype == canonical(a.dtype) else o.astype(a.dtype) for o, a in
            zip(outs, avals, strict=True)]  # fmt: skip


def coerce_numpy(outs, avals) -> list:
    """NumPy widens some dtypes (int32 sums become int64); hold it to the shape rule's dtype."""
    fixed = []
    for o, a in zip(outs, avals, strict=True):
        if type(o) is not np.ndarray:
            o = np.asarray(o)
        if o.dtype != a.dtype:
            o = o.astype(a.dtype)
        fixed.append(o)
    return fixed


def _avals(prim: Primitive, args, params) -> tuple[Aval, ...]:
    """The shape rule's output avals, always as a tuple."""
    out = prim.shape_rule(*args, **params)
    return out if prim.multiple_results else (out,)


# Eager NumPy ops: the shape rule's answer and the NumPy kernel per (primitive, params,
# input dims, shapes and dtypes). A shape rule reads nothing else, and raises rather than
# answers on bad input, so a hit skips only work whose outcome is known; a loop of small
# eager ops spends most of its time there otherwise. Bounded: cleared when full.
_EAGER: dict = {}
_EAGER_MAX = 4096


def _numpy_datas(args, key: list) -> list | None:
    """The inputs' data when every one is a NumPy array, else None; adds each input's
    dims, shape and dtype to `key` (the op's `_EAGER` key)."""
    datas = []
    for a in args:
        d = a.data
        if type(d) is not np.ndarray:
            return None
        datas.append(d)
        key += (a.dims, d.shape, d.dtype)
    return datas


def _remember(key: tuple, prim: Primitive, args, params) -> tuple[tuple[Aval, ...], Any]:
    """(output avals, NumPy kernel of the inputs or None) of an eager op, kept under `key`."""
    avals = _avals(prim, args, params)
    kernel = None if prim.numpy_kernel is None else prim.numpy_kernel(**params)
    if kernel is not None and prim.float_valued and not all(_is_inexact(a.dtype) for a in args):
        kernel = in_float(kernel)  # the kernel is the op's own, without numpy_impl's casts
    try:
        if len(_EAGER) >= _EAGER_MAX:
            _EAGER.clear()
        _EAGER[key] = avals, kernel
    except TypeError:  # a param that is not hashable (an array): not remembered
        pass
    return avals, kernel
