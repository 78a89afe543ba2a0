"""The plan as data: what every equation of a lowered program does on local shards.

A `Plan` is a list of `Step`s, one per equation: the layouts of its inputs and
outputs, the local ops it runs (with their local avals, which the cost report
costs), the collectives it issues (kind, mesh axes, bytes, the graph value moved),
and `ops`, the step's instructions (`Instr`) over local values, which the emitter
(lowering/emit.py) runs inside jit(shard_map) and decides nothing about.

`RuleContext` is what an SPMD rule (lowering/rules/) sees: operations on local values
(relayout, the collectives, local ops, casts to varying, arithmetic by `call`). The
`Planner` (here) interprets them on `Local`s, abstract shards (shape, dtype, the mesh
axes they vary over), records each operation as an `Instr`, and never calls jax; the
emitter runs the instructions (`emit(check=True)` holds each jax value to its Local).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

from lowering.caches import memo, per_object
from lowering.collectives import plan_moves
from lowering.cost import local_flops, repeated_work, whole_flops
from lowering.layout import Layout, ValueLayout
from lowering.mesh import Mesh
from lowering.ops import OPS, Local, fmt_local, local_shapes, logged
from namedmesh.primitive import Aval, Primitive


class Collective(NamedTuple):
    """One collective a rule issues. `source` is the graph value it moves (None: the
    equation's result), which decides whether the backward pass transposes it;
    `transposes` is False for one whose transpose is local (lowering/cost.py)."""

    kind: str  # a collective of lowering/ops.py OPS (pvary: a free cast)
    axes: tuple[str, ...]
    nbytes: int  # local input bytes per device
    source: object = None
    transposes: bool = True


class Instr(NamedTuple):
    """One operation on local values: `op` (an instruction of lowering/ops.py's OPS, or
    a function of local arrays), the values it reads and makes, and its static params."""

    op: str | Callable
    ins: tuple
    outs: tuple
    params: dict


class LocalOp(NamedTuple):
    """A local op a step runs: the primitive, its params and the local avals of its
    inputs and results, which the cost report costs by the primitive's cost rule. A
    costing-only Planner also gives the op's local flops and those of the equation run
    whole on one device (`whole`; None: not the equation's own primitive) and the work
    other devices repeat (`repeated`), found once per equation and shards; elsewhere
    they are None and the report finds them."""

    prim: Primitive
    params: dict
    ins: list
    outs: list
    flops: float | None = None
    whole: float | None = None
    # (devices, `cost.repeated_work` on a mesh of that many devices: None where no
    # device repeats the op); None: not found while planning
    repeated: tuple | None = None


@dataclass(slots=True)  # one per equation and candidate: slots make it cheaper
class Step:
    """One equation of the plan: layouts in and out, local ops run, collectives issued."""

    name: str
    eqn: object  # the graph equation (None for the final relayout of outputs)
    inputs: list  # (dims, layout) per input
    outputs: list  # (dims, layout) per output
    local: list = field(default_factory=list)  # LocalOp, in order
    collectives: list = field(default_factory=list)  # Collective, in order
    casts: list = field(default_factory=list)  # Collective "pvary": typed varying, free
    events: list = field(default_factory=list)  # local ops and collectives, in order, as text
    repeat: int = 1  # times it runs per call (inside a scan: the scan's length)
    depth: int = 0  # how many scans it is inside
    body: list = field(default_factory=list)  # a scan's Steps, once
    pipeline: object = None  # a pipelined scan's PipelinePlan (lowering/pipeline.py)
    ops: list = field(default_factory=list)  # Instr, in order (planned steps only)


class Plan(list):
    """The Steps of a lowered program, printable as a table (also at a REPL prompt).
    A plan made by the `Planner` also holds the local values of the program's inputs,
    constants and outputs (`inputs`, `consts`, `outputs`), which the emitter binds."""

    inputs: list = ()
    consts: dict = {}
    outputs: list = ()
    program: list = ()  # the steps the emitter runs, in order (a scan's body is its op's)

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


def nbytes(x) -> int:
    """Bytes of the local array or `Local` `x`."""
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize


def local_avals(values, arrays) -> list[Aval]:
    """The avals of local shards `arrays` of the graph `values`: their dims, local shapes
    and dtypes, as cost rules take them."""
    return [
        Aval(v.dims, tuple(a.shape), np.dtype(a.dtype)) for v, a in zip(values, arrays, strict=True)
    ]


def nontrivial(layout: ValueLayout, mesh) -> ValueLayout:
    """`layout` without mesh axes of size 1, which split nothing and need no collectives."""
    if 1 not in mesh.sizes.values():
        return tuple(tuple(axes) for axes in layout)
    return tuple(tuple(a for a in axes if mesh.sizes[a] > 1) for axes in layout)


@runtime_checkable
class Hooks(Protocol):
    """What runs a rules' context: the operations of `RuleContext` are written on these
    alone. The Planner (below: on Locals, recording Instrs and the step's local ops
    and collectives, no jax) implements the first six, the Interpreter
    (lowering/interpret.py: the Planner that runs graphs) all eight."""

    def vma(self, x) -> set[str]:
        """The mesh axes over which the local value `x` is typed varying."""
        ...

    def run_op(self, op: str | Callable, *xs, made: tuple | None = None, **params):
        """Run (or record) operation `op` (an instruction of lowering/ops.py's OPS, or a
        function: a rule's own arithmetic, whose result `made` describes) on the local
        values `xs`; "local" gives a tuple of the primitive's outputs."""
        ...

    def run_loop(self, run: Callable, init: list, xs: list, length: int, made: list) -> tuple:
        """`RuleContext.loop`'s loop: (final carry, stacked ys); `made` holds the body's
        Step once `run` has run."""
        ...

    def run_local(self, prim: Primitive, arrays, params: dict) -> tuple:
        """Run (or record) `prim`'s jax implementation on local shards `arrays` of the
        current equation's inputs (cast alike by `RuleContext.local`), noting it for the
        cost report: its results, a tuple."""
        ...

    def note_local(self, prim, params, arrays, outs, how: str = "local") -> None:
        """Record in the current step that `prim` ran on the local arrays `arrays`,
        giving `outs` (a rule's own arithmetic costed as the primitive: `how`)."""
        ...

    def log(
        self, kind: str, axes: tuple[str, ...], nbytes: int, source=None, transposes: bool = True
    ) -> None:
        """Record in the current step a collective (or a free cast, "pvary") of `kind`
        over `axes`, moving `nbytes` per device of the graph value `source`."""
        ...

    def plan_layouts(self, graph) -> None:
        """The layout each value `graph`'s equations make should have, into `wanted`
        (for a rule that runs a graph of its own: nm.scan's body)."""
        ...

    def run_graph(self, graph, env: dict, plan: list, repeat: int = 1, depth: int = 0) -> None:
        """Run `graph`'s equations by their rules: `env` maps each input to (local value,
        layout) and receives every value made; their Steps are appended to `plan`."""
        ...


@dataclass
class RuleContext:
    """What a rule sees: the mesh, the rules, the layouts the planner wants, and the
    current plan step, in which the hooks `log` and `note_local` record its collectives
    and local ops. A rule that makes a value in `free` may give it another layout than
    `wanted`'s, and records it there. Its operations are written on the `Hooks` alone,
    which a subclass implements (Planner, Interpreter)."""

    mesh: Mesh
    layout: Layout
    wanted: dict
    free: set = field(default_factory=set)  # values whose dims conflict under the rules
    step: Step | None = None
    combined: set = field(default_factory=set)  # axes the current step's inputs vary over
    moved: dict = field(default_factory=dict)  # relayouts done in this trace of the body
    sources: dict = field(default_factory=dict)  # id(local array) -> (array, graph value)
    # False: costing only (auto_layout), which reads neither the events text nor the
    # emitter's instructions, so neither is made
    record: bool = True
    soft_layouts: dict = field(default_factory=dict, repr=False)  # kept by soft_layout

    # --- operations on local values -------------------------------------------------
    def call(self, fn: Callable, *xs, shape=None, dtype=None, vma: set | None = None, of=None,
             output: int = 0, like=None, **params):  # fmt: skip
        """`fn(*xs, **params)`, local arithmetic with no collective, giving one array that
        varies where its inputs do (or over `vma`, if given). Its shape and dtype are by
        default the current equation's output `output` as its primitive's shape rule
        makes it from local shards `of` of the equation's inputs (default: the first of
        `xs`), or those of `like` (a value of the shape and dtype it gives: a mask, a
        halo filled); `shape` and `dtype` are for the rule's other intermediate values."""
        if like is not None:
            shape = like.shape if shape is None else shape
            dtype = like.dtype if dtype is None else dtype
        if shape is None or dtype is None:
            got_shape, got_dtype = self.result_of(xs if of is None else of, output)
            shape = got_shape if shape is None else shape
            dtype = got_dtype if dtype is None else dtype
        return self.run_op(fn, *xs, made=(tuple(shape), np.dtype(dtype), vma), **params)

    def result_of(self, shards, output: int = 0) -> tuple[tuple[int, ...], np.dtype]:
        """(shape, dtype) of the current equation's output `output` as its primitive's
        shape rule makes it from local shards `shards` of the equation's inputs."""
        e = self.step.eqn
        in_dims = tuple(v.dims for v in e.inputs)
        shards = tuple((tuple(x.shape), np.dtype(x.dtype)) for x in shards[: len(in_dims)])
        items = tuple(e.params.items())
        try:
            shapes = local_shapes(e.primitive, in_dims, shards, items)
        except TypeError:  # a param that does not hash
            shapes = local_shapes.__wrapped__(e.primitive, in_dims, shards, items)
        return shapes[output], np.dtype(e.outputs[output].dtype)

    def astype(self, x, dtype):
        return x if np.dtype(x.dtype) == np.dtype(dtype) else self.run_op("astype", x, dtype=dtype)

    def axis_index(self, axes: tuple[str, ...]):
        """This device's position along the mesh axes `axes`, major to minor (int32)."""
        return self.run_op("axis_index", axes=tuple(axes), sizes=self.sizes)

    def psum(self, x, axes: tuple[str, ...]):
        return self.collective("psum", x, axes) if axes else x

    def psum_scatter(self, x, axes: tuple[str, ...], dim: int):
        return self.collective("psum_scatter", x, axes, dim=dim)

    def pmax(self, x, axes: tuple[str, ...]):
        return self.collective("pmax", x, axes) if axes else x

    def pmin(self, x, axes: tuple[str, ...]):
        return self.collective("pmin", x, axes) if axes else x

    def gather_stacked(self, x, axes: tuple[str, ...]):
        """Every device's `x` along `axes`, stacked on a new leading dim; invariant, so
        its transpose is a local slice."""
        return self.collective("gather_stacked", x, axes)

    def ppermute(self, x, axes: tuple[str, ...], perm):
        """`x` sent along `axes` by `perm`, pairs (source, destination) numbered as
        `axis_index(axes)` numbers positions (ops.ppermute)."""
        return self.collective("ppermute", x, axes, perm=tuple(perm), sizes=self.sizes)

    def make_invarying(self, x, axes: tuple[str, ...], source=None):
        """`x`, equal on every device along `axes` but typed varying there, as a value
        shard_map may return replicated: a psum of device 0's copy."""
        axes = tuple(a for a in self.sizes if a in axes)
        if not axes:
            return x
        return self.collective("make_invarying", x, axes, source, sizes=self.sizes)

    def instruction(self, op: str, *xs, **params):
        """Instruction `op` of lowering/ops.py's OPS on the local values `xs`, unlogged:
        one that issues no collective, or whose collectives the rule logs itself."""
        return self.run_op(op, *xs, **params)

    def collective(self, op: str, x, axes: tuple[str, ...], source=None, **params):
        """Collective `op` (an instruction of lowering/ops.py's OPS, with its params) of
        `x` over `axes`, logged as the collective its row records, moving (a part of) the
        graph value `source`."""
        row = OPS[op]
        self.log(logged(op), axes, nbytes(x), source, row.transposes)
        return self.run_op(op, x, axes=tuple(axes), **params)

    # --- the shared logic of the rules' context ------------------------------------------
    def source(self, x):
        """The graph value whose local array `x` is (or a relayout of), if known."""
        return self.sources.get(id(x), (None, None))[1]

    def note_source(self, x, v) -> None:
        if v is not None:
            self.sources[id(x)] = (x, v)  # the array is kept so that its id stays unique

    @property
    def sizes(self) -> dict[str, int]:
        return self.mesh.sizes

    def local(self, prim: Primitive, *arrays, **params):
        """Run `prim`'s jax implementation on local shards of the current equation's inputs,
        noting the local avals for the cost report. Results are held to the shape rule's
        dtypes, as nm.reference holds NumPy's: jax too may widen (argmax gives int64
        under jax_enable_x64 where the rule says int32)."""
        if len(arrays) > 1:
            vmas = [self.vma(a) for a in arrays]
            if vmas.count(vmas[0]) != len(vmas):  # (no generator: this runs per local op)
                vma = set().union(*vmas)
                # cast only the inputs that vary over fewer axes (the others are typed alike)
                arrays = [  # (indexes: zip's keyword strict= costs more than this)
                    a if len(vmas[i]) == len(vma) else self.varying(a, vma)
                    for i, a in enumerate(arrays)
                ]
        outs = self.run_local(prim, arrays, params)
        return outs if prim.multiple_results else outs[0]

    def missing_axes(self, x, vma: set) -> tuple[str, ...]:
        """The axes of `vma` over which `x` is not yet typed varying, in mesh order."""
        missing = set(vma) - self.vma(x)
        return tuple(a for a in self.sizes if a in missing) if missing else ()

    def cast_varying(self, x, vma: set):
        """`x` typed varying over every axis of `vma` (a free cast: no data moves),
        unlogged: a loop carry's type, whose cast the loop logs once it has settled."""
        missing = self.missing_axes(x, vma)
        return self.run_op("pvary", x, axes=missing) if missing else x

    def varying(self, x, vma: set):
        """`x` typed varying over the axes `vma` (a free cast), once per value: left to
        jax, each use of an invariant value by a varying one is cast on its own, and
        the backward pass then psums each use's cotangent instead of their sum."""
        missing = self.missing_axes(x, vma)
        if not missing:
            return x
        key = (id(x), "varying", missing)
        done = self.moved.get(key)
        if done is None:
            source = self.source(x)
            done = self.moved[key] = (x, self.collective("pvary", x, missing, source))
            self.note_source(done[1], source)
        return done[1]

    def soft_layout(
        self, dims, shape, is_value: bool = True, rules: Layout | None = None
    ) -> ValueLayout:
        """The layout `rules` (default: the program's) give (dims, shape), leaving unsplit
        a dim its axes do not divide. A strict layout's conflicts are errors only for
        values (`is_value`), not for the dims of a whole einsum, which no single tensor
        holds."""
        if rules is not None:
            return self._soft_layout(dims, shape, rules)
        # asked again and again of the same dims and shape in one plan (every activation
        # [batch, length, d_model] of a Transformer): kept per context and rules (a
        # pipeline's stages plan under the rules without the stage axes); the rules are
        # held, so that their id stays theirs
        held, known = self.soft_layouts.get(id(self.layout), (None, None))
        if held is not self.layout:
            known = {}
            self.soft_layouts[id(self.layout)] = (self.layout, known)
        key = (tuple(dims), tuple(shape), is_value)
        if key not in known:
            loose = is_value or not self.layout.strict  # else a non-strict copy: no errors
            known[key] = self._soft_layout(
                dims, shape, self.layout if loose else Layout(self.layout.rules)
            )
        return known[key]

    def _soft_layout(self, dims, shape, rules: Layout) -> ValueLayout:
        assigned = rules.assign(dims, shape, "value")
        return _dividing(assigned, tuple(shape), tuple(self.sizes.items()))

    def relayout(self, x, src: ValueLayout, dst: ValueLayout):
        """`x` moved from layout `src` to `dst`, once per value and target: a second
        request reuses the first result (XLA would merge the duplicate collectives)."""
        src, dst = tuple(src), tuple(dst)
        if src == dst:  # no move: the value itself, whether or not asked before
            return x
        source = self.source(x)
        # A slice by this device's index makes a value vary over the axes it adds; cast
        # here, so that the backward pass's psum of its gradient is planned.
        added = {a for axes in dst for a in axes} - {a for axes in src for a in axes}
        x = self.varying(x, self.combined | added)
        key = (id(x), src, dst)
        done = self.moved.get(key)
        if done is None:
            done = self.moved[key] = (x, self._moves(x, src, dst, source))
            self.note_source(done[1], source)
        return done[1]

    def _moves(self, x, src, dst, source):
        """The moves of `collectives.plan_moves`, each logged and run."""
        try:
            moves = _planned_moves(src, dst)
        except TypeError:  # a layout of lists, which does not hash
            moves = plan_moves(src, dst)
        for m in moves:
            if m.kind == "slice":
                x = self.run_op("slice_to", x, axes=m.axes, dim=m.dim, sizes=self.sizes)
            else:  # all_gather(dim) or all_to_all(dim, to)
                to = {} if m.to is None else {"to": m.to}
                x = self.collective(m.kind, x, m.axes, source, dim=m.dim, **to)
        return x

    # --- a loop (a pipelined scan's ticks: lowering/pipeline.py) ------------------
    def loop(self, body: Callable, init: list, xs: list, length: int, step: Callable) -> tuple:
        """(final carry, stacked ys, the body's Step): `body(carry, x) -> (carry, ys)` on
        lists of local values, run `length` times over the leading dim of `xs` from
        `init`, in the Step `step()` makes (its relayouts kept apart from the enclosing
        step's): one "scan" instruction running that Step (jax.lax.scan, emitted).
        The carry keeps `init`'s types: a body that widens them raises (WiderCarry)."""
        made: list = []

        def run(c, x):
            saved = self.moved, self.sources, self.step
            self.moved, self.sources, self.step = {}, {}, step()
            made[:] = [self.step]
            try:
                return body(list(c), list(x))
            finally:
                self.moved, self.sources, self.step = saved

        final, ys = self.run_loop(run, list(init), list(xs), length, made)
        return list(final), list(ys), made[0]


@memo()  # the same relayouts recur in every candidate (a search asks 40 per candidate)
def _planned_moves(src: ValueLayout, dst: ValueLayout) -> tuple:
    """`collectives.plan_moves(src, dst)`, kept: a pure function of the two layouts."""
    return tuple(plan_moves(src, dst))


@memo()  # the same assigned layout and shape recur in many candidate layouts
def _dividing(layout: ValueLayout, shape: tuple, sizes: tuple) -> ValueLayout:
    """`layout` of a value of `shape` on a mesh of `sizes` (items), leaving unsplit a dim
    its mesh axes do not divide, without the axes of size 1 (as `nontrivial`)."""
    mesh = dict(sizes)
    fits = [
        () if n % math.prod(mesh[a] for a in axes) else axes
        for n, axes in zip(shape, layout, strict=True)
    ]
    return tuple(tuple(a for a in axes if mesh[a] > 1) for axes in fits)


def _abstract(op, xs, sizes, made, params) -> Local | tuple[Local, ...]:
    """The Local(s) `op` makes from the Locals `xs`: its row's abstract rule
    (lowering/ops.py), or, for a rule's own arithmetic (a function), what `call` said."""
    if callable(op):
        shape, dtype, given = made
        vma = xs[0].vma if len(xs) == 1 else frozenset().union(*(x.vma for x in xs))
        return Local(shape, dtype, frozenset(given) if given is not None else vma)
    return OPS[op].abstract(xs, sizes, **params)


@per_object(kind="layouts")
def _costed_local(e, prim: Primitive, shards: tuple, items: tuple, devices: int) -> tuple:
    """(result shapes, LocalOp) of `prim` run for equation `e` on local shards of these
    (shape, dtype), with params `items`: the shapes `ops.abstract_local` gives, the avals
    `note_local` records, their flops, the equation's whole flops and the work that
    other devices of a mesh of `devices` repeat, which the cost report would find again
    for each candidate. The LocalOp is shared: not to change."""
    in_dims = tuple(v.dims for v in e.inputs)
    shards = tuple((tuple(shape), np.dtype(dtype)) for shape, dtype in shards)
    try:
        shapes = local_shapes(prim, in_dims, shards, items)
    except TypeError:  # a param that does not hash
        shapes = local_shapes.__wrapped__(prim, in_dims, shards, items)
    ins = [Aval(v.dims, *x) for v, x in zip(e.inputs, shards, strict=True)]
    outs = [
        Aval(v.dims, shape, np.dtype(v.dtype)) for v, shape in zip(e.outputs, shapes, strict=True)
    ]
    params = dict(items)
    whole = whole_flops(e, items) if prim is e.primitive else None
    flops = local_flops(prim, ins, outs, params)
    repeated = (devices, repeated_work(flops, whole, devices))
    return shapes, LocalOp(prim, params, ins, outs, flops, whole, repeated)


class Planner(RuleContext):
    """The rules' context on `Local`s: each operation is recorded into the current step's
    `ops` as an `Instr` and gives the Local it would make; no jax is called."""

    def vma(self, x) -> frozenset[str]:
        return x.vma

    @functools.cached_property
    def devices(self) -> int:
        """The number of devices of the mesh."""
        return math.prod(self.sizes.values())

    def run_local(self, prim: Primitive, arrays, params: dict) -> tuple:
        if self.record or prim.aliases_input:
            e = self.step.eqn
            # (prim, its results' dtypes, its inputs' dims): one param, apart from the op's own
            what = (prim, tuple(v.dtype for v in e.outputs), tuple(v.dims for v in e.inputs))
            outs = self.run_op("local", *arrays, local_op=what, **params)
            self.note_local(prim, params, arrays, outs)
            return outs
        # Costing only: the results' shapes and the avals that the report costs, in one
        # lookup kept per equation and shards (what ops.abstract_local and note_local make)
        shards = tuple([(x.shape, x.dtype) for x in arrays])
        items = tuple(params.items())
        shapes, op = _costed_local(self.step.eqn, prim, shards, items, self.devices)
        self.step.local.append(op)
        # `local` has cast the inputs alike: they vary over the same axes
        vma = arrays[0].vma if arrays else frozenset()
        outs = op.outs  # one aval per shape (indexes: zip's strict= costs more than this)
        return tuple([Local(s, outs[i].dtype, vma) for i, s in enumerate(shapes)])

    def note_local(self, prim, params, arrays, outs, how: str = "local") -> None:
        """Record that `prim` ran on the local arrays `arrays`, giving `outs`: the cost
        report costs it by the primitive's cost rule on their shapes."""
        e = self.step.eqn
        ins, outs_ = local_avals(e.inputs, arrays), local_avals(e.outputs, outs)
        self.step.local.append(LocalOp(prim, params, ins, outs_))
        if not self.record:
            return
        shapes = lambda avals: ", ".join(fmt_local(a) for a in avals)
        self.step.events.append(f"{how} {prim.name}({shapes(ins)}) -> {shapes(outs_)}")

    def log(
        self, kind: str, axes: tuple[str, ...], nbytes: int, source=None, transposes: bool = True
    ) -> None:
        c = Collective(kind, tuple(axes), int(nbytes), source, transposes)
        step = self.step  # a costing-only step holds () until its first (interpret._step)
        if kind == "pvary":
            if isinstance(step.casts, tuple):
                step.casts = []
            step.casts.append(c)
        else:
            if isinstance(step.collectives, tuple):
                step.collectives = []
            step.collectives.append(c)
        if not self.record:
            return
        what = " (a free cast; the backward pass psums its gradient)" if kind == "pvary" else ""
        self.step.events.append(f"{kind} over {','.join(axes)}: {nbytes} bytes in per device{what}")

    def run_op(self, op, *xs, made=None, **params):
        if op == "local" and params["local_op"][0].aliases_input:
            return (xs[0],)  # the same local value, as jax returns the same array
        res = _abstract(op, xs, self.sizes, made, params)
        outs = res if isinstance(res, tuple) else (res,)
        if self.record:
            self.step.ops.append(Instr(op, xs, outs, params))
        return res

    def run_loop(self, run, init, xs, length, made):
        carry_in = [Local(c.shape, c.dtype, c.vma) for c in init]
        x_in = [Local(x.shape[1:], x.dtype, x.vma) for x in xs]
        new, ys = run(carry_in, x_in)
        final = [Local(c.shape, c.dtype, c.vma) for c in init]
        stacked = [Local((length, *y.shape), y.dtype, y.vma) for y in ys]
        if self.record:
            self.step.ops.append(Instr("scan", (*init, *xs), (*final, *stacked), {
                "n_carry": len(init), "n_x": len(xs), "length": length, "remat": "none",
                "carry_in": carry_in, "x_in": x_in, "steps": list(made), "carry_out": list(new),
                "ys": list(ys), "consts": {},
            }))  # fmt: skip
        return final, stacked


def constant(c) -> Local:
    """The Local of a graph constant (the same on every device)."""
    a = np.asarray(c)
    return Local(tuple(a.shape), a.dtype)
