"""`auto_layout`: the rule set with the least predicted step time that fits memory.

The method is a pruned search with exact costing, chosen over an integer program
because the planner's cost of a layout is not a sum of per-(dim, axis) terms: which
collectives an einsum needs, whether a partial sum becomes a psum or a psum_scatter,
and which gradient syncs the backward pass adds depend on how every axis is used at
once, and a linearised model would rank layouts by an approximation of the cost the
planner then reports. Here every candidate that survives pruning is planned and
costed exactly (`lower.graph_report`, as `Lowered.report`, forward and backward; by
the Planner, without jax, when every op of the program has a plan rule), and the search grows with
(mesh axes) x (dims), not with (dims)^(mesh axes):

1. Axes, largest first: each state of the beam is extended by giving the next mesh axis
   to one dim (a dim already split takes the axis too: `batch:rows,cols`), a group of
   dims no value holds two of, or none. Kept: the `beam` best states that fit (or could,
   with the axes not yet given: memory over their product) by predicted time, then the
   rest by memory; and up to `beam` states over the limit but faster than all that fit
   (those no other state is both faster and smaller than, the smallest first).
2. Sharing: an axis, or every axis a dim lacks, is given to one more dim, after the
   ones it has (rule order: the earlier dim keeps the axis where a value holds both).
   This makes Megatron's `heads;d_ff;vocab` on one model axis, FSDP (`d_model` on the
   data axis after `batch`: parameters split, activations not), and a sequence split
   (`length`) beside any of them. The best state phase 1 kept that fits is extended, and
   every one over the limit; then the frontier is the best state and up to `beam`
   faster ones over the limit (as in phase 1), and its states not yet extended are
   extended, best first, until none is left. The caller's `seeds` (layouts another
   program chose: a joint search's, lowering/joint.py) join phase 1's states first,
   mended to divide this program's dims (`_seeded`), so the climb may start from one.
   With `plateau` (a joint search's pairs), a descent that has found nothing fitting
   ends at its first step gaining under that fraction of memory (`_share`).

What the beams drop is not proved worse: memory over the axes still to give is no bound
on a state's completions (phase 2 divides memory further by sharing an axis), and a
state over the limit may be the one whose completion is fastest, so fast states are
kept whatever their memory. On programs small enough to plan every layout the choice is no
slower than the best within the limit of all that give each axis to at most two dims
(tests/test_search_optimal.py, against brute force; none of 615 such searches on
2-axis meshes missed); on 3-axis meshes under a limit that binds it can miss (6 of 270
MLP searches, by up to 5.4%, docs/benchmarks.md), and on larger ones it is a beam, not a proof.

Each candidate's time is `Rates.seconds` of its report (lowering/rates.py): flops at
the device's flop rate, each collective's latency and bytes at its kind's rate. The
memory limit is a constraint: a layout over it is never chosen. Rule sets that give
every value and every equation the same layout are planned once (memoised by that
canonical form). Within a candidate the planning is mostly that of the scan bodies (the
layers, attention's blocks), each planned until its carry's type settles; a pass of a
body that another candidate planned under the same rules for the body's dims, the same
shards and types, is taken from it, not planned again (lowering/rules/control.py
`settled`, `widenings`): the same plan, a DeepSeek-V3 search in 0.6x the time. A search
holds Python's cycle collector back while it runs (lowering/collector.py: its objects
are freed by reference counting; rescanning the process's million long-lived objects
was a fifth of a Llama 3 70B plan's CPU).
"""

from __future__ import annotations

import itertools
import math
import numbers
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import namedmesh as nm
from lowering.bodies import Shared
from lowering.collector import few_collections
from lowering.layout import Layout, check_axes
from lowering.lower import argnum_tuple, argument_inputs, graph_report, input_names
from lowering.mesh import Mesh, require_mesh
from lowering.rates import Rates, resolve
from lowering.rules.control import forget_passes
from lowering.train_step import StepMemory, Training, step_memory
from namedmesh.checks import did_you_mean
from namedmesh.errors import LayoutError, NamedMeshError, ParameterError

Pairs = tuple[tuple[str, str], ...]  # (dim, mesh axis) in the order they were given


@dataclass
class Candidate:
    """One layout weighed: per-device flops and collective bytes (forward + backward),
    peak memory, predicted seconds split into compute and communication."""

    layout: Layout
    flops: float = math.nan
    bytes: float = math.nan
    memory: int = 0
    time: float = math.inf
    planned: float = math.inf  # the predicted time, whether or not it fits memory
    compute: float = math.nan
    comm: float = math.nan
    collectives: int = 0
    note: str = ""
    step: StepMemory | None = None  # the training step's memory by part (`training=`)
    sync: float = 0.0  # of `comm`, the data-parallel gradient sync (Rates.sync_seconds)
    pipelines: tuple = ()  # each pipelined scan's PipelinePlan (stages, microbatches)

    @property
    def valid(self) -> bool:
        return math.isfinite(self.time)


