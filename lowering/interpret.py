"""The interpreter: a traced program's equations run by their SPMD rules in the Planner.

`plan_program` makes the Plan of a Graph on a mesh under a layout: `io_layouts` gives
the inputs and outputs their layouts (after the dtype policy's check), the
`Interpreter` (the Planner with the interpreter's loop) gives every value the layout
its rules want (`plan_layouts`), runs each equation's rule (lowering/rules/) on
abstract local shards (`run_graph`), and `relayout_outputs` moves the outputs to
theirs. Rules that run a graph of their own (nm.scan's body) call the context's
`run_graph` and `plan_layouts` again. Nothing here calls jax.
"""

from __future__ import annotations

import jax
import numpy as np

from lowering import rules
from lowering.caches import memo, per_object
from lowering.layout import Layout, ValueLayout, check_axes, local_shape
from lowering.mesh import Mesh
from lowering.plan import Local, Plan, Planner, RuleContext, Step, constant, local_avals, nontrivial
from lowering.rules.registry import SPMD_RULES
from namedmesh.errors import DtypeError, fmt_dims


class Interpreter(Planner):
    """The Planner that runs graphs: `plan_layouts` and `run_graph`, for the program and
    for the rules that run a body of their own (nm.scan's)."""

    def plan_layouts(self, graph) -> None:
        """The layout each value made by `graph`'s equations should have, into `wanted`:
        the rules' (soft) layout, or the one `nm.constrain` pins. Values whose dims
        conflict (two of them take one mesh axis) go into `free` too: the einsum and
        elementwise rules replace their rule-order layout by the one they compute them in."""
        by_shape, pinned = _values_by_shape(graph)
        conflicts: dict = {}  # by dims: the same dims recur in many shapes
        for (dims, shape), values in by_shape.items():
            self.wanted.update(dict.fromkeys(values, self.soft_layout(dims, shape)))
            if dims not in conflicts:
                conflicts[dims] = self.layout.conflicts(dims, self.sizes)
            if conflicts[dims]:
                self.free.update(values)
        for v, layout in pinned:
            self.wanted[v] = constraint_layout(layout, v, self.mesh)
            self.free.discard(v)

    def run_graph(self, graph, env: dict, plan: list, repeat: int = 1, depth: int = 0) -> None:
        """Run `graph`'s equations on local shards (`Local`s) by their SPMD rules. `env`
        maps each input Var to (local value, layout) and receives every value made; each
        equation's Step (then the Steps of a scan's body) is appended to `plan`."""
        for v, c in graph.consts.items():
            env[v] = (constant(c), ((),) * len(v.dims))
        for v, (x, _) in env.items():
            self.sources[id(x)] = (x, v)  # (note_source, inlined: this runs per value)
        vma = self.vma
        for e in graph.eqns:
            prim = e.primitive
            ins = [env[v] for v in e.inputs]
            self.step = step = _step(self, e, ins, repeat, depth)
            # An op that combines its inputs makes them all vary where any does. Cast before
            # moving, so that the backward pass sums a gathered value's gradient over those
            # axes after the reduce-scatter, on the smaller shard.
            if prim.combines_inputs:
                self.combined = set().union(*[vma(x) for x, _ in ins])
            elif self.combined:
                self.combined = set()
            outs = (SPMD_RULES.get(prim) or rules.rule_for(prim))(self, e, ins)
            made = e.outputs
            if len(outs) != len(made):
                raise ValueError(f"the rule of {prim.name} gave {len(outs)} results for "
                                 f"{len(made)}")  # fmt: skip
            if not step.local and not step.body:  # (most steps ran a local op: no call)
                cost_own_arithmetic(self, e, ins, outs)
            # (indexes, not zip: zip's keyword strict= alone cost a search 3% of its time)
            step.outputs = [(v.dims, outs[i][1]) for i, v in enumerate(made)]
            plan.append(step)
            if step.body:
                plan.extend(step.body)
            sources = self.sources  # (a scan's rule swaps its own in and back)
            for i, v in enumerate(made):
                out = env[v] = outs[i]
                sources[id(out[0])] = (out[0], v)


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


def _step(ctx: RuleContext, e, ins: list, repeat: int, depth: int) -> Step:
    """The Step of equation `e`, its inputs (local value, layout) `ins`. A costing-only
    plan's (`ctx.record` False) holds no layouts in and no events, and shares empty
    tuples for the collectives and casts most steps do not issue (`RuleContext.log` makes
    the list), the scans' body and the instructions (which only a scan's step records):
    a search's candidates then make few objects each for the collector to trace."""
    if ctx.record:
        shown = [(v.dims, x[1]) for v, x in zip(e.inputs, ins, strict=True)]
        return Step(e.primitive.name, e, shown, [], repeat=repeat, depth=depth)
    # (positional: Step's fields in order, local, collectives, casts, events, repeat,
    # depth, body, pipeline, ops; keywords cost a search 1% of its time)
    ops = [] if e.primitive.loop else ()
    return Step(e.primitive.name, e, (), (), [], (), (), (), repeat, depth, (), None, ops)


def io_layouts(graph, mesh: Mesh, layout: Layout, names=None, padded=()) -> tuple[dict, list]:
    """(layout by input value, layouts of the outputs) of `graph` under `layout`, after
    checking its dtypes and that the rules name its dims; LayoutError for an input or
    output (named by `names`, the inputs' argument paths) its axes do not divide, but
    for a dim of `padded` (a stack of uneven pipeline stages, padded inside the program:
    namedmesh/uneven.py), which is left unsplit where they do not."""
    check_dtypes(graph)
    layout.check_dims(_dims(graph))
    layout.check(mesh)  # (what `layout.of` checks first, which a kept layout skips)
    names = names or [str(i) for i in range(len(graph.inputs))]
    # by (dims, shape): a model's parameters share a few. A value's layout is found (and
    # checked) at the first value with its dims and shape, so an error names that one
    known: dict = {}
    kept = _kept_layouts(mesh)

    def of(v, kind: str, name) -> ValueLayout:
        if any(d in padded for d in v.dims):
            return nontrivial(layout.of(v.dims, v.shape, mesh, f"{kind} {name}", padded), mesh)
        key = (v.dims, v.shape)
        if key not in known:
            # the rules of its dims decide it: kept by them for the candidates that share
            # them (one that failed its checks was not kept, and fails them again here)
            ruled = (tuple(r for r in layout.rules if r[0] in v.dims), layout.strict, *key)
            if ruled not in kept:
                kept[ruled] = nontrivial(layout.of(*key, mesh, f"{kind} {name}"), mesh)
            known[key] = kept[ruled]
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
    outputs'. `record` False: a plan for the cost report alone, without the steps'
    events text, the emitter's instructions and `program` (the same layouts, local ops
    and collectives)."""
    ctx = Interpreter(mesh, layout, wanted, record=record)
    ctx.plan_layouts(graph)
    plan = Plan()
    plan.inputs = [Local(local_shape(wanted[v], v.shape, mesh), np.dtype(v.dtype),
                         _axes_of(wanted[v]))
                   for v in graph.inputs]  # fmt: skip
    env = {v: (x, wanted[v]) for v, x in zip(graph.inputs, plan.inputs, strict=True)}
    ctx.run_graph(graph, env, plan)
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
