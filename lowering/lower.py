"""`lower(fn, mesh, layout)`: a namedmesh program as jit(shard_map(...)) on a mesh.

The function is traced to a Graph; every value gets the layout the rules give it
(inputs and outputs must divide exactly; an intermediate whose size an axis does
not divide is left unsplit on that dim; `nm.constrain` pins a value's layout),
except that an intermediate whose dims the rules give one mesh axis twice, made
by an einsum or an elementwise op, takes the layout its rule computes it in.
Each equation is planned by its primitive's SPMD rule (lowering/rules/), which the
interpreter (lowering/interpret.py) runs on abstract local shards without jax, and
the emitter (lowering/emit.py) runs the Plan inside shard_map. This module is the
public API: `lower`, `Lowered` (`.plan()` and `.report()` show the plan: the local ops
run and the collectives issued) and the report helpers that auto_layout and the
benchmarks cost a traced program by.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

import namedmesh as nm
from lowering import cost, distributed
from lowering.caches import memo
from lowering.cost import Report
from lowering.emit import emit
from lowering.interpret import Interpreter, io_layouts, plan_program
from lowering.layout import Layout, ValueLayout, local_shape, partition_spec
from lowering.mesh import Mesh, require_mesh
from lowering.plan import Plan
from namedmesh.checks import require_arity
from namedmesh.errors import ArgumentError, MeshError
from namedmesh.tensor import Tensor
from namedmesh.uneven import pruned, scan_stages, viewed

__all__ = ["Lowered", "argument_inputs", "graph_report", "input_names", "lower", "rule_layouts"]


def rule_layouts(graph, mesh: Mesh, layout: Layout | str) -> dict:
    """{value: layout} for the traced `graph` on `mesh` before any rule runs: its inputs'
    (as the plan checks them) and, for each value its equations make, the layout the
    rules of `layout` give its dims (or `nm.constrain` pins). A value whose dims
    conflict may then be computed in another (`Lowered.layouts` gives the plan's)."""
    layout = layout if isinstance(layout, Layout) else Layout(layout)
    wanted, _ = io_layouts(graph, mesh, layout)
    Interpreter(mesh, layout, wanted).plan_layouts(graph)
    return wanted


def _jitted(body, graph, mesh: Mesh, wanted: dict, out_layouts) -> Callable:
    sharded = jax.shard_map(
        lambda *xs: body(xs),
        mesh=mesh.jax_mesh,
        in_specs=tuple(partition_spec(wanted[v]) for v in graph.inputs),
        out_specs=[partition_spec(lay) for lay in out_layouts],
    )
    return jax.jit(sharded)


def graph_report(graph, mesh: Mesh, layout: Layout, wrt=None, names=None) -> Report:
    """The cost Report of the traced program `graph` under `layout` on `mesh` (as
    `Lowered.report`), `wrt` the graph inputs a gradient is taken of, planned by the
    Planner without jax (a costing-only plan). What `auto_layout` costs each candidate
    by, the program traced once. `names`: the inputs' argument paths, for errors
    (`input_names`)."""
    wanted, out_layouts = io_layouts(graph, mesh, layout, names)
    plan = plan_program(graph, mesh, layout, wanted, out_layouts, record=False)
    return plan_report(plan, graph, wanted, mesh, wrt)


def plan_report(plan: Plan, graph, wanted: dict, mesh: Mesh, wrt=None) -> Report:
    """The cost Report of `plan`, with peak memory from the values' layouts `wanted`."""

    sizes = tuple(mesh.sizes.items())

    @functools.cache  # each value is asked for several times (peak, saved, working set)
    def local_bytes(v):
        layout = wanted.get(v)
        if layout is None:  # a value no rule laid out (a scan body's constant): whole
            layout = ((),) * len(v.dims)
        return _local_bytes(layout, v.shape, v.dtype.itemsize, sizes)

    def axes_of(v) -> frozenset:
        return frozenset(a for axes in wanted.get(v, ()) for a in axes)

    def split_of(v) -> tuple:
        dims = wanted.get(v, ((),) * len(v.dims))
        return tuple(math.prod(mesh.sizes[a] for a in axes) for axes in dims)

    cpu = not mesh.abstract and mesh.jax_mesh.devices.flat[0].platform == "cpu"
    return cost.report(plan, graph, local_bytes, mesh.sizes, wrt=wrt, axes_of=axes_of,
                       split_of=split_of, cpu=cpu)  # fmt: skip


@memo()  # the same (layout, shape) recurs in many candidate layouts
def _local_bytes(layout: ValueLayout, shape: tuple, itemsize: int, sizes: tuple) -> int:
    """Bytes of one device's shard of a value of `shape` with `layout` on a mesh of
    `sizes` (items)."""
    mesh = dict(sizes)
    split = (n // math.prod(mesh[a] for a in axes) for n, axes in zip(shape, layout, strict=True))
    return math.prod(split) * itemsize


@dataclass
class _Built:
    graph: object
    wanted: dict
    out_layouts: list
    jitted: Callable
    plan: Plan


class Lowered:
    """The callable `lower` returns; see the module docstring."""

    def __init__(self, fn: Callable, mesh: Mesh, layout: Layout | str, check: bool = False):
        if not callable(fn):
            raise ArgumentError(f"lower: the program must be a function of Tensors, got {fn!r}")
        self.fn, self.mesh, self.check_plan = fn, mesh, check
        self.layout = layout if isinstance(layout, Layout) else Layout(layout)
        self.layout.check(mesh)
        self._cache: dict = {}

    def _build(self, args):
        paths, tree = jax.tree_util.tree_flatten_with_path(list(args), is_leaf=_is_tensor)
        for path, x in paths:
            if not isinstance(x, Tensor):  # (a PaddedStack's Tensor is a leaf of it)
                shape = f" (shape {x.shape})" if hasattr(x, "shape") else ""
                raise ArgumentError(
                    f"lowered functions take Tensors (or pytrees of them), got a "
                    f"{type(x).__name__} as argument {jax.tree_util.keystr(path)}{shape}; "
                    "give it dims with nm.tensor(data, dims)"
                )
        leaves = [x for _, x in paths]
        x64 = bool(jax.config.jax_enable_x64)  # the dtype policy depends on it
        key = (tree, tuple((x.dims, x.shape, x.dtype) for x in leaves), x64)
        if key not in self._cache:
            self._cache[key] = self._plan(args)
        return [x.data for x in leaves], self._cache[key]

    def _plan(self, args) -> _Built:
        stages = self._stages()
        with scan_stages(stages) as padded:  # uneven stages: namedmesh/uneven.py
            graph = pruned(nm.trace(viewed(self.fn, stages), *args))
            names = input_names(args)
            wanted, out_layouts = io_layouts(graph, self.mesh, self.layout, names, padded)
            # (planned within: a pipeline's plan names the real layers of a padded stack)
            plan = plan_program(graph, self.mesh, self.layout, wanted, out_layouts)
        body = functools.partial(emit, plan, check=self.check_plan)
        jitted = _jitted(body, graph, self.mesh, wanted, out_layouts)
        return _Built(graph, wanted, out_layouts, jitted, plan)

    def _stages(self) -> dict:
        """{dim: (mesh axes, their size)} of the layout's rules that split a dim: a scan
        over one is a pipeline, padded where its stages are uneven."""
        sizes = self.mesh.sizes
        return {d: (axes, math.prod(sizes[a] for a in axes)) for d, axes in self.layout.rules}

    @property
    def stage_sizes(self) -> dict:
        """{dim: S}: the stages each dim a rule splits runs in, were it a scan's (a stack
        S does not divide is padded: `namedmesh.uneven.pad_stacks` pads it ahead)."""
        return {d: s for d, (_, s) in self._stages().items()}

    def _runnable(self, what: str) -> None:
        if self.mesh.abstract:
            raise MeshError(
                f"{what}: {self.mesh} has no devices; it can be planned and "
                "reported, not run or compiled"
            )

    def __call__(self, *args, **kwargs):
        """Run on global Tensors (pytrees of them), given by position; returns global
        Tensors whose data are jax.Arrays sharded as the layout says. Compiles once per
        input signature."""
        if kwargs:
            raise ArgumentError(
                f"a lowered function takes its inputs by position, got keyword(s) "
                f"{', '.join(kwargs)}: pass them in the function's order"
            )
        self._runnable("calling a lowered function")
        require_arity("a lowered function", self.fn, len(args))
        datas, built = self._build(args)
        datas = _global_inputs(datas, built, self.mesh)
        outs = built.jitted(*datas)
        tensors = [Tensor._make(o, v.dims) for o, v in zip(outs, built.graph.outputs, strict=True)]
        return jax.tree_util.tree_unflatten(built.graph.out_tree, tensors)

    def plan(self, *args) -> Plan:
        """Per equation: layouts in and out and the collectives chosen (printable)."""
        return self._build(args)[1].plan

    def layouts(self, *args) -> tuple:
        """(graph, layouts): the traced Graph and the layout the plan gives each value its
        equations make (as the rules return them), for `args`."""
        plan = self.plan(*args)
        _, built = self._build(args)
        layouts = dict(built.wanted)
        for step in plan:
            if step.eqn is not None:
                layouts.update(
                    (v, lay) for v, (_, lay) in zip(step.eqn.outputs, step.outputs, strict=True)
                )
        return built.graph, layouts

    def report(self, *args, wrt: int | tuple[int, ...] | None = None, show: bool = True) -> Report:
        """Per-device flops, collective bytes by kind and mesh axes, and estimated peak
        memory, from the plan (before compiling); printed unless `show=False`. `wrt`, the
        positions of the arguments a gradient is taken of (as jax.grad's argnums), adds
        the backward pass (lowering/cost.py)."""
        plan = self.plan(*args)
        _, built = self._build(args)
        inputs = None if wrt is None else argument_inputs(built.graph, args, wrt)
        rep = plan_report(plan, built.graph, built.wanted, self.mesh, wrt=inputs)
        if show:
            print(rep)
        return rep

    def check(self, *args) -> Plan:
        """The plan of `args`, after tracing (not compiling or running) the program the
        emitter makes of it with its check on: PlanMismatch (lowering/emit.py) at the
        first instruction whose jax value's shape, dtype or varying mesh axes differ from
        the plan's. Needs a mesh with devices."""
        self._runnable("check")
        datas, built = self._build(args)
        body = functools.partial(emit, built.plan, check=True)
        jitted = _jitted(body, built.graph, self.mesh, built.wanted, built.out_layouts)
        jax.eval_shape(jitted, *_global_inputs(datas, built, self.mesh))
        return built.plan

    def compile(self, *args):
        """The jax Compiled object (`.as_text()` is the HLO, `.cost_analysis()` the flops)."""
        self._runnable("compile")
        datas, built = self._build(args)
        datas = _global_inputs(datas, built, self.mesh)
        return built.jitted.lower(*datas).compile()

    def local_shapes(self, *args) -> list[tuple[int, ...]]:
        """Per-device shard shapes of the inputs."""
        leaves = jax.tree_util.tree_leaves(list(args), is_leaf=_is_tensor)
        return [
            local_shape(self.layout.of(x.dims, x.shape, self.mesh), x.shape, self.mesh)
            for x in leaves
        ]


def argument_inputs(graph, args, argnums, where: str = "report(wrt=...)") -> list:
    """The inputs of `graph` (traced from `args`) that the arguments at positions
    `argnums` (an int or a sequence of ints, as jax.grad's) hold; ArgumentError naming
    `where` (the call and parameter) and a position with no argument."""
    wrt = argnum_tuple(argnums, where)
    bad = [i for i in wrt if not 0 <= i < len(args)]
    if bad:
        raise ArgumentError(
            f"{where}: no argument at position {bad} of the {len(args)} given "
            f"(positions 0 to {len(args) - 1})"
        )
    counts = [len(jax.tree_util.tree_leaves(a, is_leaf=_is_tensor)) for a in args]
    starts = np.cumsum([0, *counts])
    return [v for i in wrt for v in graph.inputs[starts[i] : starts[i + 1]]]


def argnum_tuple(argnums, where: str) -> tuple[int, ...]:
    """`argnums` (an int or a sequence of ints: argument positions) as a tuple;
    ArgumentError naming `where` for anything else (a name, a bool, a float)."""
    items = (argnums,) if not isinstance(argnums, list | tuple) else tuple(argnums)
    bad = [i for i in items if not isinstance(i, int | np.integer) or isinstance(i, bool)]
    if bad:
        raise ArgumentError(
            f"{where}: argument positions are ints (as jax.grad's argnums), got {argnums!r}"
        )
    return tuple(int(i) for i in items)


def _global_inputs(datas, built, mesh) -> list:
    """With several processes, NumPy inputs as global jax.Arrays in their input layouts."""
    if jax.process_count() == 1:
        return datas
    return [
        distributed.global_array(d, built.wanted[v], mesh) if isinstance(d, np.ndarray) else d
        for d, v in zip(datas, built.graph.inputs, strict=True)
    ]


def _is_tensor(x) -> bool:
    return isinstance(x, Tensor)


def input_names(args) -> list[str]:
    """Each Tensor leaf of `args` named by its argument and path, `0:layers/attn/q`, so
    that an error about an input names the parameter, not its flattened position."""
    paths, _ = jax.tree_util.tree_flatten_with_path(list(args), is_leaf=_is_tensor)
    out = []
    for path, _ in paths:
        keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        out.append(keys[0] + (":" + "/".join(keys[1:]) if len(keys) > 1 else ""))
    return out


def lower(fn: Callable, mesh: Mesh, layout: Layout | str, check: bool = False) -> Lowered:
    """`fn` on global Tensors, run as an SPMD program on `mesh` under `layout`, its plan
    made by the Planner without jax. `check`: the emitted program holds every value it
    makes to the plan (lowering/emit.py `check_values`) as it traces."""
    return Lowered(fn, require_mesh(mesh, "lower"), layout, check)