def rules_text(layout: Layout) -> str:
    return str(layout) or "(replicated)"


class Search(list):
    """The candidates weighed, best first, with the assumptions; `str()` explains it."""

    rates: Rates
    memory_limit: float | None
    seconds: float
    mesh: Mesh
    why: str = ""
    theirs: tuple[Candidate, ...] = ()  # the layouts the caller asked to be weighed
    _costing: _Costing | None = None

    def compare(self, layout: Layout | str) -> str:
        """One sentence on `layout` against the chosen one: chosen, not valid on the
        mesh (why), over the memory limit (by how much, and the time it would plan
        at), or slower (by how much, in compute or in communication). Costed as the
        search's candidates are; LayoutError if it names a mesh axis the mesh lacks or a
        dim the program lacks."""
        if self._costing is None:
            raise LayoutError(
                "auto_layout: this search was detached from its program (searched in a "
                "worker process: Search.detach); compare a layout on a search of this process"
            )
        layout = layout if isinstance(layout, Layout) else Layout(layout)
        check_axes(layout.rules, self.mesh, f"auto_layout: compared layout {layout}")
        _check_dims(layout, _dims(self._costing.graph), "compared")
        return versus(self, self._costing.of(layout, record=False))

    def detach(self) -> Search:
        """Itself without its costing (the traced program and the caller's function), so
        that it pickles: a joint search's worker sends it back (lowering/joint_jobs.py).
        `compare` then raises a LayoutError; the candidates and the printout stay."""
        self._costing = None
        return self

    def alike(self) -> list[list[Candidate]]:
        """The valid candidates, best first, in groups that plan alike (the same time,
        memory, flops, bytes and collectives: e.g. a rule for a dim that a split of
        another leaves with nothing to divide); the printout shows each group once."""
        groups: dict[tuple, list[Candidate]] = {}
        for c in self:
            if c.valid:
                key = (c.time, c.memory, c.flops, c.bytes, c.collectives)
                groups.setdefault(key, []).append(c)
        return list(groups.values())

    def invalid(self) -> Counter:
        """Count of the candidates not chosen for cause, by reason."""
        return Counter(c.note for c in self if not c.valid)

    def __str__(self) -> str:
        limit = self.memory_limit
        lines = [
            f"auto_layout on {self.mesh}: {len(self)} candidates planned in {self.seconds:.1f} s",
            f"rates: {self.rates}",
            "memory limit: "
            + (f"{limit / 2**30:.3g} GiB ({limit:,.0f} bytes) per device" if limit else "none"),
            "time = flops / flop rate + per collective (latency + bytes / rate of its kind), "
            "forward and backward, per device",
        ]
        top = self.alike()[:10]
        w = max([len("layout"), *(len(rules_text(g[0].layout)) for g in top)])
        lines.append(
            f"{'':>3} {'layout':<{w}} {'time ms':>9} {'compute':>9} {'comm':>9} "
            f"{'colls':>6} {'memory':>10}"
        )
        for i, (c, *same) in enumerate(top, 1):
            lines.append(
                f"{i:>3} {rules_text(c.layout):<{w}} {c.time * 1e3:>9.4g} "
                f"{c.compute * 1e3:>9.4g} {c.comm * 1e3:>9.4g} {c.collectives:>6} "
                f"{_bytes(c.memory):>10}" + (f"  (+{len(same)} alike)" if same else "")
            )
        for reason, n in sorted(self.invalid().items(), key=lambda x: -x[1]):
            lines.append(f"invalid: {n} x {reason}")
        lines.append(f"chosen: {rules_text(self[0].layout)}. {self.why}")
        lines += [f"yours: {rules_text(c.layout)}: {versus(self, c)}" for c in self.theirs]
        return "\n".join(lines)


def _bytes(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.3g} {unit}"
    return f"{n:.0f} B"


def to_layout(pairs: Pairs, mesh: Mesh) -> Layout:
    """Rules from (dim, axis) pairs: dims in the order first given, a dim's axes in the
    mesh's order (major to minor, as the mesh lays out devices)."""
    rules: dict[str, list[str]] = {}
    for d, a in pairs:
        rules.setdefault(d, []).append(a)
    order = list(mesh.sizes)
    return Layout([(d, tuple(sorted(axes, key=order.index))) for d, axes in rules.items()])


