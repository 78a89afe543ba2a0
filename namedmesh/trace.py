"""`trace`: record a function on Tensors as a `Graph`; `reference`: run a Graph on NumPy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from namedmesh.avals import TRACES, Aval, Var, fmt_aval
from namedmesh.checks import require_arity
from namedmesh.errors import ArgumentError, NamedMeshError, TracedValueError
from namedmesh.primitive import Primitive, coerce_numpy
from namedmesh.tensor import Tensor, native_order


@dataclass(frozen=True, eq=False)
class Eqn:
    """One primitive applied: `outputs = primitive(*inputs, **params)`."""

    primitive: Primitive
    inputs: tuple[Var, ...]
    outputs: tuple[Var, ...]
    params: dict[str, Any]


@dataclass(eq=False)
class Graph:
    """A flat program: inputs, equations in order, outputs, and captured constants.

    `in_tree`/`out_tree` are the pytree structures of the traced function's arguments
    and result; `inputs`/`outputs` are their Tensor leaves in flattened order.
    """

    inputs: tuple[Var, ...]
    outputs: tuple[Var, ...]
    eqns: list[Eqn]
    in_tree: Any
    out_tree: Any
    consts: dict[Var, Any] = field(default_factory=dict)

    def values(self) -> list[Var]:
        """Every value of the graph: inputs, constants, equation outputs, and those of
        the graphs inside equations (a scan's body), in order."""
        out = [*self.inputs, *self.consts]
        for e in self.eqns:
            for p in e.params.values():
                if isinstance(p, Graph):
                    out.extend(p.values())
            out.extend(e.outputs)
        return out

    def __str__(self) -> str:
        names = {v: f"c{i}" for i, v in enumerate(self.consts)}
        for v in (*self.inputs, *(o for e in self.eqns for o in e.outputs)):
            names.setdefault(v, _letters(len(names) - len(self.consts)))
        decl = lambda v: f"{names[v]}: {fmt_aval(v.aval)}"
        lines = ["graph(" + ", ".join(decl(v) for v in self.inputs) + ") {"]
        for v, c in self.consts.items():
            lines.append(f"  {decl(v)} = const {_short(c)}")
        for e in self.eqns:
            outs = ", ".join(decl(v) for v in e.outputs)
            shown = {
                k: p for k, p in e.params.items() if k not in _DERIVED_PARAMS and p is not None
            }  # None: an option left at its default
            params = " ".join(f"{k}={_short(p)}" for k, p in shown.items())
            args = ", ".join(names[v] for v in e.inputs)
            lines.append(f"  {outs} = {e.primitive.name}({args}){'  ' + params if params else ''}")
        lines.append("  return " + ", ".join(names[v] for v in self.outputs))
        lines.append("}")
        return "\n".join(lines)

    __repr__ = __str__


# Params that restate the dims of an equation's inputs or outputs, or its pytrees; not printed.
_DERIVED_PARAMS = {"in_dims", "out_dims", "dims", "trees"}


def _letters(i: int) -> str:
    s = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        s = chr(97 + r) + s
    return s


def _short(p) -> str:
    if isinstance(p, Graph):
        return str(p).replace("\n", "\n    ")
    if isinstance(p, np.ndarray | jax.Array):
        return f"<{p.dtype}{list(p.shape)}>" if p.size > 4 else np.array2string(np.asarray(p))
    if isinstance(p, np.dtype):
        return p.name
    if isinstance(p, tuple) and p and all(isinstance(q, str) for q in p):
        return "(" + ",".join(p) + ")"
    return repr(p)


def _is_tensor(x) -> bool:
    return isinstance(x, Tensor)


class _Frame:
    """One nm.trace in progress. A nested frame (the body of `nm.scan`) may use tensors
    of the frames around it: each becomes an extra input of its graph (`captured`)."""

    def __init__(self, inputs: tuple[Var, ...], parent: _Frame | None = None):
        self.eqns: list[Eqn] = []
        self.consts: dict[Var, Any] = {}
        self.const_ids: dict[int, Var] = {}
        self.known: set[Var] = set(inputs)
        self.parent = parent
        self.captured: dict[Var, Var] = {}  # the outer frame's var -> this frame's input

    def knows(self, v: Var) -> bool:
        return v in self.known or (self.parent is not None and self.parent.knows(v))

    def var_of(self, t: Tensor) -> Var:
        d = t.data
        if isinstance(d, Var):
            if d in self.known:
                return d
            if d not in self.captured:
                if self.parent is None or not self.parent.knows(d):
                    raise NamedMeshError(
                        f"a tensor {d!r} from another nm.trace was used in this one"
                    )
                self.captured[d] = Var(d.aval)
            return self.captured[d]
        v = self.const_ids.get(id(d))
        if v is None:
            v = Var(Aval(t.dims, tuple(d.shape), np.dtype(d.dtype)))
            self.consts[v] = d
            self.const_ids[id(d)] = v
        return v

    def record(self, prim, args, params, avals):
        ins = tuple(self.var_of(a) for a in args)
        outs = tuple(Var(a) for a in avals)
        self.known.update(outs)
        self.eqns.append(Eqn(prim, ins, outs, dict(params)))
        return outs


def tensor_leaves(tree, what: str) -> tuple[list[Tensor], Any]:
    """The Tensors of a pytree and its treedef; an ArgumentError naming `what` for any
    other leaf."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_tensor)
    for x in leaves:
        if not isinstance(x, Tensor):
            raise ArgumentError(
                f"{what} must be Tensors (or pytrees of them), got a {type(x).__name__}"
            )
    return leaves, treedef


def _run_user_fn(fn: Callable, args):
    """`fn(*args)`; a TracedValueError when `fn` handed a traced value's data (a `Var`)
    to jax or to an operator: a computation that namedmesh cannot record. An
    ArgumentError first when `fn` cannot take that many arguments."""
    require_arity("trace", fn, len(args))
    try:
        return fn(*args)
    except (TypeError, ValueError, AttributeError) as e:  # (t.data.reshape: AttributeError)
        if isinstance(e, NamedMeshError) or not _mentions_var(e):
            raise
        raise TracedValueError(
            f"{getattr(fn, '__name__', 'the traced function')}: a traced Tensor's .data (an "
            "abstract Var with no values) reached a computation that namedmesh does not "
            "record, such as jax.numpy or an operator on .data. Use the named ops on the "
            "Tensor itself (nm.exp(t), t + 1, nm.einsum, ...), or add the op as a "
            "primitive: namedmesh.primitive.primitive(name, shape_rule, numpy_impl, "
            "jax_impl), applied with nm.bind (docs/language.md, 'Primitives'). The error "
            f"was: {type(e).__name__}: {str(e).splitlines()[0]}"
        ) from e


def _mentions_var(e: BaseException) -> bool:
    text = str(e)
    return "Var(" in text or "'Var'" in text


def trace(fn: Callable, *example_inputs) -> Graph:
    """Record `fn(*example_inputs)` as a Graph. Only the inputs' dims, sizes and dtypes
    matter; their values are not read. Inputs and result may be pytrees of Tensors."""
    graph, _ = trace_nested(fn, *example_inputs, nested=False)
    return graph


def trace_nested(fn: Callable, *example_inputs, nested: bool = True) -> tuple[Graph, list[Var]]:
    """`trace`, inside the trace in progress if any (`nested`): tensors of the outer
    traces that `fn` uses become extra graph inputs, after the example inputs; returns
    the graph and those outer tensors' Vars, in the same order."""
    if not callable(fn):
        raise ArgumentError(f"trace: the program must be a function of Tensors, got {fn!r}")
    leaves, in_tree = tensor_leaves(list(example_inputs), "trace inputs")
    in_vars = tuple(Var(x.aval) for x in leaves)
    stack = TRACES.frames  # this thread's
    frame = _Frame(in_vars, stack[-1] if nested and stack else None)
    stack.append(frame)
    try:
        args = jax.tree_util.tree_unflatten(in_tree, [Tensor._make(v, v.dims) for v in in_vars])
        result = _run_user_fn(fn, args)
        out_leaves, out_tree = tensor_leaves(result, "the traced function's results")
        outs = tuple(frame.var_of(t) for t in out_leaves)
    finally:
        stack.pop()
    inputs = in_vars + tuple(frame.captured.values())
    graph = Graph(inputs, outs, frame.eqns, in_tree, out_tree, frame.consts)
    return graph, list(frame.captured)


def evaluate(graph: Graph, inputs: list, impl: str = "numpy", each=None) -> list:
    """Run the graph's equations on flat input arrays with each primitive's `impl`
    ("numpy" or "jax"); returns the flat output arrays. `each(var, array)`, if given,
    replaces every value an equation makes (e.g. with a sharding constraint)."""
    env: dict[Var, Any] = dict(graph.consts)
    for v, x in zip(graph.inputs, inputs, strict=True):
        env[v] = x
    for e in graph.eqns:
        fn = e.primitive.numpy_impl if impl == "numpy" else e.primitive.jax_impl
        res = fn(*(env[v] for v in e.inputs), **e.params)
        res = res if e.primitive.multiple_results else (res,)
        if impl == "numpy":
            res = coerce_numpy(res, [v.aval for v in e.outputs])
        if each is not None:
            res = [each(v, r) for v, r in zip(e.outputs, res, strict=True)]
        env.update(zip(e.outputs, res, strict=True))
    return [env[v] for v in graph.outputs]


def _runner(graph: Graph, impl: str, convert) -> Callable:
    def run(*inputs):
        flat, tree = jax.tree_util.tree_flatten(list(inputs), is_leaf=_is_tensor)
        if tree != graph.in_tree:
            raise NamedMeshError(
                f"the graph takes arguments shaped like {graph.in_tree}, got {tree}"
            )
        arrays = []
        for v, x in zip(graph.inputs, flat, strict=True):
            if isinstance(x, Tensor):
                if x.dims != v.dims:
                    raise NamedMeshError(f"input has dims {x.dims}, the graph expects {v.dims}")
                x = x.data
            x = convert(x)
            if tuple(x.shape) != v.shape:
                raise NamedMeshError(
                    f"input of shape {tuple(x.shape)} given for {fmt_aval(v.aval)}"
                )
            arrays.append(x)
        outs = evaluate(graph, arrays, impl)
        tensors = [Tensor._make(o, v.dims) for o, v in zip(outs, graph.outputs, strict=True)]
        return jax.tree_util.tree_unflatten(graph.out_tree, tensors)

    return run


def reference(graph: Graph) -> Callable:
    """A function that runs `graph` with NumPy only: the oracle of correctness tests.
    It takes the traced function's arguments (Tensors, or arrays in their place)."""
    return _runner(graph, "numpy", lambda x: native_order(np.asarray(x)))


def interpret(graph: Graph) -> Callable:
    """A function that runs `graph` with each primitive's jax.numpy implementation."""
    import jax.numpy as jnp

    native = lambda x: native_order(x) if isinstance(x, np.ndarray) else x
    return _runner(graph, "jax", lambda x: jnp.asarray(native(x)))
