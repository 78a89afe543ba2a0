"""Pipeline stages in planning, uneven ones included: a model's layers (one or more
stacks, DeepSeek-V3's 3 dense then 58 mixture-of-experts layers) dealt to S stages as
evenly as possible, and the step costed by its slowest stage.

`assign_stages([3, 58], 16)`: 61 layers in order, 13 stages of 4 then 3 of 3 (stage 0
holds the 3 dense layers and the first MoE layer). Each distinct stage (its layers per
stack, and whether it is the first, which embeds the tokens, or the last, which holds
the loss head) is a program of its own, traced by the caller's `build(settings, counts,
first, last)` on one microbatch of batch / M rows (a middle stage's input is the
previous stage's activation, its loss the dot of its output with the gradient sent
back), and laid out by `auto_layout` on the mesh without the stage axis, its memory
held to the limit with the microbatches in flight there: one layout for every stage,
searched on the first stage (the most in flight) and searched again on the stage that
does not fit under it, if one does not. A mixture-of-experts stage routes each
microbatch on its own (capacity per microbatch): a microbatch is a routing group, so
M > 1 is planned for MoE stacks too.

The step, under a 1F1B schedule (GPipe's ticks, 1F1B's memory):

    time        (M + S - 1) ticks of the slowest stage's microbatch (forward, backward
                and their collectives but the gradient sync), plus the boundary's
                activation sent to the next stage and its gradient back, per tick (the
                stage axis crosses nodes), plus the data-parallel gradient sync once
                per step (the gradients accumulate locally over the microbatches; the
                slowest stage's sync: Rates.sync_seconds)
    memory      the largest of the stages': its parameters, gradients (and their
                accumulator), optimizer state, and min(M, S - s) microbatches'
                saved activations and inputs in flight at stage s (one working set)

Runtime: lowering/pipeline.py runs the model's stacks as one pipeline over the stage
axis (nm.scan_chain, namedmesh/chain.py, where it has two; a stack that S does not
divide padded to S equal stages: namedmesh/uneven.py), its stages holding the layers
dealt here; the trainer keeps the stacks padded. Each stack takes on every stage the
slots of the stage that holds most of it (sum_i max_s counts[s][i] slots a stage), and
the pad slots' layer work is skipped (a jax.lax.cond per slot, lowering/emit.py): a
stage's tick is its real layers' plus each slot's bookkeeping (its weights sliced out,
its residuals stored, pads' too: benchmarks.pad_skip, most of a slot at tiny sizes, the
weights' copy against the layer's work at scale), idling the rest of the slowest stage's
tick, which is what the plan charges (`StagedChoice.runtime` says so in words). A MoE
body runs any number of microbatches, each routed on its own and its balancing loss
averaged over them (`mixing_op`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import namedmesh as nm
from lowering.layout import Layout
from lowering.mesh import Mesh
from lowering.rates import Rates, levels
from lowering.search import Candidate, auto_layout, cost_layout
from lowering.train_step import StepMemory, Training
from namedmesh.checks import did_you_mean
from namedmesh.errors import LayoutError, ParameterError
from namedmesh.uneven import Deal

STAGE_AXIS = "stage"


def assign_stages(stacks, stages: int) -> list[tuple[int, ...]]:
    """The layers of consecutive `stacks` (their layer counts, in order) dealt to `stages`
    stages, each a tuple of its layers per stack: sizes differ by at most one, the
    larger stages first. ParameterError for fewer layers than stages."""
    stacks = list(stacks)
    total = sum(stacks)
    if not isinstance(stages, int) or stages < 1 or any(n < 0 for n in stacks):
        raise ParameterError(f"assign_stages: stages must be an int >= 1, got {stages!r}")
    if total < stages:
        raise ParameterError(
            f"assign_stages: {total} layers cannot fill {stages} stages (one layer each at least)"
        )
    base, extra = divmod(total, stages)
    sizes = [base + 1] * extra + [base] * (stages - extra)
    out, stack, left = [], 0, stacks[0] if stacks else 0
    for size in sizes:
        counts = [0] * len(stacks)
        while size:
            while left == 0:
                stack += 1
                left = stacks[stack]
            take = min(size, left)
            counts[stack] += take
            size, left = size - take, left - take
        out.append(tuple(counts))
    return out


def inner_mesh(mesh: Mesh) -> Mesh:
    """`mesh` without its stage axis: the devices of one stage."""
    return Mesh({a: n for a, n in mesh.sizes.items() if a != STAGE_AXIS}, devices="abstract")


@dataclass
class StageCost:
    """One distinct stage: its layers per stack, whether first and last, its positions
    and its candidate (its memory with the most microbatches in flight of them)."""

    counts: tuple[int, ...]
    positions: list[int]
    candidate: Candidate
    first: bool = False
    last: bool = False


@dataclass
class StagedChoice:
    """A pipelined plan: `mesh` with a stage axis of S, M microbatches
    (settings.grad_accum), the stages' assignment and each distinct stage's cost."""

    mesh: Mesh
    settings: object  # lowering.joint.Settings
    assignment: list[tuple[int, ...]]
    costs: list[StageCost]
    boundary_bytes: float  # one microbatch's activation at a stage boundary, per device
    rates: Rates
    model_flops: float
    limit: float
    uneven: bool
    moe_microbatches: bool
    note: str = ""

    @property
    def stages(self) -> int:
        return len(self.assignment)

    @property
    def microbatches(self) -> int:
        return self.settings.grad_accum

    @property
    def bubble(self) -> float:
        """(S-1)/(M+S-1) of the ticks idle."""
        return (self.stages - 1) / (self.microbatches + self.stages - 1)

    def tick_seconds(self, cost: StageCost) -> float:
        """A stage's microbatch, forward and backward, but its gradient sync."""
        c = cost.candidate
        if c.step is None:  # its layout is not valid on this stage
            return math.inf
        return self.rates.step_seconds(c.compute, c.comm - c.sync)

    @property
    def slowest(self) -> StageCost:
        """The stage whose microbatch takes longest (the pipeline's tick)."""
        return max(self.costs, key=self.tick_seconds)

    @property
    def candidate(self) -> Candidate:
        """The slowest stage's candidate (its layout is the plan's)."""
        return self.slowest.candidate

    @property
    def layout(self):
        """The layout of every stage (searched on the largest), on the stage's devices."""
        return self.costs[0].candidate.layout

    @property
    def memory(self) -> StepMemory:
        """The largest stage's memory (each distinct stage's at its first position, the
        most microbatches in flight)."""
        steps = [c.candidate.step for c in self.costs if c.candidate.step is not None]
        return max(steps, key=lambda m: m.total, default=StepMemory(0, 0, 0, 0, 0))

    @property
    def fits(self) -> bool:
        valid = all(c.candidate.step is not None for c in self.costs)
        return valid and self.memory.total <= self.limit

    @property
    def ticks(self) -> int:
        return self.microbatches + self.stages - 1

    @property
    def send_seconds(self) -> float:
        """Per tick: the boundary activation to the next stage and its gradient back,
        across the stage axis's level."""
        items = tuple(self.mesh.sizes.items())
        node = self.rates.node
        split = levels(items, node) if node else {a: (n, 1) for a, n in items}
        one = self.rates.collective_seconds("ppermute", (STAGE_AXIS,), 1, self.boundary_bytes,
                                            split)  # fmt: skip
        return 2 * one

    @property
    def compute_seconds(self) -> float:
        return self.ticks * self.slowest.candidate.compute

    @property
    def sync_seconds(self) -> float:
        """The gradient sync, once per step: the slowest stage's."""
        return max(c.candidate.sync for c in self.costs)

    @property
    def comm_seconds(self) -> float:
        """Per tick, the slowest stage's collectives but its gradient sync, and the
        boundary's sends; the sync once."""
        tick = self.slowest.candidate.comm - self.slowest.candidate.sync + self.send_seconds
        return self.ticks * tick + self.sync_seconds

    @property
    def step_seconds(self) -> float:
        return self.rates.step_seconds(self.compute_seconds, self.comm_seconds)

    def mfu(self, rates: Rates) -> float:
        return self.model_flops / (self.mesh.size * rates.flops_per_s * self.step_seconds)

    def tokens_per_second_per_device(self, tokens: int) -> float:
        return tokens / self.step_seconds / self.mesh.size

    @property
    def planned_deal(self) -> Deal:
        """The assignment as the plan charges it: every stage a tick of the slowest, so a
        stage of fewer layers than the most idles the difference (its pads)."""
        return Deal(tuple(self.assignment), (max(map(sum, self.assignment)),))

    @property
    def runtime_deal(self) -> Deal:
        """The assignment as lowering.pipeline runs it: each stack (nm.scan_chain) takes
        the slots a stage of the most of its layers needs on every stage, pads skipped."""
        stacks = range(len(self.assignment[0]))
        return Deal(tuple(self.assignment), tuple(max(c[i] for c in self.assignment)
                                                  for i in stacks))  # fmt: skip

    @property
    def runtime(self) -> str:
        """How lowering.pipeline runs this plan, in words: one pipeline (nm.scan_chain
        where the model has two stacks) whose stages hold the layers dealt here, each
        stack taking on every stage the slots of the stage holding most of it, the pads
        skipped (a jax.lax.cond per slot: no layer work, forward or backward, so each
        stage's tick is its real layers', idle as the plan charges: namedmesh/chain.py,
        uneven.py); a MoE stack's microbatches each route on their own, their balancing
        losses averaged (lowering.pipeline.mixing_op)."""
        run = self.runtime_deal
        ran = "runs as a layers:stage layout (lowering.pipeline)"
        if len(run.slots) > 1:
            ran += (f", one pipeline over the {len(run.slots)} stacks (nm.scan_chain), each "
                    f"stage its dealt layers of each in turn")  # fmt: skip
        if run.pad_share:
            each = " + ".join(map(str, run.slots))
            ran += (f", {each} layer slots a stage, the pads skipped (no layer work: "
                    f"{run.pad_share:.1%} of the slots; the stages idle {run.idle_share:.1%} of "
                    f"the layer time, as the plan charges)")  # fmt: skip
        if self.moe_microbatches:
            ran += ", each microbatch routed on its own (its balancing loss averaged)"
        return ran

    def stages_text(self, names=None) -> str:
        """Each stage's real layers and pads (`names`: the stacks', else "of stack i"),
        runs of like stages together."""
        return self.planned_deal.words(names)

    def as_dict(self) -> dict:
        """The stages for --json."""
        return {"assignment": [list(c) for c in self.assignment],
                "sizes": [sum(c) for c in self.assignment], "bubble": self.bubble,
                "stages_uneven": self.uneven, "runtime": self.runtime,
                "pads": [self.planned_deal.pads(i) for i in range(self.stages)],
                "pad_share": self.planned_deal.pad_share}  # fmt: skip


