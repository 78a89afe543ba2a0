"""`lower(fn, mesh, layout)`: a namedmesh program as jit(shard_map(...)) on a mesh.

The function is traced to a Graph; every value gets the layout the rules give it
(inputs and outputs must divide exactly; an intermediate whose size an axis does
not divide is left unsplit on that dim). Inside shard_map each equation runs by
its primitive's SPMD rule (lowering/rules.py) on local shards, and the
collectives the rules issue are logged per equation for `.plan()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np

import namedmesh as nm
from lowering import rules
from lowering.collectives import relayout
from lowering.layout import Layout, ValueLayout, local_shape, partition_spec
from lowering.mesh import Mesh
from namedmesh.errors import LayoutError, NamedMeshError
from namedmesh.tensor import Tensor


@dataclass
class Context:
    """What a rule sees: the mesh, the layouts the planner wants, and the collective log."""

    mesh: Mesh
    layout: Layout
    wanted: dict
    entries: list = field(default_factory=list)

    @property
    def sizes(self) -> dict[str, int]:
        return self.mesh.sizes

    def log(self, kind: str, axes: tuple[str, ...], nbytes: int) -> None:
        self.entries.append((kind, tuple(axes), int(nbytes)))

    def soft_layout(self, dims, shape) -> ValueLayout:
        """The rules' layout of (dims, shape), leaving unsplit the dims an axis does not divide."""
        layout = list(self.layout.assign(dims, shape, "value"))
        for i, n in enumerate(shape):
            if n % int(np.prod([self.sizes[a] for a in layout[i]])):
                layout[i] = ()
        return tuple(layout)

    def relayout(self, x, src: ValueLayout, dst: ValueLayout):
        return relayout(x, src, dst, self.sizes, self.log)


@dataclass
class PlanStep:
    eqn: object
    layouts_in: list
    layouts_out: list
    collectives: list


class Plan(list):
    """Per equation: the layouts in and out and the collectives issued."""

    def __str__(self) -> str:
        fmt = lambda v, lay: (
            "["
            + ", ".join(
                d + (":" + ",".join(a) if a else "") for d, a in zip(v.dims, lay, strict=True)
            )
            + "]"
        )
        lines = []
        for s in self:
            ins = " ".join(fmt(v, lay) for v, lay in zip(s.eqn.inputs, s.layouts_in, strict=True))
            outs = " ".join(
                fmt(v, lay) for v, lay in zip(s.eqn.outputs, s.layouts_out, strict=True)
            )
            lines.append(f"{s.eqn.primitive.name}: {ins} -> {outs}")
            for kind, axes, nbytes in s.collectives:
                lines.append(f"    {kind} over {','.join(axes)}: {nbytes} bytes per device")
        return "\n".join(lines)


class Lowered:
    """The callable `lower` returns; see the module docstring."""

    def __init__(self, fn: Callable, mesh: Mesh, layout: Layout):
        self.fn, self.mesh = fn, mesh
        self.layout = layout if isinstance(layout, Layout) else Layout(layout)
        self.layout.check(mesh)
        self._cache: dict = {}

    def _key(self, args):
        leaves, tree = jax.tree_util.tree_flatten(list(args), is_leaf=_is_tensor)
        for x in leaves:
            if not isinstance(x, Tensor):
                raise NamedMeshError(f"lowered functions take Tensors, got a {type(x).__name__}")
        return leaves, (tree, tuple((x.dims, x.shape, x.dtype) for x in leaves))

    def _build(self, args):
        leaves, key = self._key(args)
        if key in self._cache:
            return leaves, self._cache[key]
        graph = nm.trace(self.fn, *args)
        wanted = {}
        for i, v in enumerate(graph.inputs):
            wanted[v] = self.layout.of(v.dims, v.shape, self.mesh, f"input {i}")
        ctx = Context(self.mesh, self.layout, wanted)
        for e in graph.eqns:
            for v in e.outputs:
                wanted[v] = ctx.soft_layout(v.dims, v.shape)
        out_layouts = [
            self.layout.of(v.dims, v.shape, self.mesh, f"output {i}")
            for i, v in enumerate(graph.outputs)
        ]
        plan = Plan()

        def body(*local_inputs):
            ctx.entries = []
            env = {v: (x, wanted[v]) for v, x in zip(graph.inputs, local_inputs, strict=True)}
            for v, c in graph.consts.items():
                env[v] = (jax.numpy.asarray(c), ((),) * len(v.dims))
            plan.clear()
            for e in graph.eqns:
                ctx.entries = []
                ins = [env[v] for v in e.inputs]
                outs = rules.rule_for(e.primitive)(ctx, e, ins)
                env.update(zip(e.outputs, outs, strict=True))
                plan.append(
                    PlanStep(e, [lay for _, lay in ins], [lay for _, lay in outs], ctx.entries)
                )
            ctx.entries = []
            res = [
                ctx.relayout(*env[v], lay)
                for v, lay in zip(graph.outputs, out_layouts, strict=True)
            ]
            if ctx.entries:
                plan.append(
                    PlanStep(_OutputEqn(graph.outputs), out_layouts, out_layouts, ctx.entries)
                )
            return res

        in_specs = tuple(partition_spec(wanted[v]) for v in graph.inputs)
        out_specs = [partition_spec(lay) for lay in out_layouts]
        sharded = jax.shard_map(
            body, mesh=self.mesh.jax_mesh, in_specs=in_specs, out_specs=out_specs
        )
        built = _Built(graph, in_specs, out_layouts, jax.jit(sharded), plan)
        self._cache[key] = built
        return leaves, built

    def _datas(self, leaves, built):
        return [x.data for x in leaves]

    def __call__(self, *args):
        leaves, built = self._build(args)
        outs = built.jitted(*self._datas(leaves, built))
        tensors = [Tensor._make(o, v.dims) for o, v in zip(outs, built.graph.outputs, strict=True)]
        return jax.tree_util.tree_unflatten(built.graph.out_tree, tensors)

    def plan(self, *args) -> Plan:
        """Per equation: layouts in and out and the collectives chosen (printable)."""
        leaves, built = self._build(args)
        jax.eval_shape(built.jitted, *self._datas(leaves, built))
        return built.plan

    def compile(self, *args):
        """The jax Compiled object (`.as_text()` is the HLO, `.cost_analysis()` the flops)."""
        leaves, built = self._build(args)
        return built.jitted.lower(*self._datas(leaves, built)).compile()

    def local_shapes(self, *args) -> list[tuple[int, ...]]:
        """Per-device shard shapes of the inputs."""
        leaves, built = self._build(args)
        return [
            local_shape(self.layout.of(x.dims, x.shape, self.mesh), x.shape, self.mesh)
            for x in leaves
        ]


@dataclass
class _Built:
    graph: object
    in_specs: tuple
    out_layouts: list
    jitted: Callable
    plan: Plan


@dataclass
class _OutputEqn:
    """Stands in the plan for the relayout of results to their output layouts."""

    inputs: tuple
    outputs: tuple = ()
    primitive: object = None

    def __post_init__(self):
        self.outputs = self.inputs
        self.primitive = type("P", (), {"name": "outputs"})()


def _is_tensor(x) -> bool:
    return isinstance(x, Tensor)


def lower(fn: Callable, mesh: Mesh, layout: Layout | str) -> Lowered:
    """`fn` on global Tensors, run as an SPMD program on `mesh` under `layout`."""
    if not isinstance(mesh, Mesh):
        raise LayoutError(f"lower needs a lowering.Mesh, got {type(mesh).__name__}")
    return Lowered(fn, mesh, layout)
