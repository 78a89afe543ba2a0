"""Pipeline stages in planning, uneven ones included: a model's layers (one or more
stacks, DeepSeek-V3's 3 dense then 58 mixture-of-experts layers) dealt to S stages as
evenly as possible, and the step costed by its slowest stage.

`assign_stages([3, 58], 16)`: 61 layers in order, 13 stages of 4 then 3 of 3 (stage 0
holds the 3 dense layers and the first MoE layer). Each distinct stage (its layers per
stack) is a program of its own, traced by the caller's `build(settings, counts)` with
the embedding and the loss head (only the first and last stages hold them: an upper
bound of a few percent for a large model) on one microbatch of batch / M rows, and
laid out by `auto_layout` on the mesh without the stage axis: the largest stage's
layout is searched and the others are costed under it. A mixture-of-experts stage
routes each microbatch on its own (capacity per microbatch): a microbatch is a routing
group, so M > 1 is planned for MoE stacks too.

The step, under a 1F1B schedule (GPipe's ticks, 1F1B's memory):

    time        (M + S - 1) ticks of the slowest stage's microbatch (forward, backward
                and its gradient sync), plus the boundary's activation sent to the next
                stage and its gradient back, per tick (the stage axis crosses nodes)
    memory      the largest of the stages': its parameters, gradients (and their
                accumulator), optimizer state, and min(M, S - s) microbatches'
                activations in flight at stage s

Runtime: lowering/pipeline.py pipelines each nm.scan on its own over the stage axis, so
every stack must divide by S and a MoE body runs one microbatch (its routing mixes the
batch: `mixing_op`). A plan that needs uneven stages or MoE microbatches says so
(`StagedChoice.runtime`): the plan is a cost model, the runtime does not run it yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lowering.mesh import Mesh
from lowering.rates import Rates, levels
from lowering.search import Candidate, auto_layout
from lowering.train_step import StepMemory, Training
from namedmesh.errors import LayoutError, ParameterError

STAGE_AXIS = "stage"
UNSUPPORTED = "not supported by lowering.pipeline yet"


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
    """One distinct stage: its layers per stack, its positions, its candidate."""

    counts: tuple[int, ...]
    positions: list[int]
    candidate: Candidate


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

    @property
    def slowest(self) -> StageCost:
        return max(self.costs, key=lambda c: c.candidate.planned)

    @property
    def candidate(self) -> Candidate:
        """The slowest stage's candidate (its layout is the plan's)."""
        return self.slowest.candidate

    @property
    def layout(self):
        """The layout of every stage (searched on the largest), on the stage's devices."""
        return self.costs[0].candidate.layout

    def stage_memory(self, cost: StageCost, position: int) -> StepMemory:
        """Stage `position`'s step memory: its candidate's, activations times the
        microbatches in flight there (1F1B: min(M, S - s))."""
        m = cost.candidate.step
        flight = min(self.microbatches, self.stages - position)
        return StepMemory(m.parameters, m.gradients, m.optimizer, m.activations * flight,
                          m.other)  # fmt: skip

    @property
    def memory(self) -> StepMemory:
        """The largest stage's memory."""
        every = [self.stage_memory(c, s) for c in self.costs for s in c.positions]
        return max(every, key=lambda m: m.total)

    @property
    def fits(self) -> bool:
        valid = all(c.candidate.valid or c.candidate.note.startswith("over")
                    for c in self.costs)  # fmt: skip
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
    def comm_seconds(self) -> float:
        return self.ticks * (self.slowest.candidate.comm + self.send_seconds)

    @property
    def step_seconds(self) -> float:
        return self.rates.step_seconds(self.compute_seconds, self.comm_seconds)

    def mfu(self, rates: Rates) -> float:
        return self.model_flops / (self.mesh.size * rates.flops_per_s * self.step_seconds)

    def tokens_per_second_per_device(self, tokens: int) -> float:
        return tokens / self.step_seconds / self.mesh.size

    @property
    def runtime(self) -> str:
        """Whether lowering.pipeline runs this plan, in words."""
        why = []
        if self.uneven:
            why.append("uneven stages")
        if self.moe_microbatches:
            why.append("MoE stacks with more than one microbatch")
        if not why:
            return "runs as a layers:stage layout (lowering.pipeline)"
        return f"{' and '.join(why)}: {UNSUPPORTED}"

    def stages_text(self) -> str:
        """The assignment in words: runs of equal stages."""
        runs: list[list] = []
        for s, counts in enumerate(self.assignment):
            if runs and runs[-1][0] == counts:
                runs[-1][2] = s
            else:
                runs.append([counts, s, s])
        parts = []
        for counts, a, b in runs:
            where = f"stage {a}" if a == b else f"stages {a}-{b}"
            parts.append(f"{where}: {'+'.join(map(str, counts))}")
        return "; ".join(parts)

    def as_dict(self) -> dict:
        """The stages for --json."""
        return {"assignment": [list(c) for c in self.assignment],
                "sizes": [sum(c) for c in self.assignment], "bubble": self.bubble,
                "stages_uneven": self.uneven, "runtime": self.runtime}  # fmt: skip


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
) -> StagedChoice:
    """The pipelined plan of `mesh` (its stage axis S) under `settings` (M =
    settings.grad_accum microbatches): `build(settings, counts)` traces one stage of
    `counts` layers per stack, one microbatch's loss; `stacks` the layers per stack;
    `boundary_bytes` one microbatch's activation between stages, whole (split over the
    stage's devices that split it); `layout`: the layout to cost (default: searched on
    the largest stage). LayoutError (its `search`) when no layout is valid."""
    if STAGE_AXIS not in mesh.sizes:
        raise ParameterError(f"staged_choice: {mesh} has no {STAGE_AXIS!r} axis")
    s = mesh.sizes[STAGE_AXIS]
    assignment = assign_stages(stacks, s)
    inner = inner_mesh(mesh)
    run = Training(training.optimizer, training.moment_dtype, training.zero1,
                   settings.grad_accum)  # fmt: skip
    distinct: dict[tuple, list[int]] = {}
    for pos, counts in enumerate(assignment):
        distinct.setdefault(counts, []).append(pos)
    order = sorted(distinct, key=lambda c: -sum(c))
    costs = []
    for counts in order:
        fn, inputs = build(settings, counts)
        kw = dict(grad_argnums=(0,), rates=rates, memory_limit=limit, training=run, beam=beam)
        if layout is None:
            try:
                _, table = auto_layout(fn, inner, *inputs, **kw)
                cand = table[0]
            except LayoutError as e:
                if getattr(e, "search", None) is None:
                    raise
                costed = [c for c in e.search if c.step is not None]
                if not costed:
                    raise
                cand = min(costed, key=lambda c: c.memory)
            layout = cand.layout
        else:
            _, table = auto_layout(fn, inner, *inputs, candidates=[layout],
                                   **{**kw, "memory_limit": math.inf})  # fmt: skip
            cand = table.theirs[0]
        costs.append(StageCost(counts, distinct[counts], cand))
    shards = math.prod(inner.sizes[a] for a in _act_axes(layout))
    return StagedChoice(
        mesh, settings, assignment, costs, boundary_bytes / shards, rates, model_flops,
        limit, uneven=any(n % s for n in stacks if n), moe_microbatches=moe and
        settings.grad_accum > 1,
    )  # fmt: skip


def _act_axes(layout) -> set:
    """Mesh axes that split the residual stream (batch, length, d_model)."""
    axes = set()
    for dims in layout.assign(("batch", "length", "d_model")):
        axes.update(dims)
    return axes