def in_flight(position: int, stages: int, microbatches: int) -> int:
    """Microbatches whose activations stage `position` holds at once under 1F1B: those
    it runs forward before its first backward, min(M, S - s)."""
    return min(microbatches, stages - position)


def staged_choice(
    build,
    mesh: Mesh,
    settings,
    stacks,
    rates: Rates,
    training: Training,
    limit: float,
    model_flops: float,
    boundary_bytes: float,
    moe: bool,
    layout=None,
    beam: int = 1,
    seeds=(),
    plateau: float = 0.0,
) -> StagedChoice:
    """The pipelined plan of `mesh` (its stage axis S) under `settings` (M =
    settings.grad_accum microbatches): `build(settings, counts, first, last)` traces one
    stage of `counts` layers per stack (the first embeds the tokens, the last holds the
    loss head), one microbatch's loss; `stacks` the layers per stack; `boundary_bytes`
    one microbatch's activation between stages, whole (split over the stage's devices
    that split it); `layout`: the layout to cost (default: searched). `seeds` and
    `plateau`: the layout searches' (`auto_layout`'s: layouts the climb may start from,
    a joint search's lead pipelined pair's; the least gain a failing descent keeps
    climbing for). LayoutError (its `search`) when no layout is valid."""
    if STAGE_AXIS not in mesh.sizes:
        raise ParameterError(f"staged_choice: {mesh} has no {STAGE_AXIS!r} axis")
    s = mesh.sizes[STAGE_AXIS]
    assignment = assign_stages(stacks, s)
    distinct: dict[tuple, list[int]] = {}
    for pos, counts in enumerate(assignment):
        distinct.setdefault((counts, pos == 0, pos == s - 1), []).append(pos)
    run = _Stages(build, inner_mesh(mesh), settings, rates, training, limit, distinct,
                  dict(beam=beam, seeds=tuple(seeds), plateau=plateau))  # fmt: skip
    if layout is None:
        layout = run.search(next(iter(distinct)))
        over = [k for k, c in run.cost_all(layout).items() if _total(c) > limit]
        if over:  # the layout of the first stage does not fit another: search that one's
            other = run.search(max(over, key=lambda k: _total(run.costs[k])))
            if all(_total(c) <= limit for c in run.cost_all(other).values()):
                layout = other
    costs = [StageCost(k[0], distinct[k], c, k[1], k[2]) for k, c in run.cost_all(layout).items()]
    shards = math.prod(run.inner.sizes[a] for a in _act_axes(layout))
    return StagedChoice(
        mesh, settings, assignment, costs, boundary_bytes / shards, rates, model_flops,
        limit, uneven=any(n % s for n in stacks if n), moe_microbatches=moe and
        settings.grad_accum > 1,
    )  # fmt: skip


