"""Eager NumPy calls of the public ops, remembered per signature.

What an op's Python wrapper does before its primitives run (parse dims, check them,
work out params, align operands) depends only on its arguments' dims, shapes and
dtypes and its other arguments; what its primitives do then is `bind`'s eager NumPy
path (namedmesh/primitive.py), whose shape rule answers and kernels are remembered
already. So the first call of an op decorated with `remembered` on NumPy-backed
Tensors records the binds it makes, and a later call with the same signature replays
them on the new arrays: the kernels alone, each result held to its shape rule's dtype
as `bind` holds it, one Tensor made at the end. Anything else (a trace, jax data, an
argument of another kind, a DimNameWarning, a result that is not the last bind's)
runs the op itself, every time.
"""

from __future__ import annotations

import functools
import operator
import threading

import numpy as np

from namedmesh import checks
from namedmesh.avals import TRACES
from namedmesh.primitive import RECORDINGS, Recording, coerce_numpy
from namedmesh.tensor import Tensor

_CALLS: dict = {}
_CALLS_MAX = 4096  # bounded: cleared when full


class _Unsupported(Exception):
    """An argument the signature cannot stand for: the op runs itself."""


def _sig(a, key: list, datas: list) -> None:
    """Add `a` to `key` (its dims, shape and dtype for a NumPy-backed Tensor, else its type
    and value) and a Tensor's array to `datas`."""
    if type(a) is Tensor:
        d = a.data
        if type(d) is not np.ndarray:
            raise _Unsupported
        key += (a.dims, d.shape, d.dtype)
        datas.append(d)
    elif a is None or type(a) in (str, int, bool):
        key += (type(a), a)
    elif type(a) is float:  # by its bits: 0.0 and -0.0 are equal but act apart
        key += (float, a.hex())
    elif type(a) in (tuple, list):
        key.append((type(a), len(a)))
        for x in a:
            _sig(x, key, datas)
    elif type(a) is dict:
        key.append((dict, len(a)))
        for k, v in a.items():
            _sig(k, key, datas)
            _sig(v, key, datas)
    elif type(a) is slice:
        parts = (slice, a.start, a.stop, a.step)
        for x in parts[1:]:
            if x is not None and type(x) is not int:
                raise _Unsupported
        key += parts
    elif type(a) is type or isinstance(a, np.dtype):  # a dtype argument
        key += (type(a), a)
    else:
        raise _Unsupported


def signature(op, args, kwargs) -> tuple[tuple, list] | None:
    """(key, arrays of the Tensor arguments in order) of a call of `op`, or None where
    the call cannot be remembered."""
    key, datas = [op], []
    try:
        for a in args:
            if type(a) is Tensor and type(d := a.data) is np.ndarray:  # the usual case, inline
                key += (a.dims, d.shape, d.dtype)
                datas.append(d)
            else:
                _sig(a, key, datas)
        if kwargs:
            _sig(kwargs, key, datas)
    except _Unsupported:
        return None
    return tuple(key), datas


def remembered(op):
    """`op` with its eager NumPy calls remembered per signature (module docstring); an
    op that reads its Tensors' values (not only their dims, shapes and dtypes) to make
    params must not be decorated."""
    new, ndarray = object.__new__, np.ndarray

    @functools.wraps(op)
    def run(*args, **kwargs):
        if TRACES.frames or RECORDINGS:
            return op(*args, **kwargs)
        if (  # two Tensors, as `x + y`: the signature's key built inline
            len(args) == 2
            and not kwargs
            and type(x := args[0]) is Tensor
            and type(y := args[1]) is Tensor
            and type(dx := x.data) is ndarray
            and type(dy := y.data) is ndarray
        ):
            key, datas = (op, x.dims, dx.shape, dx.dtype, y.dims, dy.shape, dy.dtype), (dx, dy)
        elif (  # a Tensor and a float, as `x * 0.5`
            len(args) == 2
            and not kwargs
            and type(x := args[0]) is Tensor
            and type(args[1]) is float
            and type(dx := x.data) is ndarray
        ):
            key, datas = (op, x.dims, dx.shape, dx.dtype, float, args[1].hex()), (dx,)
        elif (sig := signature(op, args, kwargs)) is not None:
            key, datas = sig
        else:
            return op(*args, **kwargs)
        call = _CALLS.get(key)
        if type(call) is tuple:  # the usual case, inline: one kernel of the inputs in order
            kernel, aval, dims = call
            res = kernel(*datas)
            if type(res) is not ndarray or (
                (dt := res.dtype) is not aval.dtype and dt != aval.dtype
            ):
                res = coerce_numpy((res,), (aval,))[0]
            t = new(Tensor)
            t.data, t.dims = res, dims
            return t
        if call is None:
            return _record(op, key, datas, args, kwargs)
        if type(call) is int:  # the op returns its input of this index, as it is
            return _inputs(args, kwargs)[call]
        return call(datas)

    return run


