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
   to one dim (a dim already split takes the axis too: `batch:rows,cols`) or to none;
   the `beam` best states by predicted time whose memory could still fit (memory over
   the product of the axes not yet given) go on.
2. Sharing: from the best full states, an axis is given to one more dim, after the
   ones it has (rule order: the earlier dim keeps the axis where a value holds both).
   This makes Megatron's `heads;d_ff;vocab` on one model axis, FSDP (`d_model` on the
   data axis after `batch`: parameters split, activations not), and a sequence split
   (`length`) beside any of them. The best improvement is taken until none improves.

Each candidate's time is `Rates.seconds` of its report (lowering/rates.py): flops at
the device's flop rate, each collective's latency and bytes at its kind's rate. The
memory limit is a constraint: a layout over it is never chosen. Rule sets that give
every value and every equation the same layout are planned once (memoised by that
canonical form).
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections import Counter
from dataclasses import dataclass

import namedmesh as nm
from lowering.layout import Layout
from lowering.lower import argument_inputs, graph_report, input_names
from lowering.mesh import Mesh
from lowering.rates import Rates, resolve
from namedmesh.errors import LayoutError, NamedMeshError

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
    compute: float = math.nan
    comm: float = math.nan
    collectives: int = 0
    note: str = ""

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
        top = [c for c in self if c.valid][:10]
        w = max([len("layout"), *(len(rules_text(c.layout)) for c in top)])
        lines.append(
            f"{'':>3} {'layout':<{w}} {'time ms':>9} {'compute':>9} {'comm':>9} "
            f"{'colls':>6} {'memory':>10}"
        )
        for i, c in enumerate(top, 1):
            lines.append(
                f"{i:>3} {rules_text(c.layout):<{w}} {c.time * 1e3:>9.4g} "
                f"{c.compute * 1e3:>9.4g} {c.comm * 1e3:>9.4g} {c.collectives:>6} "
                f"{_bytes(c.memory):>10}"
            )
        for reason, n in sorted(self.invalid().items(), key=lambda x: -x[1]):
            lines.append(f"invalid: {n} x {reason}")
        lines.append(f"chosen: {rules_text(self[0].layout)}. {self.why}")
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

    def __init__(self, fn, mesh, inputs, wrt, rates, limit):
        self.fn, self.mesh, self.inputs, self.wrt = fn, mesh, inputs, wrt
        self.rates, self.limit = rates, limit
        self.graph = nm.trace(fn, *inputs)  # once: every candidate plans this graph
        self.names = input_names(inputs)
        self.wrt_inputs = None if wrt is None else argument_inputs(self.graph, inputs, wrt)
        self.shapes = {(v.dims, v.shape) for v in self.graph.values()}
        self.eqn_dims = {
            tuple(dict.fromkeys(d for v in (*e.inputs, *e.outputs) for d in v.dims))
            for e in self.graph.eqns
        }
        self.renamings = _renamings(mesh)
        self.seen: dict = {}  # canonical form -> Candidate
        self.by_pairs: dict = {}  # (dim, axis) pairs -> Candidate
        self.table = Search()

    def canonical(self, layout: Layout) -> str:
        """The layout of every value and of every equation's dims, the same for rule
        sets that plan alike; the least over renamings of equal-sized mesh axes, which
        cost alike at rates that are the same on every axis."""
        keys = []
        for names in self.renamings:
            order = list(self.mesh.sizes)  # a dim's axes in the mesh's order
            renamed = Layout(
                [
                    (d, tuple(sorted((names[a] for a in axes), key=order.index)))
                    for d, axes in layout.rules
                ]
            )
            keys.append(self._form(renamed))
        return min(keys)

    def _form(self, layout: Layout) -> str:
        sizes = self.mesh.sizes
        soft = lambda dims, shape: tuple(
            axes if n % math.prod(sizes[a] for a in axes) == 0 else ()
            for axes, n in zip(layout.assign(dims), shape, strict=True)
        )
        values = sorted(repr((dims, soft(dims, shape))) for dims, shape in self.shapes)
        eqns = sorted(repr((dims, layout.assign(dims))) for dims in self.eqn_dims)
        return repr((values, eqns))

    def __call__(self, pairs: Pairs) -> Candidate:
        if pairs not in self.by_pairs:
            layout = to_layout(pairs, self.mesh)
            key = self.canonical(layout)
            if key not in self.seen:
                self.seen[key] = self._cost(layout)
                self.table.append(self.seen[key])
            self.by_pairs[pairs] = self.seen[key]
        return self.by_pairs[pairs]

    def _cost(self, layout: Layout) -> Candidate:
        cand = Candidate(layout)
        try:
            rep = graph_report(self.graph, self.mesh, layout, self.wrt_inputs, self.names)
        except NamedMeshError as e:
            cand.note = "invalid: " + _reason(e)
            return cand
        cand.flops = rep.flops + rep.backward_flops
        cand.bytes, cand.memory = rep.bytes + rep.backward_bytes, rep.peak_memory
        cand.collectives = sum(n for n, _ in [*rep.collectives.values(), *rep.backward.values()])
        cand.compute = self.rates.compute_seconds(rep)
        cand.comm = self.rates.comm_seconds(rep)
        cand.time = self.rates.overhead_s + cand.compute + cand.comm
        if self.limit is not None and cand.memory > self.limit:
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