class _Costing:
    """Plans and costs candidates exactly, once per canonical form."""

    def __init__(self, fn, mesh, inputs, wrt, rates, limit, training=None, shared=None):
        self.fn, self.mesh, self.inputs, self.wrt = fn, mesh, inputs, wrt
        self.rates, self.limit, self.training = rates, limit, training
        self.graph = nm.trace(fn, *inputs)  # once: every candidate plans this graph
        self.shared = shared
        if shared is not None:  # its bodies and plans shared with other programs'
            self.graph = shared.adopt(self.graph)
        self.names = input_names(inputs)
        where = "auto_layout(grad_argnums=...)"
        self.wrt_inputs = None if wrt is None else argument_inputs(self.graph, inputs, wrt, where)
        self.shapes = {(v.dims, v.shape) for v in self.graph.values()}
        self.eqn_dims = {
            tuple(dict.fromkeys(d for v in (*e.inputs, *e.outputs) for d in v.dims))
            for e in self.graph.eqns
        }
        # axes of one size cost alike only where every axis talks at one rate
        self.renamings = _renamings(mesh) if rates.node is None else [{a: a for a in mesh.sizes}]
        self.renamed: list[dict] = [{} for _ in self.renamings]  # a value's axes, renamed
        self.seen: dict = {}  # canonical form -> Candidate
        self.keys: dict = {}  # form -> canonical form (the least renamed)
        self.by_pairs: dict = {}  # (dim, axis) pairs -> Candidate
        self.table = Search()

    def canonical(self, layout: Layout) -> tuple:
        """The layout of every value and of every equation's dims, the same for rule
        sets that plan alike; the least over renamings of equal-sized mesh axes, which
        cost alike at rates that are the same on every axis. A renamed layout assigns
        each value the renamed axes (in the mesh's order), so the form is found once and
        renamed, not found again per renaming."""
        values, eqns = self._form(layout)
        plain = (tuple(sorted(values)), tuple(sorted(eqns)))
        if plain not in self.keys:  # rule sets that plan alike rename alike
            self.keys[plain] = self._least_renamed(values, eqns)
        return self.keys[plain]

    def _least_renamed(self, values: list, eqns: list) -> tuple:
        keys = []
        for names, memo in zip(self.renamings, self.renamed, strict=True):
            for _, ax in (*values, *eqns):  # each value's axes renamed once per renaming
                if ax not in memo:
                    memo[ax] = self._rename(names, ax)
            keys.append(
                (
                    tuple(sorted((d, memo[ax]) for d, ax in values)),
                    tuple(sorted((d, memo[ax]) for d, ax in eqns)),
                )
            )
        return min(keys)

    def _rename(self, names: dict, ax: tuple) -> tuple:
        """Each dim's mesh axes in `ax` renamed by `names`, in the mesh's order."""
        order = {a: i for i, a in enumerate(self.mesh.sizes)}
        return tuple(tuple(sorted((names[a] for a in axes), key=order.get)) for axes in ax)

    def _form(self, layout: Layout) -> tuple[list, list]:
        sizes = self.mesh.sizes
        soft = lambda dims, shape: tuple(
            axes if n % math.prod(sizes[a] for a in axes) == 0 else ()
            for axes, n in zip(layout.assign(dims), shape, strict=True)
        )
        values = [((dims, shape), soft(dims, shape)) for dims, shape in self.shapes]
        eqns = [(dims, layout.assign(dims)) for dims in self.eqn_dims]
        return values, eqns

    def __call__(self, pairs: Pairs) -> Candidate:
        if pairs not in self.by_pairs:
            self.by_pairs[pairs] = self.of(to_layout(pairs, self.mesh))
        return self.by_pairs[pairs]

    def of(self, layout: Layout, record: bool = True) -> Candidate:
        """The candidate of `layout`, costed once per canonical form and options; a
        new one joins the table if `record`."""
        key = (self.canonical(layout), repr(sorted(layout.options.items())), layout.strict)
        if key not in self.seen:
            self.seen[key] = self._cost(layout)
            if record:
                self.table.append(self.seen[key])
        return self.seen[key]

    def _cost(self, layout: Layout) -> Candidate:
        cand = Candidate(layout)
        try:
            report = graph_report if self.shared is None else self.shared.report
            rep = report(self.graph, self.mesh, layout, self.wrt_inputs, self.names)
        except NamedMeshError as e:
            cand.note = "invalid: " + _reason(e)
            return cand
        sync = self.wrt is not None
        return report_candidate(cand, rep, self.mesh, self.rates, self.training, self.limit, sync)


