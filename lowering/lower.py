"""`lower(fn, mesh, layout)`: a namedmesh program as jit(shard_map(...)) on a mesh.

The function is traced to a Graph; every value gets the layout the rules give it
(inputs and outputs must divide exactly; an intermediate whose size an axis does
not divide is left unsplit on that dim; `nm.constrain` pins a value's layout),
except that an intermediate whose dims the rules give one mesh axis twice, made
by an einsum or an elementwise op, takes the layout its rule computes it in.
Each equation is planned by its primitive's SPMD rule (lowering/rules/): `plan_program`
runs the rules in the `Planner` on abstract local shards, without jax, and the
emitter (lowering/emit.py) runs the Plan inside shard_map. `.plan()` and `.report()`
show the plan: the local ops run and the collectives issued.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

import namedmesh as nm
from lowering import cost, distributed, rules
from lowering.caches import memo, per_object
from lowering.cost import Report
from lowering.emit import emit
from lowering.layout import Layout, ValueLayout, check_axes, local_shape, partition_spec
from lowering.mesh import Mesh, require_mesh
from lowering.plan import (
    Collective,
    Local,
    Plan,
    Planner,
    RuleContext,
    Step,
    constant,
    local_avals,
    nontrivial,
)
from namedmesh.errors import ArgumentError, DtypeError, MeshError, fmt_dims
from namedmesh.tensor import Tensor

__all__ = ["Collective", "Lowered", "Plan", "Planner", "Step", "lower", "plan_program"]


def constraint_layout(rules_, v, mesh) -> ValueLayout:
    """The layout `nm.constrain` pins: its rules alone (other dims replicated), strictly.
    nm.constrain checked them but for the mesh: a LayoutError names the constraint and
    its rule that names an axis `mesh` lacks."""
    layout = Layout(rules_, strict=True)
    check_axes(layout.rules, mesh, f"nm.constrain({fmt_dims(v.dims, v.shape)}, {str(layout)!r})")
    return nontrivial(layout.of(v.dims, v.shape, mesh, "constrained value"), mesh)


def check_dtypes(graph) -> None:
    """The 64-bit policy (docs/lowering.md): with jax_enable_x64 on, 64-bit values are
    computed in 64 bits, as nm.reference computes them; with it off, jax would compute
    them in 32 bits and change the answer, so a DtypeError names the first such value
    (an input, a constant, or the op that makes it) before anything compiles."""
    _check_dtypes(graph, jax.dtypes.canonicalize_dtype(np.float64) == np.float64)


@per_object  # once per program and 64-bit setting, for all the candidates of a search
def _check_dtypes(graph, x64: bool) -> None:
    made = {v: f"input {i}" for i, v in enumerate(graph.inputs)}
    made.update((v, "a constant") for v in graph.consts)
    for e in graph.eqns:
        made.update((v, f"the result of {e.primitive.name}") for v in e.outputs)
    for v in graph.values():
        dt = np.dtype(v.dtype)
        if dt.kind in "iufc" and jax.dtypes.canonicalize_dtype(dt) != dt:
            what = made.get(v, "a value inside a scan")
            raise DtypeError(
                f"{what} {fmt_dims(v.dims, v.shape)} is {dt}, which jax computes as "
                f"{jax.dtypes.canonicalize_dtype(dt)} while jax_enable_x64 is off; cast it "
                f"(nm.astype(t, np.{jax.dtypes.canonicalize_dtype(dt)})) or turn 64-bit on "
                "(jax.config.update('jax_enable_x64', True), or `with jax.enable_x64(True):`)"
            )


def plan_layouts(ctx: RuleContext, graph) -> None:
    """The layout each value made by `graph`'s equations should have, into `ctx.wanted`:
    the rules' (soft) layout, or the one `nm.constrain` pins. Values whose dims conflict
    (two of them take one mesh axis) go into `ctx.free` too: the einsum and elementwise
    rules replace their rule-order layout by the one they compute them in."""
    by_shape, pinned = _values_by_shape(graph)
    conflicts: dict = {}  # by dims: the same dims recur in many shapes
    for (dims, shape), values in by_shape.items():
        ctx.wanted.update(dict.fromkeys(values, ctx.soft_layout(dims, shape)))
        if dims not in conflicts:
            conflicts[dims] = ctx.layout.conflicts(dims, ctx.sizes)
        if conflicts[dims]:
            ctx.free.update(values)
    for v, layout in pinned:
        ctx.wanted[v] = constraint_layout(layout, v, ctx.mesh)
        ctx.free.discard(v)


@per_object
def _values_by_shape(graph) -> tuple[dict, list]:
    """({(dims, shape): the values `graph`'s equations make with them}, [(value, layout
    it is pinned to by nm.constrain)]): what `plan_layouts` assigns per candidate, found
    once per program (a Transformer's values share a few dims and shapes)."""
    by_shape: dict = {}
    for e in graph.eqns:
        for v in e.outputs:
            by_shape.setdefault((v.dims, v.shape), []).append(v)
    pinned = [(e.outputs[0], e.params["layout"]) for e in graph.eqns if e.primitive.pins_layout]
    return by_shape, pinned


def rule_layouts(graph, mesh: Mesh, layout: Layout | str) -> dict:
    """{value: layout} for the traced `graph` on `mesh` before any rule runs: its inputs'
    (as `io_layouts` checks them) and, for each value its equations make, the layout
    the rules of `layout` give its dims (or `nm.constrain` pins). A value whose dims
    conflict may then be computed in another (`Lowered.layouts` gives the plan's)."""
    layout = layout if isinstance(layout, Layout) else Layout(layout)
    wanted, _ = io_layouts(graph, mesh, layout)
    plan_layouts(Planner(mesh, layout, wanted), graph)
    return wanted


def cost_own_arithmetic(ctx: RuleContext, e, ins, outs) -> None:
    """Where a rule computed equation `e` with its own jax arithmetic, not by `ctx.local`
    (a softmax, logsumexp or top_k along a split dim, random), cost it all the same: by
    the primitive's cost rule on the local shards the rule took (`ins`) and gave (`outs`).
    A scan is costed by its body's steps. Ops with no input (full, iota: each device
    makes its block of a constant) stay uncosted, as the benchmarks' hand counts of the
    models' work assume."""
    if not e.inputs or ctx.step.local or ctx.step.body:
        return
    arrays, results = [x for x, _ in ins], [y for y, _ in outs]
    cost = e.primitive.cost_rule(
        local_avals(e.inputs, arrays), local_avals(e.outputs, results), e.params
    )
    if cost.flops:  # a relayout alone (constrain) has no arithmetic to cost or show
        ctx.note_local(e.primitive, e.params, arrays, results, "computed by the rule:")


def run_graph(ctx: RuleContext, graph, env: dict, plan: list, repeat: int = 1, depth: int = 0):
    """Run `graph`'s equations on local shards (`Local`s) by their SPMD rules in the
    Planner `ctx`. `env` maps each input Var to (local value, layout) and receives every
    value made; each equation's Step (then the Steps of a scan's body) is appended to
    `plan`."""
    note_source = ctx.note_source
    for v, c in graph.consts.items():
        env[v] = (constant(c), ((),) * len(v.dims))
    for v, (x, _) in env.items():
        note_source(x, v)
    for e in graph.eqns:
        ins = [env[v] for v in e.inputs]
        ctx.step = step = _step(ctx, e, ins, repeat, depth)
        # An op that combines its inputs makes them all vary where any does. Cast before
        # moving, so that the backward pass sums a gathered value's gradient over those
        # axes after the reduce-scatter, on the smaller shard.
        if e.primitive.combines_inputs:
            ctx.combined = set().union(*[ctx.vma(x) for x, _ in ins])
        elif ctx.combined:
            ctx.combined = set()
        outs = rules.rule_for(e.primitive)(ctx, e, ins)
        if len(outs) != len(e.outputs):
            raise ValueError(f"the rule of {e.primitive.name} gave {len(outs)} results for "
                             f"{len(e.outputs)}")  # fmt: skip
        if not step.local and not step.body:  # (most steps ran a local op: no call)
            cost_own_arithmetic(ctx, e, ins, outs)
        # (indexes, not zip: zip's keyword strict= alone cost a search 3% of its time)
        step.outputs = [(v.dims, outs[i][1]) for i, v in enumerate(e.outputs)]
        plan.append(step)
        if step.body:
            plan.extend(step.body)
        for i, v in enumerate(e.outputs):
            env[v] = outs[i]
            note_source(outs[i][0], v)


def _step(ctx: RuleContext, e, ins: list, repeat: int, depth: int) -> Step:
    """The Step of equation `e`, its inputs (local value, layout) `ins`. A costing-only
    plan's (`ctx.record` False) holds no layouts in and no events, and shares empty
    tuples for the collectives and casts most steps do not issue (`RuleContext.log` makes
    the list), the scans' body and the instructions (which only a scan's step records):
    a search's candidates then make few objects each for the collector to trace."""
    if ctx.record:
        shown = [(v.dims, x[1]) for v, x in zip(e.inputs, ins, strict=True)]
        return Step(e.primitive.name, e, shown, [], repeat=repeat, depth=depth)
    ops = [] if e.primitive.loop else ()
    return Step(e.primitive.name, e, (), (), collectives=(), casts=(), events=(), body=(),
                ops=ops, repeat=repeat, depth=depth)  # fmt: skip


def io_layouts(graph, mesh: Mesh, layout: Layout, names=None) -> tuple[dict, list]:
    """(layout by input value, layouts of the outputs) of `graph` under `layout`, after
    checking its dtypes and that the rules name its dims; LayoutError for an input or
    output (named by `names`, the inputs' argument paths) its axes do not divide."""
    check_dtypes(graph)
    layout.check_dims(_dims(graph))
    layout.check(mesh)  # (what `layout.of` checks first, which a kept layout skips)
    names = names or [str(i) for i in range(len(graph.inputs))]
    # by (dims, shape): a model's parameters share a few. A value's layout is found (and
    # checked) at the first value with its dims and shape, so an error names that one
    known: dict = {}
    kept = _kept_layouts(mesh)

    def of(v, kind: str, name) -> ValueLayout:
        key = (v.dims, v.shape)
        if key not in known:
            # the rules of its dims decide it: kept by them for the candidates that share
            # them (one that failed its checks was not kept, and fails them again here)
            rules = (tuple(r for r in layout.rules if r[0] in v.dims), layout.strict, *key)
            if rules not in kept:
                kept[rules] = nontrivial(layout.of(*key, mesh, f"{kind} {name}"), mesh)
            known[key] = kept[rules]
        return known[key]

    wanted = {v: of(v, "input", names[i]) for i, v in enumerate(graph.inputs)}
    return wanted, [of(v, "output", i) for i, v in enumerate(graph.outputs)]


@per_object(kind="layouts")
def _kept_layouts(mesh: Mesh) -> dict:
    """{(the rules of a value's dims, strict, dims, shape): its layout on `mesh`}, for
    `io_layouts`."""
    return {}


@per_object
def _dims(graph) -> frozenset:
    """Every dim of `graph`'s values (its scans' bodies' too)."""
    return frozenset(d for v in graph.values() for d in v.dims)


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

    return cost.report(plan, graph, local_bytes, mesh.sizes, wrt=wrt)


@memo()  # the same (layout, shape) recurs in many candidate layouts
def _local_bytes(layout: ValueLayout, shape: tuple, itemsize: int, sizes: tuple) -> int:
    """Bytes of one device's shard of a value of `shape` with `layout` on a mesh of
    `sizes` (items)."""
    mesh = dict(sizes)
    split = (n // math.prod(mesh[a] for a in axes) for n, axes in zip(shape, layout, strict=True))
    return math.prod(split) * itemsize


def relayout_outputs(ctx: RuleContext, graph, env: dict, out_layouts, plan: list) -> list:
    """The program's outputs moved to their layouts, each typed invariant over the mesh
    axes its layout does not split (a psum of device 0's copy where it still varies);
    the step that does it joins `plan` when it issues anything."""
    ctx.combined = set()
    ctx.step = Step(
        "outputs",
        None,
        [(v.dims, env[v][1]) for v in graph.outputs],
        [(v.dims, lay) for v, lay in zip(graph.outputs, out_layouts, strict=True)],
    )
    res = []
    for v, lay in zip(graph.outputs, out_layouts, strict=True):
        y = ctx.relayout(*env[v], lay)
        extra = ctx.vma(y) - {a for axes in lay for a in axes}
        res.append(ctx.make_invarying(y, tuple(extra)))
    if ctx.step.collectives or ctx.step.casts:
        plan.append(ctx.step)
    return res


def plan_program(
    graph, mesh: Mesh, layout: Layout, wanted: dict, out_layouts: list, record: bool = True
) -> Plan:
    """The Plan of `graph` on `mesh` under `layout`, in plain Python (no jax): `wanted`
    holds the inputs' layouts and receives every value's; `out_layouts` are the
    outputs'. `record`
    False: a plan for the cost report alone, without the steps' events text, the
    emitter's instructions and `program` (the same layouts, local ops and collectives)."""
    ctx = Planner(mesh, layout, wanted, record=record)
    plan_layouts(ctx, graph)
    plan = Plan()
    plan.inputs = [Local(local_shape(wanted[v], v.shape, mesh), np.dtype(v.dtype),
                         _axes_of(wanted[v]))
                   for v in graph.inputs]  # fmt: skip
    env = {v: (x, wanted[v]) for v, x in zip(graph.inputs, plan.inputs, strict=True)}
    run_graph(ctx, graph, env, plan)
    plan.consts = {env[v][0]: c for v, c in graph.consts.items()}
    plan.outputs = relayout_outputs(ctx, graph, env, out_layouts, plan)
    if not record:  # nothing emits a costing-only plan
        return plan
    # What the emitter runs: the top-level steps and the outputs' step, which the plan
    # lists only when it issues a collective (it may slice locally all the same)
    plan.program = [s for s in plan if s.depth == 0]
    if not plan.program or plan.program[-1] is not ctx.step:
        plan.program.append(ctx.step)
    return plan


@memo()  # the inputs' layouts recur in every candidate
def _axes_of(layout: ValueLayout) -> frozenset:
    """The mesh axes `layout` splits a value over (over which its shard varies)."""
    return frozenset(a for axes in layout for a in axes)


@dataclass
class _Built:
    graph: object
    wanted: dict
    out_layouts: list
    jitted: Callable
    plan: Plan


class Lowered:
    """The callable `lower` returns; see the module docstring."""

    def __init__(
        self,
        fn: Callable,
        mesh: Mesh,
        layout: Layout | str,
        check: bool = False,
    ):
        self.fn, self.mesh, self.check_plan = fn, mesh, check
        self.layout = layout if isinstance(layout, Layout) else Layout(layout)
        self.layout.check(mesh)
        self._cache: dict = {}

    def _build(self, args):
        paths, tree = jax.tree_util.tree_flatten_with_path(list(args), is_leaf=_is_tensor)
        for path, x in paths:
            if not isinstance(x, Tensor):
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
        graph = nm.trace(self.fn, *args)
        wanted, out_layouts = io_layouts(graph, self.mesh, self.layout, input_names(args))
        plan = plan_program(graph, self.mesh, self.layout, wanted, out_layouts)
        body = functools.partial(emit, plan, check=self.check_plan)
        jitted = _jitted(body, graph, self.mesh, wanted, out_layouts)
        return _Built(graph, wanted, out_layouts, jitted, plan)

    def _runnable(self, what: str) -> None:
        if self.mesh.abstract:
            raise MeshError(
                f"{what}: {self.mesh} has no devices; it can be planned and "
                "reported, not run or compiled"
            )

    def __call__(self, *args):
        """Run on global Tensors (pytrees of them); returns global Tensors whose data are
        jax.Arrays sharded as the layout says. Compiles once per input signature."""
        self._runnable("calling a lowered function")
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
