"""`lower(fn, mesh, layout)`: a namedmesh program as jit(shard_map(...)) on a mesh.

The function is traced to a Graph; every value gets the layout the rules give it
(inputs and outputs must divide exactly; an intermediate whose size an axis does
not divide is left unsplit on that dim; `nm.constrain` pins a value's layout),
except that an intermediate whose dims the rules give one mesh axis twice, made
by an einsum or an elementwise op, takes the layout its rule computes it in.
Inside shard_map each equation runs by its primitive's SPMD rule
(lowering/rules.py) on local shards. The rules report the local ops they run and
the collectives they issue, which `.plan()` and `.report()` show.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import numpy as np

import namedmesh as nm
from lowering import cost, distributed, rules
from lowering.collectives import make_invarying, missing_axes, nbytes, relayout, varying_axes
from lowering.cost import Report
from lowering.layout import Layout, ValueLayout, local_shape, partition_spec
from lowering.mesh import Mesh
from namedmesh.errors import ArgumentError, DtypeError, LayoutError, MeshError, fmt_dims
from namedmesh.primitive import Aval
from namedmesh.tensor import Tensor


class Collective(NamedTuple):
    """One collective a rule issues. `source` is the graph value it moves (None: the
    equation's result), which decides whether the backward pass transposes it;
    `transposes` is False for one whose transpose is local (lowering/cost.py)."""

    kind: str  # psum, psum_scatter, all_gather, all_to_all, ppermute, pmax, pmin; pvary
    axes: tuple[str, ...]
    nbytes: int  # local input bytes per device
    source: object = None
    transposes: bool = True


@dataclass
class Step:
    """One equation of the plan: layouts in and out, local ops run, collectives issued."""

    name: str
    eqn: object  # the graph equation (None for the final relayout of outputs)
    inputs: list  # (dims, layout) per input
    outputs: list  # (dims, layout) per output
    local: list = field(default_factory=list)  # (primitive, params, in avals, out avals)
    collectives: list = field(default_factory=list)  # Collective, in order
    casts: list = field(default_factory=list)  # Collective "pvary": typed varying, free
    events: list = field(default_factory=list)  # local ops and collectives, in order, as text
    repeat: int = 1  # times it runs per call (inside a scan: the scan's length)
    depth: int = 0  # how many scans it is inside
    body: list = field(default_factory=list)  # a scan's Steps, once


class Plan(list):
    """The Steps of a lowered program, printable as a table (also at a REPL prompt)."""

    def __str__(self) -> str:
        """The plan without its free casts to varying; see `format`."""
        return self.format()

    __repr__ = __str__

    def format(self, casts: bool = False) -> str:
        """One line per equation (its layouts in and out), then its local ops and
        collectives. `casts`: also the free casts to varying (`pvary`), which cost
        nothing forward and become the psums of the gradients in the backward pass."""

        def fmt(dims, lay):
            parts = (d + (":" + ",".join(a) if a else "") for d, a in zip(dims, lay, strict=True))
            return "[" + ", ".join(parts) + "]"

        lines = []
        for s in self:
            ins = " ".join(fmt(*x) for x in s.inputs)
            outs = " ".join(fmt(*x) for x in s.outputs)
            pad = "    " * s.depth
            times = f"  (x{s.repeat})" if s.depth else ""
            lines.append(f"{pad}{s.name}: {ins} -> {outs}{times}")
            lines.extend(pad + "    " + e for e in s.events if casts or not e.startswith("pvary"))
        return "\n".join(lines)


def _fmt_local(a) -> str:
    return f"{a.dtype.kind}{a.dtype.itemsize * 8}[{','.join(map(str, a.shape))}]"


@dataclass
class Context:
    """What a rule sees: the mesh, the rules, the layouts the planner wants, and the
    current plan step, to which `log` and `local` report. A rule that makes a value in
    `free` may give it another layout than `wanted`'s, and records it there."""

    mesh: Mesh
    layout: Layout
    wanted: dict
    free: set = field(default_factory=set)  # values whose dims conflict under the rules
    step: Step | None = None
    combined: set = field(default_factory=set)  # axes the current step's inputs vary over
    moved: dict = field(default_factory=dict)  # relayouts done in this trace of the body
    sources: dict = field(default_factory=dict)  # id(local array) -> (array, graph value)

    def source(self, x):
        """The graph value whose local array `x` is (or a relayout of), if known."""
        return self.sources.get(id(x), (None, None))[1]

    def note_source(self, x, v) -> None:
        if v is not None:
            self.sources[id(x)] = (x, v)  # the array is kept so that its id stays unique

    @property
    def sizes(self) -> dict[str, int]:
        return self.mesh.sizes

    def log(
        self, kind: str, axes: tuple[str, ...], nbytes: int, source=None, transposes: bool = True
    ) -> None:
        c = Collective(kind, tuple(axes), int(nbytes), source, transposes)
        (self.step.casts if kind == "pvary" else self.step.collectives).append(c)
        what = " (a free cast; the backward pass psums its gradient)" if kind == "pvary" else ""
        self.step.events.append(f"{kind} over {','.join(axes)}: {nbytes} bytes in per device{what}")

    def local(self, prim, *arrays, **params):
        """Run `prim`'s jax implementation on local shards of the current equation's inputs,
        noting the local avals for the cost report."""
        if len(arrays) > 1:
            vma = set().union(*(varying_axes(a) for a in arrays))
            arrays = [self.varying(a, vma) for a in arrays]
        out = prim.jax_impl(*arrays, **params)
        e = self.step.eqn
        # Held to the shape rule's dtypes, as nm.reference holds NumPy's: jax too may widen
        # (argmax gives int64 under jax_enable_x64 where the rule says int32).
        outs = tuple(
            o if o.dtype == v.dtype else o.astype(v.dtype)
            for o, v in zip(out if prim.multiple_results else (out,), e.outputs, strict=True)
        )
        self.note_local(prim, params, arrays, outs)
        return outs if prim.multiple_results else outs[0]

    def note_local(self, prim, params, arrays, outs, how: str = "local") -> None:
        """Record that `prim` ran on the local arrays `arrays`, giving `outs`: the cost
        report costs it by the primitive's cost rule on their shapes."""
        e = self.step.eqn
        self.step.local.append(
            (prim, params, local_avals(e.inputs, arrays), local_avals(e.outputs, outs))
        )
        shapes = lambda avals: ", ".join(_fmt_local(a) for a in avals)
        ins, outs_ = self.step.local[-1][2:]
        self.step.events.append(f"{how} {prim.name}({shapes(ins)}) -> {shapes(outs_)}")

    def varying(self, x, vma: set):
        """`x` typed varying over the axes `vma` (a free cast), once per value: left to
        jax, each use of an invariant value by a varying one is cast on its own, and
        the backward pass then psums each use's cotangent instead of their sum."""
        missing = missing_axes(x, vma, self.sizes)
        if not missing:
            return x
        key = (id(x), "varying", missing)
        if key not in self.moved:
            self.log("pvary", missing, nbytes(x), self.source(x))
            self.moved[key] = (x, jax.lax.pcast(x, missing, to="varying"))
            self.note_source(self.moved[key][1], self.source(x))
        return self.moved[key][1]

    def soft_layout(
        self, dims, shape, is_value: bool = True, rules: Layout | None = None
    ) -> ValueLayout:
        """The layout `rules` (default: the program's) give (dims, shape), leaving unsplit
        a dim its axes do not divide. A strict layout's conflicts are errors only for
        values (`is_value`), not for the dims of a whole einsum, which no single tensor
        holds."""
        if rules is None:
            rules = self.layout if is_value else Layout(self.layout.rules)
        layout = list(rules.assign(dims, shape, "value"))
        for i, n in enumerate(shape):
            if n % math.prod(self.sizes[a] for a in layout[i]):
                layout[i] = ()
        return nontrivial(tuple(layout), self.mesh)

    def relayout(self, x, src: ValueLayout, dst: ValueLayout):
        """`x` moved from layout `src` to `dst`, once per value and target: a second
        request reuses the first result (XLA would merge the duplicate collectives)."""
        source = self.source(x)
        if tuple(src) != tuple(dst):
            # A slice by this device's index makes a value vary over the axes it adds;
            # cast here, so that the backward pass's psum of its gradient is planned.
            added = {a for axes in dst for a in axes} - {a for axes in src for a in axes}
            x = self.varying(x, self.combined | added)
        key = (id(x), tuple(src), tuple(dst))
        if key not in self.moved:
            log = lambda kind, axes, nbytes, **kw: self.log(kind, axes, nbytes, source, **kw)
            self.moved[key] = (x, relayout(x, src, dst, self.sizes, log))
            self.note_source(self.moved[key][1], source)
        return self.moved[key][1]


def nontrivial(layout: ValueLayout, mesh) -> ValueLayout:
    """`layout` without mesh axes of size 1, which split nothing and need no collectives."""
    return tuple(tuple(a for a in axes if mesh.sizes[a] > 1) for axes in layout)


def constraint_layout(rules_, v, mesh) -> ValueLayout:
    """The layout `nm.constrain` pins: its rules alone (other dims replicated), strictly.
    nm.constrain checked them but for the mesh: a LayoutError names the constraint and
    its rule that names an axis `mesh` lacks."""
    layout = Layout(rules_, strict=True)
    for dim, axes in layout.rules:
        unknown = [a for a in axes if a not in mesh.sizes]
        if unknown:
            raise LayoutError(
                f"nm.constrain({fmt_dims(v.dims, v.shape)}, {str(layout)!r}): rule "
                f"{dim}:{','.join(axes)} names mesh axis {unknown} not in {mesh}"
            )
    return nontrivial(layout.of(v.dims, v.shape, mesh, "constrained value"), mesh)


def check_dtypes(graph) -> None:
    """The 64-bit policy (docs/lowering.md): with jax_enable_x64 on, 64-bit values are
    computed in 64 bits, as nm.reference computes them; with it off, jax would compute
    them in 32 bits and change the answer, so a DtypeError names the first such value
    (an input, a constant, or the op that makes it) before anything compiles."""
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


def plan_layouts(ctx: Context, graph) -> None:
    """The layout each value made by `graph`'s equations should have, into `ctx.wanted`:
    the rules' (soft) layout, or the one `nm.constrain` pins. Values whose dims conflict
    (two of them take one mesh axis) go into `ctx.free` too: the einsum and elementwise
    rules replace their rule-order layout by the one they compute them in."""
    for e in graph.eqns:
        for v in e.outputs:
            ctx.wanted[v] = ctx.soft_layout(v.dims, v.shape)
            if ctx.layout.conflicts(v.dims, ctx.sizes):
                ctx.free.add(v)
        if e.primitive.pins_layout:
            ctx.wanted[e.outputs[0]] = constraint_layout(e.params["layout"], e.outputs[0], ctx.mesh)
            ctx.free.discard(e.outputs[0])


def local_avals(values, arrays) -> list[Aval]:
    """The avals of local shards `arrays` of the graph `values`: their dims, local shapes
    and dtypes, as cost rules take them."""
    return [
        Aval(v.dims, tuple(a.shape), np.dtype(a.dtype)) for v, a in zip(values, arrays, strict=True)
    ]


def cost_own_arithmetic(ctx: Context, e, ins, outs) -> None:
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


def run_graph(ctx: Context, graph, env: dict, plan: list, repeat: int = 1, depth: int = 0):
    """Run `graph`'s equations on local shards by their SPMD rules. `env` maps each input
    Var to (local array, layout) and receives every value made; each equation's Step
    (then the Steps of a scan's body) is appended to `plan`."""
    for v, c in graph.consts.items():
        env[v] = (jax.numpy.asarray(c), ((),) * len(v.dims))
    for v, (x, _) in env.items():
        ctx.note_source(x, v)
    for e in graph.eqns:
        ins = [env[v] for v in e.inputs]
        ctx.step = Step(
            e.primitive.name,
            e,
            [(v.dims, lay) for v, (_, lay) in zip(e.inputs, ins, strict=True)],
            [],
            repeat=repeat,
            depth=depth,
        )
        # An op that combines its inputs makes them all vary where any does. Cast before
        # moving, so that the backward pass sums a gathered value's gradient over those
        # axes after the reduce-scatter, on the smaller shard.
        combines = e.primitive.combines_inputs
        ctx.combined = set().union(*(varying_axes(x) for x, _ in ins)) if combines else set()
        outs = rules.rule_for(e.primitive)(ctx, e, ins)
        cost_own_arithmetic(ctx, e, ins, outs)
        ctx.step.outputs = [(v.dims, lay) for v, (_, lay) in zip(e.outputs, outs, strict=True)]
        plan.append(ctx.step)
        plan.extend(ctx.step.body)
        env.update(zip(e.outputs, outs, strict=True))
        for v, (x, _) in zip(e.outputs, outs, strict=True):
            ctx.note_source(x, v)


@dataclass
class _Built:
    graph: object
    wanted: dict
    out_layouts: list
    jitted: Callable
    plan: Plan


class Lowered:
    """The callable `lower` returns; see the module docstring."""

    def __init__(self, fn: Callable, mesh: Mesh, layout: Layout | str):
        self.fn, self.mesh = fn, mesh
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
        check_dtypes(graph)
        self.layout.check_dims({d for v in graph.values() for d in v.dims})
        of = lambda v, what: nontrivial(self.layout.of(v.dims, v.shape, self.mesh, what), self.mesh)
        names = input_names(args)
        wanted = {v: of(v, f"input {names[i]}") for i, v in enumerate(graph.inputs)}
        ctx = Context(self.mesh, self.layout, wanted)
        plan_layouts(ctx, graph)
        out_layouts = [of(v, f"output {i}") for i, v in enumerate(graph.outputs)]
        plan = Plan()

        def body(*local_inputs):
            plan.clear()
            ctx.moved, ctx.sources = {}, {}
            env = {v: (x, wanted[v]) for v, x in zip(graph.inputs, local_inputs, strict=True)}
            run_graph(ctx, graph, env, plan)
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
                extra = varying_axes(y) - {a for axes in lay for a in axes}
                res.append(make_invarying(y, tuple(extra), ctx.sizes, ctx.log))
            if ctx.step.collectives or ctx.step.casts:
                plan.append(ctx.step)
            return res

        sharded = jax.shard_map(
            body,
            mesh=self.mesh.jax_mesh,
            in_specs=tuple(partition_spec(wanted[v]) for v in graph.inputs),
            out_specs=[partition_spec(lay) for lay in out_layouts],
        )
        return _Built(graph, wanted, out_layouts, jax.jit(sharded), plan)

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
        datas, built = self._build(args)
        jax.eval_shape(built.jitted, *datas)
        return built.plan

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

        def local_bytes(v):
            layout = built.wanted.get(v, ((),) * len(v.dims))
            return math.prod(local_shape(layout, v.shape, self.mesh)) * v.dtype.itemsize

        inputs = None
        if wrt is not None:
            wrt = (wrt,) if isinstance(wrt, int) else tuple(wrt)
            bad = [i for i in wrt if not isinstance(i, int) or not 0 <= i < len(args)]
            if bad:
                raise ArgumentError(f"report(wrt={wrt}): no argument {bad} of {len(args)}")
            counts = [len(jax.tree_util.tree_leaves(a, is_leaf=_is_tensor)) for a in args]
            starts = np.cumsum([0, *counts])
            graph_in = built.graph.inputs
            inputs = [v for i in wrt for v in graph_in[starts[i] : starts[i + 1]]]
        rep = cost.report(plan, built.graph, local_bytes, self.mesh.sizes, wrt=inputs)
        if show:
            print(rep)
        return rep

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


def lower(fn: Callable, mesh: Mesh, layout: Layout | str) -> Lowered:
    """`fn` on global Tensors, run as an SPMD program on `mesh` under `layout`."""
    if not isinstance(mesh, Mesh):
        raise LayoutError(f"lower needs a lowering.Mesh, got {type(mesh).__name__}")
    return Lowered(fn, mesh, layout)