def report_candidate(cand: Candidate, rep, mesh, rates, training=None, limit=None, sync=True):
    """`cand` (its layout's Candidate) filled from its layout's report `rep` on `mesh`:
    flops, bytes, pipelines, memory (the whole training step's under `training`, else
    the report's peak), collectives, compute and communication seconds at `rates`, the
    gradients' sync (`sync`), and over `limit` said in its note (time infinite)."""
    data = cand.layout.assign(("batch",))[0]
    cand.flops = rep.flops + rep.backward_flops
    cand.bytes, cand.memory = rep.bytes + rep.backward_bytes, rep.peak_memory
    cand.pipelines = tuple(rep.pipelines)
    if training is not None:  # the whole step: the optimizer's state too
        cand.step = step_memory(rep, mesh.sizes, data, training)
        cand.memory = cand.step.total
    cand.collectives = sum(n for n, _ in [*rep.collectives.values(), *rep.backward.values()])
    cand.compute = rates.compute_seconds(rep)
    cand.comm = rates.comm_seconds(rep)
    if sync:
        cand.sync = rates.sync_seconds(rep, data)
    cand.time = cand.planned = rates.step_seconds(cand.compute, cand.comm)
    if limit is not None and cand.memory > limit:
        cand.note, cand.time = "over the memory limit", math.inf
    return cand


def _renamings(mesh: Mesh, most: int = 120) -> list[dict[str, str]]:
    """Maps of mesh axis names that permute axes of equal size (the identity alone when
    there would be more than `most`)."""
    groups: dict[int, list[str]] = {}
    for a, n in mesh.sizes.items():
        groups.setdefault(n, []).append(a)
    if math.prod(math.factorial(len(g)) for g in groups.values()) > most:
        return [{a: a for a in mesh.sizes}]
    out = [{}]
    for g in groups.values():
        perms = list(itertools.permutations(g))
        out = [{**m, **dict(zip(g, p, strict=True))} for m in out for p in perms]
    return out


def _reason(e: Exception) -> str:
    """The error's message without the sizes and shapes that differ per candidate."""
    text = str(e).splitlines()[0]
    m = re.search(r"dim '(\w+)' of size \d+ is not divisible", text)
    if m:
        return f"dim {m.group(1)!r} not divisible by its mesh axes"
    text = re.sub(r"\[[^\]]*\]|\([^)]*\)|\d+", "", text)
    return re.sub(r"\s+", " ", text).strip()[:100]


def _rank(c: Candidate, room: float = 1.0, limit: float | None = None) -> tuple:
    """Order of candidates: valid ones that fit (memory / `room` within `limit`) by time,
    then the rest by memory (a search over the limit moves towards fitting)."""
    if c.note.startswith("invalid"):
        return (2, math.inf)
    fits = limit is None or c.memory / room <= limit
    return (0, c.time) if fits and math.isfinite(c.time) else (1, c.memory)


def _dims(graph) -> dict[str, int]:
    """Each dim of the program and the size an axis must divide: its size in the
    program's inputs and outputs (which must divide exactly), else its largest."""
    sizes: dict[str, int] = {}
    for v in graph.values():
        for d, n in zip(v.dims, v.shape, strict=True):
            sizes[d] = max(sizes.get(d, 0), n)
    for v in (*graph.inputs, *graph.outputs):
        for d, n in zip(v.dims, v.shape, strict=True):
            sizes[d] = math.gcd(sizes[d], n) if d in sizes else n
    return sizes