class _Stages:
    """The distinct stages of one pipelined (mesh, settings) pair: each traced once, its
    layouts searched and costed with its microbatches in flight."""

    def __init__(self, build, inner, settings, rates, training, limit, distinct, search):
        self.build, self.inner, self.settings = build, inner, settings
        self.rates, self.training, self.limit = rates, training, limit
        self.search_kw = search  # auto_layout's beam, seeds and plateau
        self.distinct, self.programs, self.costs = distinct, {}, {}
        self.stages = sum(len(p) for p in distinct.values())

    def kw(self, key) -> dict:
        t, m = self.training, self.settings.grad_accum
        flight = in_flight(min(self.distinct[key]), self.stages, m)
        run = Training(t.optimizer, t.moment_dtype, t.zero1, m, flight)
        return dict(grad_argnums=(0,), rates=self.rates, training=run)

    def program(self, key):
        if key not in self.programs:
            self.programs[key] = self.build(self.settings, *key)
        return self.programs[key]

    def search(self, key):
        """The best layout of stage `key` on its own, or its closest to fitting."""
        fn, inputs = self.program(key)
        try:
            _, table = auto_layout(fn, self.inner, *inputs, memory_limit=self.limit,
                                   **self.kw(key), **self.search_kw)  # fmt: skip
            return table[0].layout
        except LayoutError as e:
            costed = [c for c in (getattr(e, "search", None) or []) if c.step is not None]
            if not costed:
                raise
            return min(costed, key=lambda c: c.memory).layout

    def cost_all(self, layout) -> dict:
        """Every distinct stage's Candidate under `layout` (a rule may name a dim that
        one stage lacks, the embedding's `vocab` in a middle stage, not one that all do)."""
        self.check_dims(layout)
        layout = Layout(str(layout) if layout.rules or layout.options else "", shared=True)
        self.costs = {}
        for key in self.distinct:
            fn, inputs = self.program(key)
            self.costs[key] = cost_layout(fn, self.inner, *inputs, layout=layout,
                                          memory_limit=math.inf, **self.kw(key))  # fmt: skip
        return self.costs

    def check_dims(self, layout) -> None:
        """LayoutError naming a rule of `layout` whose dim no stage's program has."""
        if not hasattr(self, "dims"):
            self.dims = set()
            for key in self.distinct:
                fn, inputs = self.program(key)
                self.dims.update(d for v in nm.trace(fn, *inputs).values() for d in v.dims)
        dims = self.dims
        for d, axes in layout.rules:
            if d not in dims:
                raise LayoutError(
                    f"staged_choice: layout {layout}: rule {d}:{','.join(axes)} names dim "
                    f"{d!r}, which no stage's program has{did_you_mean(d, dims) or '.'}"
                )


def _total(c: Candidate) -> float:
    """A stage candidate's step memory, inf where its layout is not valid there."""
    return c.step.total if c.step is not None else math.inf


def _act_axes(layout) -> set:
    """Mesh axes that split the residual stream (batch, length, d_model)."""
    axes = set()
    for dims in layout.assign(("batch", "length", "d_model")):
        axes.update(dims)
    return axes