def _record(op, key, datas, args, kwargs):
    rec = Recording(threading.get_ident())
    warned = checks.NEAR_MISSES_WARNED[0]
    RECORDINGS.append(rec)
    try:
        out = op(*args, **kwargs)
    finally:
        RECORDINGS.remove(rec)
    if checks.NEAR_MISSES_WARNED[0] == warned:
        call = _replay(rec.steps, args, kwargs, out)
        if call is not None:
            if len(_CALLS) >= _CALLS_MAX:
                _CALLS.clear()
            _CALLS[key] = call
    return out


def _inputs(args, kwargs) -> list[Tensor]:
    """The Tensor arguments, in the order `signature` lists their arrays."""
    found: list[Tensor] = []

    def walk(a):
        if type(a) is Tensor:
            found.append(a)
        elif type(a) in (tuple, list):
            for x in a:
                walk(x)
        elif type(a) is dict:
            for k, v in a.items():
                walk(k)
                walk(v)

    walk(args)
    walk(kwargs)
    return found


def _replay(steps, args, kwargs, out):
    """The function of the inputs' arrays that makes `out` again by `steps` (bind's
    records: kernel, input Tensors, result avals, result Tensor), or None where `out`
    is not the last step's result or a step is not a NumPy one."""
    inputs = _inputs(args, kwargs)
    # values by where they come from: ("in", i) the i-th input, ("const", j) the j-th
    # Tensor the op made from its other arguments (a scalar's), ("step", k) a result
    made = {id(t): ("in", i) for i, t in enumerate(inputs)}
    if len(made) < len(inputs):  # `x * x`: which position a step read is not known
        return None
    if not steps:
        return next((i for i, t in enumerate(inputs) if t is out), None)
    if any(s is None for s in steps) or steps[-1].result is not out:
        return None
    consts: list = []
    for k, step in enumerate(steps):
        for t in step.inputs:
            if id(t) not in made:
                made[id(t)] = ("const", len(consts))
                consts.append(t.data)
        made[id(step.result)] = ("step", k)
    if any(out.data is c or type(c) is not np.ndarray or c.ndim for c in consts):
        return None  # only a scalar's 0-d array is a constant of the call, and not returned
    # run on `inputs + consts + results so far`
    base = {"in": 0, "const": len(inputs), "step": len(inputs) + len(consts)}
    program = [
        ([base[w] + i for w, i in (made[id(t)] for t in s.inputs)], s.kernel, s.aval) for s in steps
    ]
    return _program(program, consts, len(inputs), out.dims)


def _held(res, aval):
    """`res` held to `aval`'s dtype as an ndarray, as bind holds a NumPy result."""
    if type(res) is not np.ndarray or res.dtype != aval.dtype:
        res = coerce_numpy((res,), (aval,))[0]
    return res


def _tensor(data, dims) -> Tensor:
    t = object.__new__(Tensor)
    t.data, t.dims = data, dims
    return t


def _program(program, consts, n_in, dims):
    if len(program) == 1 and program[0][0] == list(range(n_in)):
        ((_, kernel, aval),) = program
        return kernel, aval, dims  # run inline by `remembered`

    if len(program) == 1:  # one kernel of the inputs and constants
        ((refs, kernel, aval),) = program
        pick = operator.itemgetter(*refs)
        if len(refs) == 1:
            return lambda datas: _tensor(_held(kernel(pick([*datas, *consts])), aval), dims)
        return lambda datas: _tensor(_held(kernel(*pick([*datas, *consts])), aval), dims)

    steps = [
        (operator.itemgetter(*refs), len(refs) == 1, kernel, aval) for refs, kernel, aval in program
    ]

    def run(datas):
        vals = [*datas, *consts]
        for pick, single, kernel, aval in steps:
            vals.append(_held(kernel(pick(vals)) if single else kernel(*pick(vals)), aval))
        return _tensor(vals[-1], dims)

    return run