@few_collections()  # the collector held back: a fifth of a search's time (collector.py)
def auto_layout(
    fn,
    mesh: Mesh,
    *inputs,
    memory_limit: float | None = None,
    grad_argnums: int | tuple[int, ...] = (),
    rates: Rates | str | None = None,
    beam: int = 3,
    cache_dir=None,
    candidates: Sequence[Layout | str] = (),
    training: Training | None = None,
    shared: Shared | None = None,
    seeds: Sequence[Layout | str] = (),
    plateau: float = 0.0,
) -> tuple[Layout, Search]:
    """The Layout with the least predicted step time of `fn(*inputs)` on `mesh` among those
    within `memory_limit` bytes per device, and the Search (candidates best first, and the
    assumptions; `print` it). See the module docstring for the method.

    `rates`: a Rates, a hardware name of `lowering.rates.HARDWARE` ("tpu_v2", "h100", ...),
    or None to measure the mesh's devices (`lowering.rates.measure`, cached in memory and
    in `cache_dir` if given). `memory_limit` defaults to the rates' memory per device.
    `grad_argnums`: the inputs a training step differentiates (their gradient syncs and
    the backward pass are costed). `candidates`: layouts of the caller's (a paper's rules,
    the layout in use) weighed beside the search's, chosen if best; the printout says of
    each why it was or was not chosen (`Search.compare` says it of any layout afterwards).
    `training` (a lowering.train_step.Training): the memory held against the limit is
    the whole training step's (optimizer state, accumulator: `step_memory`), not the
    gradient's alone; each candidate's parts are its `step`.
    `shared`: a lowering.bodies.Shared kept across the searches of programs that differ
    in remat alone (a plan's pairs), their scan bodies and plans planned once for all of
    them; the caller empties it when done (`Shared.forget`).
    `seeds`: layouts (another program's choice: a joint search's lead pair's,
    lowering/joint.py) that phase 2 may climb from beside phase 1's states: each one
    whose dims the program has and divides as its axes need joins them, and the climb
    starts from the best (`_seeded`). Where a seed is the best, the climb extends it
    alone: about 40 candidates, not the 150 to 250 of a climb from phase 1.
    `plateau`: a fraction (0 to 1, lowering.search.PLATEAU = 1% for a joint search's
    pairs): while nothing the climb reached fits, it stops at a step that lowers the
    least memory by less than this (`_share`); 0 (the default) never stops early.
    LayoutError when no candidate is valid and fits (its `search` holds the candidates
    weighed), or when one of `candidates` names a mesh axis `mesh` lacks or a dim the
    program lacks."""
    start = time.perf_counter()
    mesh = require_mesh(mesh, "auto_layout")
    _check_parameters(memory_limit, beam, plateau)
    wrt = argnum_tuple(grad_argnums, "auto_layout(grad_argnums=...)")
    rates = resolve(rates, mesh, cache_dir)
    limit = rates.memory_bytes if memory_limit is None else memory_limit
    if isinstance(candidates, str | dict | Layout):  # one layout, not a sequence of its parts
        candidates = (candidates,)
    theirs = [c if isinstance(c, Layout) else Layout(c) for c in candidates]
    for layout in theirs:
        check_axes(layout.rules, mesh, f"auto_layout: candidate layout {layout}")
    seeds = [s if isinstance(s, Layout) else Layout(s) for s in seeds]
    for layout in seeds:
        check_axes(layout.rules, mesh, f"auto_layout: seed layout {layout}")
    if training is not None and not wrt:
        raise ParameterError("auto_layout: training= plans a training step; give grad_argnums")
    cost = _Costing(fn, mesh, inputs, wrt or None, rates, limit, training, shared)
    dims = _dims(cost.graph)
    for layout in theirs:
        _check_dims(layout, dims, "candidate")
    table = cost.table
    table.theirs, table._costing = tuple(map(cost.of, theirs)), cost
    states = _by_axis(cost, mesh, dims, beam)
    start_from = _seeded(cost, states, seeds, mesh, dims, beam) if seeds else states
    _share(cost, start_from, mesh, dims, beam, plateau)
    if shared is None:  # else the caller's, shared with its other searches
        forget_passes(cost.graph)
    table.sort(key=lambda c: (_rank(c), len(c.layout.rules)))
    table.rates, table.memory_limit, table.mesh = rates, limit, mesh
    table.seconds = time.perf_counter() - start
    if not table[0].valid:
        error = LayoutError(
            f"auto_layout: no layout on {mesh} is valid and fits memory_limit={limit} "
            f"(of {len(table)} planned: {dict(table.invalid())})"
        )
        error.search = table
        raise error
    table[0].note = "chosen: least predicted time"
    table.why = explain(table)
    return table[0].layout, table


def cost_layout(
    fn,
    mesh: Mesh,
    *inputs,
    layout: Layout | str,
    grad_argnums=(),
    rates: Rates | str | None = None,
    memory_limit: float | None = None,
    training: Training | None = None,
) -> Candidate:
    """The Candidate of `layout` alone, costed as `auto_layout` costs its candidates (the
    same arguments), with no search: its time, memory (`step` under `training`) and,
    when it is not valid or over `memory_limit`, why in its `note`."""
    mesh = require_mesh(mesh, "cost_layout")
    _check_parameters(memory_limit, 1)
    wrt = argnum_tuple(grad_argnums, "cost_layout(grad_argnums=...)")
    rates = resolve(rates, mesh, None)
    layout = layout if isinstance(layout, Layout) else Layout(layout)
    check_axes(layout.rules, mesh, f"cost_layout: layout {layout}")
    if training is not None and not wrt:
        raise ParameterError("cost_layout: training= plans a training step; give grad_argnums")
    limit = rates.memory_bytes if memory_limit is None else memory_limit
    cost = _Costing(fn, mesh, inputs, wrt or None, rates, limit, training)
    _check_dims(layout, _dims(cost.graph), "cost_layout's")
    return cost.of(layout, record=False)