def auto_layout(
    fn,
    mesh: Mesh,
    *inputs,
    memory_limit: float | None = None,
    grad_argnums: int | tuple[int, ...] = (),
    rates: Rates | str | None = None,
    beam: int = 3,
    cache_dir=None,
) -> tuple[Layout, Search]:
    """The Layout with the least predicted step time of `fn(*inputs)` on `mesh` among those
    within `memory_limit` bytes per device, and the Search (candidates best first, and the
    assumptions; `print` it). See the module docstring for the method.

    `rates`: a Rates, a hardware name of `lowering.rates.HARDWARE` ("tpu_v2", "h100", ...),
    or None to measure the mesh's devices (`lowering.rates.measure`, cached in memory and
    in `cache_dir` if given). `memory_limit` defaults to the rates' memory per device.
    `grad_argnums`: the inputs a training step differentiates (their gradient syncs and
    the backward pass are costed). LayoutError when no candidate is valid and fits."""
    start = time.perf_counter()
    rates = resolve(rates, mesh, cache_dir)
    limit = rates.memory_bytes if memory_limit is None else memory_limit
    wrt = (grad_argnums,) if isinstance(grad_argnums, int) else tuple(grad_argnums)
    cost = _Costing(fn, mesh, inputs, wrt or None, rates, limit)
    dims = _dims(cost.graph)
    _share(cost, min(_by_axis(cost, mesh, dims, beam), key=lambda s: _rank(cost(s))), mesh, dims)
    table = cost.table
    table.sort(key=lambda c: (_rank(c), len(c.layout.rules)))
    table.rates, table.memory_limit, table.mesh = rates, limit, mesh
    table.seconds = time.perf_counter() - start
    if not table[0].valid:
        raise LayoutError(
            f"auto_layout: no layout on {mesh} is valid and fits memory_limit={limit} "
            f"(of {len(table)} planned: {dict(table.invalid())})"
        )
    table[0].note = "chosen: least predicted time"
    table.why = explain(table)
    return table[0].layout, table


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
        ranked = sorted(dict.fromkeys(grown), key=lambda s: _rank(cost(s), room, cost.limit))
        distinct = {id(cost(s)): s for s in reversed(ranked)}  # one state per candidate
        ranked = [s for s in ranked if distinct[id(cost(s))] is s]
        states = [s for s in ranked if not cost(s).note.startswith("invalid")][:beam]
    return states


def _split(state: Pairs, dim: str, mesh) -> int:
    """How many ways `state` splits `dim` already."""
    return math.prod(mesh.sizes[a] for d, a in state if d == dim)


def _share(cost, state: Pairs, mesh, dims) -> None:
    """Phase 2: from the best state, give an axis one more dim of the program's inputs
    (parameters: FSDP; tokens' length: sequence split) while that improves it."""
    input_dims = [d for d in dims if any(d in v.dims for v in cost.graph.inputs)]
    while True:
        moves = [
            (*state, (d, a))
            for a in mesh.sizes
            if mesh.sizes[a] > 1
            for d in input_dims
            if (d, a) not in state and dims[d] % (_split(state, d, mesh) * mesh.sizes[a]) == 0
        ]
        if not moves:
            break
        step = min(moves, key=lambda s: _rank(cost(s)))
        if _rank(cost(step)) >= _rank(cost(state)):
            break
        state = step


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