def _check_parameters(memory_limit, beam, plateau=0.0) -> None:
    """ParameterError for a memory limit that is not a positive number of bytes or inf
    (a string such as "8GiB", 0, NaN), a beam that is not a positive int, or a plateau
    not in [0, 1): each would make the search choose from nothing, compare bytes with a
    string, or stop where it should not."""
    number = isinstance(memory_limit, numbers.Real) and not isinstance(memory_limit, bool)
    if memory_limit is not None and not (number and memory_limit > 0):  # NaN > 0 is False
        raise ParameterError(
            f"auto_layout: memory_limit must be a positive number of bytes per device "
            f"(e.g. 8 * 2**30; math.inf: no limit) or None (the rates' memory), "
            f"got {memory_limit!r}"
        )
    if not isinstance(beam, numbers.Integral) or isinstance(beam, bool) or beam < 1:
        raise ParameterError(
            f"auto_layout: beam must be a positive int (states kept per step), got {beam!r}"
        )
    real = isinstance(plateau, numbers.Real) and not isinstance(plateau, bool)
    if not (real and 0 <= plateau < 1):  # NaN fails both
        raise ParameterError(
            f"auto_layout: plateau must be a fraction in [0, 1) (the least gain in memory "
            f"a step of a descent over the limit keeps climbing for), got {plateau!r}"
        )


def _options(graph, dims: dict[str, int]) -> list[tuple[str, ...]]:
    """What phase 1 may give one mesh axis: one dim, or a largest group of dims no value
    holds two of (Megatron's heads, d_ff and vocab on one model axis), in rule order."""
    together = {frozenset(p) for v in graph.values() for p in itertools.combinations(v.dims, 2)}
    apart = lambda d, group: all(frozenset((d, e)) not in together for e in group)
    groups: set[tuple[str, ...]] = set()
    for d in dims:  # greedily from each dim: a maximal group containing it
        group = [d]
        for e in dims:
            if e not in group and apart(e, group):
                group.append(e)
        if len(group) > 1:
            groups.add(tuple(sorted(group, key=list(dims).index)))
    return [(d,) for d in dims] + sorted(groups)


def _by_axis(cost, mesh, dims, beam) -> list[Pairs]:
    """Phase 1: each mesh axis, largest first, to one dim, a group, or none; a beam."""
    axes = sorted((a for a in mesh.sizes if mesh.sizes[a] > 1), key=lambda a: -mesh.sizes[a])
    options = _options(cost.graph, dims)
    states: list[Pairs] = [()]
    for i, axis in enumerate(axes):
        room = math.prod(mesh.sizes[a] for a in axes[i + 1 :])
        grown = []
        for s in states:
            grown.append(s)
            for group in options:
                fit = [d for d in group if dims[d] % (_split(s, d, mesh) * mesh.sizes[axis]) == 0]
                if fit:
                    grown.append((*s, *((d, axis) for d in fit)))
        states = _best(cost, grown, beam, beam, room)
    return states


def _best(cost, states: list[Pairs], fit: int, fast: int, room: float = 1.0) -> list[Pairs]:
    """The frontier kept of `states`: one state per cost (planned time, memory and
    collectives; the first given, a state before its extensions: a state that only adds
    a pair that changes nothing would fill the beam with copies of one layout), the
    `fit` best by `_rank` (those that fit, or could fit with `room` more ways to split,
    by time; then the rest by memory), and up to `fast` states that do not fit yet are
    faster than every state that does: of those, the ones no other is both faster and
    smaller than, the smallest first. The second half keeps a fast state whose
    completions (an axis shared by one more dim: FSDP) may fit: a memory bound on
    partial states is no bound on their completions, and ranking by it alone lost the
    best layout (a 2x4 MLP under a limit no phase-1 state met; `lm1b_2`, whose paper
    layout is over 8 GiB, by 0.07%)."""
    first: dict[tuple, Pairs] = {}
    for s in states:  # of states that cost alike, the first stands for all
        c = cost(s)
        if not c.note.startswith("invalid"):
            first.setdefault((c.planned, c.memory, c.collectives), s)
    rank = {s: _rank(cost(s), room, cost.limit) for s in first.values()}
    ranked = sorted(rank, key=rank.get)
    fits = [s for s in ranked if rank[s][0] == 0]
    fastest = cost(fits[0]).planned if fits else math.inf
    over = [s for s in ranked if rank[s][0] == 1 and cost(s).planned < fastest]
    front, least = [], math.inf
    for s in sorted(over, key=lambda s: (cost(s).planned, cost(s).memory)):
        if cost(s).memory < least:
            front.append(s)
            least = cost(s).memory
    front.sort(key=lambda s: cost(s).memory)
    return list(dict.fromkeys([*ranked[:fit], *front[:fast]]))


def _seeded(cost, states: list[Pairs], seeds, mesh, dims, beam: int) -> list[Pairs]:
    """Phase 1's `states` and the `seeds` (layouts) as pairs, then the frontier of them
    all (`_best`, as phase 1 keeps its own). A seed is mended to fit the program: a rule
    whose dim it lacks left out, a dim's minor axes given up until their product divides
    its size (a seed from a program of fewer rows, other microbatches, may split a batch
    this one's does not divide)."""
    seeded = []
    for layout in seeds:
        pairs = []
        for d, axes in layout.rules:
            axes = list(axes)
            while d in dims and dims[d] % math.prod(mesh.sizes[a] for a in axes):
                axes.pop()
            pairs += [(d, a) for a in axes if d in dims]
        seeded.append(tuple(pairs))
    return _best(cost, [*states, *seeded], beam, beam)


def _split(state: Pairs, dim: str, mesh) -> int:
    """How many ways `state` splits `dim` already."""
    return math.prod(mesh.sizes[a] for d, a in state if d == dim)


PLATEAU = 0.01  # a descent over the limit that gains less than this a step stops


def _share(cost, states: list[Pairs], mesh, dims, beam: int, plateau: float = 0.0) -> None:
    """Phase 2: give one more dim an axis, or every axis it lacks at once (after the
    dims those axes have). The best state phase 1 kept that fits is extended, and every
    one over the limit; then, best first, each state not yet extended of a frontier of
    the best state and up to `beam` over the limit but faster (`_best`), until none is
    left. With no state over the limit this is a climb from the best, each step the
    best move.

    While no state reached fits, the climb is a descent by memory; with `plateau` > 0 it
    stops at the first step that lowers the least memory reached (phase 1's, before the
    first) by less than `plateau` of it. Such descents find nothing that fits: the
    Llama 3 70B plan's `remat=none, grad_accum=1` pair stays at 1,262.3 GiB four steps
    running, against 74.5 GiB, and 27 of the 51 steps of its plan's 13 failing searches
    gained under 1%. The cost: the least memory such a search reports (the closest
    plan a joint search's refusal names) is overstated by what the steps it skipped
    would have gained, the first of them under `plateau`; and a search that would have
    reached a fitting layout after such a step is refused. 0 (`auto_layout`'s default, a
    joint search's `exhaustive` pairs) never stops early."""
    extended: set[int] = set()
    fits = [s for s in states if _rank(cost(s), 1.0, cost.limit)[0] == 0]
    frontier, todo = states, [*fits[:1], *(s for s in states if s not in fits)]
    valid = [cost(s).memory for s in states if not cost(s).note.startswith("invalid")]
    least = min(valid, default=math.inf)  # the least memory reached so far
    while todo:
        moves = [m for state in todo for m in _moves(state, mesh, dims)]
        extended.update(id(cost(s)) for s in todo)
        frontier = _best(cost, [*frontier, *moves], 1, beam)
        todo = [s for s in frontier if id(cost(s)) not in extended][:1]
        if not todo or _plateau(cost(frontier[0]), least, cost.limit, plateau):
            return
        least = min(least, cost(frontier[0]).memory)


def _plateau(best: Candidate, least: float, limit: float, plateau: float) -> bool:
    """Whether a descent over the limit stalls: `best` (the frontier's first) does not fit
    and is within `plateau` of the `least` memory before the step."""
    return _rank(best, 1.0, limit)[0] == 1 and best.memory > least * (1 - plateau)


def _moves(state: Pairs, mesh, dims: dict[str, int]) -> list[Pairs]:
    """Phase 2's moves from `state`: a dim takes one mesh axis more, or all it lacks (a
    split over the whole mesh, `batch:x,y` after `d_ff:x,y`, which one axis at a time
    may pass through layouts over the limit or slower); two split dims swap their
    axes (`d_ff:x;batch:y,z` to `d_ff:y,z;batch:x`: which dim takes the larger split
    is decided in phase 1 one axis at a time, and two moves apart otherwise); or a dim
    gives up one of its axes, which another dim may take (phase 1 gave it an axis that
    a later share made the wrong one: it mends 4 of 9 misses of 270 3-axis MLP searches)."""
    out = []
    for d in dims:
        lacks = [a for a in mesh.sizes if mesh.sizes[a] > 1 and (d, a) not in state]
        for group in [[a] for a in lacks] + ([lacks] if len(lacks) > 1 else []):
            if dims[d] % (_split(state, d, mesh) * math.prod(mesh.sizes[a] for a in group)) == 0:
                out.append((*state, *((d, a) for a in group)))
    axes: dict[str, list[str]] = {}
    for d, a in state:
        axes.setdefault(d, []).append(a)
    for d, e in itertools.combinations(axes, 2):
        swapped = {**axes, d: axes[e], e: axes[d]}
        if all(dims[x] % math.prod(mesh.sizes[a] for a in swapped[x]) == 0 for x in (d, e)):
            out.append(tuple((x, a) for x in axes for a in swapped[x]))
    for i, (d, a) in enumerate(state):  # a dim gives up one axis, kept or handed on
        rest = (*state[:i], *state[i + 1 :])
        out.append(rest)
        takers = (e for e in dims if e != d and (e, a) not in rest)
        out.extend((*rest, (e, a)) for e in takers
                   if dims[e] % (_split(rest, e, mesh) * mesh.sizes[a]) == 0)  # fmt: skip
    return out


def explain(table: Search, within: float = 0.01) -> str:
    """One sentence on why the first candidate won: against the best valid layout more
    than `within` slower, and how many layouts came within that of it."""
    win = table[0]
    valid = [c for c in table[1:] if c.valid]
    near = [c for c in valid if c.time <= win.time * (1 + within)]
    rest = [c for c in valid if c.time > win.time * (1 + within)]
    over = sum(1 for c in table if c.note == "over the memory limit")
    tail = f" {len(near)} other layouts came within {within:.0%} of it" if near else ""
    tail += f"{';' if tail else ''} {over} were over the memory limit" if over else ""
    tail = f";{tail}." if tail else "."
    if not rest:
        return f"No valid layout that fits is more than {within:.0%} slower{tail}"
    nxt = rest[0]
    if nxt.compute - win.compute >= nxt.comm - win.comm:
        why = (
            f"it divides the work more ({win.compute * 1e3:.3g} ms of compute against "
            f"{nxt.compute * 1e3:.3g} ms)"
        )
    else:
        why = (
            f"it communicates less ({win.comm * 1e3:.3g} ms in {win.collectives} collectives "
            f"against {nxt.comm * 1e3:.3g} ms in {nxt.collectives})"
        )
    return (
        f"It is {nxt.time / win.time:.3g}x faster than the next different layout, "
        f"{rules_text(nxt.layout)} ({win.time * 1e3:.4g} against {nxt.time * 1e3:.4g} ms per "
        f"step), because {why}{tail}"
    )


def _check_dims(layout: Layout, dims, what: str) -> None:
    """LayoutError naming the first rule of `layout` whose dim the program lacks (a
    typo), unless the layout is `shared` (it may serve other programs)."""
    for d, axes in layout.rules:
        if d not in dims and not layout.shared:
            raise LayoutError(
                f"auto_layout: {what} layout {layout}: rule {d}:{','.join(axes)} names dim "
                f"{d!r}, which no value of the program has{did_you_mean(d, dims) or '.'} "
                f"Its dims: {sorted(dims)}."
            )


def versus(table: Search, cand: Candidate) -> str:
    """Why `cand` was or was not chosen, against the chosen `table[0]`."""
    win = table[0]
    if cand is win:
        return "chosen."
    if cand.note.startswith("invalid"):
        return f"not valid on {table.mesh} ({cand.note.removeprefix('invalid: ')})."
    ratio = f"{cand.planned / win.time:.4g}x the chosen's {win.time * 1e3:.4g} ms"
    if not cand.valid:
        return (
            f"over the memory limit ({_bytes(cand.memory)} per device against "
            f"{_bytes(table.memory_limit)}), though it would plan at "
            f"{cand.planned * 1e3:.4g} ms per step, {ratio}."
        )
    return (
        f"{cand.time * 1e3:.4g} ms per step, {ratio}: compute {cand.compute * 1e3:.4g} ms "
        f"against {win.compute * 1e3:.4g}, communication {cand.comm * 1e3:.4g} ms in "
        f"{cand.collectives} collectives against {win.comm * 1e3:.4g} in {win.collectives}."
    )
