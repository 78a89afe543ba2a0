"""`joint_search`: the training step's plan over layout x settings x mesh shape.

A plan is a mesh (one of the shapes a device count factors into), the run's settings
(remat, compute dtype, attention kernel, gradient accumulation's microbatches) and a
layout (lowering/search.py `auto_layout`, whose layout rules include pipeline stages: a
rule `layers:stage`). Each (mesh, settings) pair is a program of its own (the caller's
`build(settings)` traces it), laid out by `auto_layout` against the whole step's memory
(lowering/train_step.py: parameters, gradients, optimizer state, accumulator,
activations). A step with N microbatches runs the microbatch's step N times (the
trainer's accumulation loop, each microbatch's gradient synchronised as it is made).

Pruning, memory first: a pair whose parameters, gradients and optimizer state alone,
split over every device, exceed the limit is not searched, nor (on a mesh without a
stage axis) one whose whole step's memory on one device, split over every device,
does (`_WholeCosts.least_bytes`: no layout splits a value more ways), unless no plan
fits: then they are searched, so that the refusal names the closest plan. Then time: pairs are taken
in order of their least possible step time (the step's flops with remat's recompute
over every device at the flop rate, no communication; a pipelined pair's times its
ticks over its microbatches, (M + S - 1) / M, as no stage idles less than the bubble)
and a pair whose least time is no less than the best plan's that fits is not searched.
Microbatches: of one setting's counts of microbatches only the fewest that fit is
searched (more run the same flops and synchronise the gradients once per microbatch:
never faster in this model; a pipeline's every count is searched). Each pair's layout
search keeps a beam of 1 (`auto_layout`'s `beam`): a plan is found in seconds,
and tests/test_plan.py holds its Llama 3 70B plan against every pair searched unpruned.
Sharing: the pairs of one mesh whose settings differ in remat alone trace one program
but for its scans' remat, which only the costing reads; their searches share its scan
bodies and plans (lowering/bodies.py `Shared`, one per group, emptied when its last
pair is done): a layout one of them planned is costed, not planned, by the others.
Seeding: of each mesh's pairs one is its lead, the one likeliest to fit (`_frugal`: the
most remat, blockwise attention, the fewest microbatches; of a pipelined mesh's, the
most microbatches, `_frugal_staged`), searched as alone; every other pair's layout
search climbs from the lead's best layout beside its own phase 1 (`auto_layout`'s
`seeds`), so that where the pairs of a mesh choose alike, a climb starts near its end.
The lead is searched before the others of its mesh (even where its own pair is pruned),
and a pair's seeds are a function of the lead's search alone, not of the order: the plan
is the same with any `jobs`. A pipelined mesh's lead climbs from the layout of the lead
of its parent, the mesh without stages whose axes are its stage's devices' (`_parent`),
searched before it. `exhaustive` seeds nothing.
Plateaus: a pair's search that finds nothing fitting descends by memory; it stops at
the first step that gains under 1% (auto_layout's `plateau`), not `exhaustive`'s. A
pipelined pair's stage searches (lowering/stages.py) are seeded and stopped alike.
Cores: `jobs=N` runs the pairs' searches ahead in N worker processes
(lowering/joint_jobs.py), the decisions above taken here in the same order: the same
result.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field

import namedmesh as nm
from lowering.bodies import Shared
from lowering.collector import few_collections
from lowering.joint_jobs import Workers
from lowering.layout import Layout
from lowering.lower import lower
from lowering.mesh import Mesh
from lowering.rates import Rates
from lowering.search import PLATEAU, Candidate, Search, auto_layout, report_candidate
from lowering.stages import STAGE_AXIS
from lowering.train_step import StepMemory, Training, optimizer_bytes, step_memory
from namedmesh.errors import LayoutError, NamedMeshError, ParameterError
from namedmesh.uneven import pad_stacks

REMATS = ("none", "dots", "full")


class PlanError(LayoutError):
    """No plan fits: names the closest one's memory and what would make it fit."""


@dataclass(frozen=True)
class Settings:
    """The run's settings a plan chooses beside the layout."""

    remat: str = "none"
    dtype: str = "bfloat16"
    attention: str = "full"
    grad_accum: int = 1

    def __str__(self) -> str:
        return (
            f"remat={self.remat}, dtype={self.dtype}, attention={self.attention}, "
            f"grad_accum={self.grad_accum}"
        )

    def as_dict(self) -> dict:
        """The settings by name (what --json prints)."""
        return {"remat": self.remat, "dtype": self.dtype, "attention": self.attention,
                "grad_accum": self.grad_accum}  # fmt: skip


@dataclass
class Choice:
    """One plan weighed: its mesh, settings, layout, the layout's Candidate (of one
    microbatch), the whole step's memory and seconds."""

    mesh: Mesh
    settings: Settings
    candidate: Candidate
    model_flops: float  # the step's flops run whole on one device: forward and backward
    limit: float
    note: str = ""

    @property
    def layout(self) -> Layout:
        """The layout chosen for this mesh and these settings."""
        return self.candidate.layout

    @property
    def memory(self) -> StepMemory:
        """The whole step's memory per device, by part."""
        return self.candidate.step

    @property
    def fits(self) -> bool:
        """Valid, and its step within the memory limit."""
        return self.candidate.memory <= self.limit and not self.candidate.note.startswith("inv")

    @property
    def compute_seconds(self) -> float:
        """Compute of every microbatch, with remat's recompute."""
        return self.candidate.compute * self.settings.grad_accum

    @property
    def comm_seconds(self) -> float:
        """Communication of every microbatch."""
        return self.candidate.comm * self.settings.grad_accum

    @property
    def step_seconds(self) -> float:
        """The step's predicted seconds: every microbatch's."""
        return self.candidate.planned * self.settings.grad_accum

    @property
    def stages(self) -> int:
        """Pipeline stages of its layout (1: none)."""
        return max((p.stages for p in self.candidate.pipelines), default=1)

    @property
    def microbatches(self) -> int:
        """Microbatches per step: of gradient accumulation times a pipeline's."""
        pipe = max((p.microbatches for p in self.candidate.pipelines), default=1)
        return self.settings.grad_accum * pipe

    def mfu(self, rates: Rates) -> float:
        """Model flops utilisation: the step's flops (run whole: no recompute, no work
        repeated across devices) over the devices' peak flop/s for the step's time."""
        return self.model_flops / (self.mesh.size * rates.flops_per_s * self.step_seconds)

    def tokens_per_second_per_device(self, tokens: int) -> float:
        """`tokens` per step over the step time and the devices."""
        return tokens / self.step_seconds / self.mesh.size


@dataclass
class Joint:
    """The plans weighed, best first (those that fit by step time, then the rest by
    memory), the pairs not searched and why, and the assumptions."""

    choices: list[Choice]
    rates: Rates
    training: Training
    limit: float
    tokens: int
    pruned: dict = field(default_factory=dict)  # reason -> count of (mesh, settings) pairs
    searched: int = 0
    cache: dict = field(default_factory=dict, repr=False)  # (pair, ...) -> its Search
    chain: tuple = ()  # the params' keys whose stacks the model chains (pad_stacks' `chain`)
    bodies: dict = field(default_factory=dict, repr=False)  # `_body_group` -> its Shared
    left: Counter = field(default_factory=Counter, repr=False)  # group -> its pairs not done
    leads: dict = field(default_factory=dict, repr=False)  # mesh sizes -> its lead's settings
    seeds: dict = field(default_factory=dict, repr=False)  # (sizes, settings) -> seeds given
    plateau: float = PLATEAU  # auto_layout's: a failing descent stops (0: `exhaustive`)
    pipelined: bool = False  # whether meshes with a stage axis are planned as pipelines
    parents: dict = field(default_factory=dict, repr=False)  # pipelined sizes -> `_parent`
    beam: int = 1  # the layout searches' (auto_layout's)

    @property
    def best(self) -> Choice:
        """The chosen plan."""
        return self.choices[0]

    def next_best(self) -> Choice | None:
        """The best plan that fits and differs from the chosen one in mesh or settings,
        else in layout."""
        best = self.best
        fitting = [c for c in self.choices[1:] if c.fits]
        same = (best.mesh.sizes, best.settings)
        other = [c for c in fitting if (c.mesh.sizes, c.settings) != same]
        return (other or fitting or [None])[0]


@few_collections()  # its layout searches' objects: few collections (collector.py)
def joint_search(
    build,
    meshes: list[Mesh],
    rates: Rates,
    space: list[Settings],
    training: Training | None = None,
    memory_limit: float | None = None,
    tokens: int = 0,
    beam: int = 1,
    exhaustive: bool = False,
    cache: dict | None = None,
    staged=None,
    chain=(),
    jobs: int = 1,
) -> Joint:
    """The plans of `build(settings) -> (loss, inputs)` (the loss of one microbatch:
    batch / grad_accum rows, its parameters the first input) on each of `meshes` under
    each of `space`, at `rates`, held to `memory_limit` bytes per device (default: the
    rates' memory) with the optimizer of `training`; `tokens` per step (for tokens/s).
    PlanError when none fits, naming the closest plan's memory and what would make it
    fit. `exhaustive`: every pair searched, none pruned (what the pruning is tested
    against), seeds no climb and stops no failing descent early (`Joint.plateau`,
    lowering/search.py `_share`). `cache`: a dict that keeps each pair's layout search for
    later calls with the same `build`, rates, limit and optimizer (keyed by mesh,
    settings, beam and seeds).
    `staged`: (evaluate, space) for the meshes with a `stage` axis: each is weighed under
    `space` (its settings' grad_accum the pipeline's microbatches) by
    `evaluate(mesh, settings, model_flops, seeds=, plateau=)` -> a
    lowering.stages.StagedChoice (`seeds`, `plateau`: its layout searches' own, as
    auto_layout takes them), every count of microbatches searched (more shrink the
    bubble). `chain`: the keys of a
    params dict whose stacks the model runs chained (nm.scan_chain;
    `namedmesh.uneven.pad_stacks`' `chain`), padded so where a stage axis splits them.
    `jobs`: worker processes that search the pairs ahead (lowering/joint_jobs.py), the
    result the same; `build` and `staged` must then pickle (module-level classes)."""
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ParameterError(f"joint_search: jobs must be an int >= 1, got {jobs!r}")
    training = Training() if training is None else training
    limit = rates.memory_bytes if memory_limit is None else memory_limit
    if not limit:
        raise ParameterError("joint_search: no memory limit: the rates give no memory; pass one")
    if not space or not meshes:
        raise ParameterError("joint_search: no settings or no meshes to search")
    whole = _WholeCosts(build, training)
    joint = Joint([], rates, training, limit, tokens, plateau=0.0 if exhaustive else PLATEAU)
    joint.cache = {} if cache is None else cache
    joint.chain, joint.pipelined, joint.beam = tuple(chain), staged is not None, beam
    try:
        _search_pairs(joint, whole, build, meshes, space, staged, beam, exhaustive, jobs)
    finally:  # the pairs' shared scan bodies' planned passes (lowering/bodies.py)
        for shared in joint.bodies.values():
            shared.forget()
    joint.choices.sort(key=lambda c: (0, c.step_seconds) if c.fits else (1, c.memory.total))
    if not joint.choices or not joint.best.fits:
        raise PlanError(refusal(joint, whole))
    return joint


def _search_pairs(joint, whole, build, meshes, space, staged, beam, exhaustive, jobs) -> None:
    """Each (mesh, settings) pair searched into `joint` but those pruned (the module's
    docstring); with `jobs` > 1, the searches run ahead in workers (`_ahead`)."""
    rates, limit = joint.rates, joint.limit
    best_fit = [math.inf]
    chains: dict = {}  # (mesh, settings but grad_accum) -> its settings, fewest microbatches first
    for mesh in meshes:
        for settings in _space_of(mesh, space, staged):
            key = (id(mesh), settings.remat, settings.dtype, settings.attention)
            chains.setdefault(key, (mesh, []))[1].append(settings)
    whole.staged = staged is not None
    order = sorted(chains.values(), key=lambda c: whole.least(c[1][0], c[0], rates))
    order = [(mesh, sorted(chain, key=lambda s: s.grad_accum)) for mesh, chain in order]
    if not exhaustive:  # each mesh's pair likeliest to fit seeds its others' climbs
        for mesh, chain in order:
            frugal = _frugal_staged if _staged(mesh, staged) else _frugal
            lead = joint.leads.setdefault(_sizes(mesh), chain[0])
            joint.leads[_sizes(mesh)] = min(lead, *chain, key=frugal)
        plain = [mesh for mesh, _ in order if not _staged(mesh, staged)]
        for mesh, _ in order:
            parent = _parent(mesh, plain) if _staged(mesh, staged) else None
            if parent is not None:
                joint.parents[_sizes(mesh)] = parent
    left = joint.left = Counter(_body_group(mesh, s) for mesh, chain in order for s in chain)
    settled: set = set()  # the pairs decided: searched or not
    bounded: list = []  # the pairs pruned by their least memory (`BOUND`)

    def done(mesh, settings) -> None:  # forget a group's passes when no pair is left of it
        settled.add((id(mesh), settings))
        group = _body_group(mesh, settings)
        left[group] -= 1
        if not left[group] and group in joint.bodies:
            joint.bodies.pop(group).forget()

    chain_of = {(id(mesh), s): chain for mesh, chain in order for s in chain}

    def wanted(pair) -> bool:  # by a worker: not decided, cached or pruned (it stays so),
        mesh, settings = pair  # nor likely left out (fewer microbatches fit, searched)
        if (id(mesh), settings) in settled or _cached(joint, mesh, settings, beam):
            return False
        if exhaustive:
            return True
        if _pruned(whole, settings, mesh, rates, limit, best_fit[0]):
            return False
        fewer = chain_of[(id(mesh), settings)]
        fewer = fewer[: fewer.index(settings)]
        return _staged(mesh, staged) or not any(_fit(joint, mesh, s, beam) for s in fewer)

    ahead = _ahead(joint, whole, build, order, staged, beam, jobs, wanted) if jobs > 1 else None
    try:
        for mesh, chain in order:
            for i, settings in enumerate(chain):
                why = "" if exhaustive else _pruned(whole, settings, mesh, rates, limit,
                                                    best_fit[0])  # fmt: skip
                if why:
                    _count(joint.pruned, why)
                    done(mesh, settings)
                    bounded += [(mesh, settings)] if why == BOUND else []
                    continue
                if ahead is not None:
                    ahead.need((mesh, settings))
                if _staged(mesh, staged):
                    _search_staged(joint, build, whole.model_flops, staged[0], mesh,
                                   settings, best_fit)  # fmt: skip
                elif _search_pair(joint, whole, build, mesh, settings, beam, best_fit) and not (
                    exhaustive
                ):  # the fewest microbatches that fit: the rest of the chain is not searched
                    _count(joint.pruned, "more microbatches than the fewest that fit",
                           len(chain) - i - 1)  # fmt: skip
                    for s in chain[i:]:
                        done(mesh, s)
                    break
                done(mesh, settings)
    finally:
        if ahead is not None:
            ahead.close()
    if not any(c.fits for c in joint.choices):  # the refusal names the closest plan searched
        joint.pruned.pop(BOUND, None)
        for mesh, settings in bounded:
            _search_pair(joint, whole, build, mesh, settings, beam, best_fit)


def _ahead(joint, whole, build, order, staged, beam, jobs, wanted) -> Workers | None:
    """Workers (lowering/joint_jobs.py) searching ahead the pairs `wanted` when handed
    out, in groups: the pairs sharing scan bodies together (`_body_group`), a pipelined
    pair alone. Each chain's fewest microbatches first, in the serial order, then its
    second fewest (by then many chains have fit with fewer, and want no more), and so
    on. None with fewer than two groups."""
    groups: dict = {}
    for i in range(max(len(chain) for _, chain in order)):
        for mesh, chain in order:
            for s in chain[i : i + 1]:
                key = ("staged", id(mesh), s) if _staged(mesh, staged) else _body_group(mesh, s)
                groups.setdefault(key, []).append((mesh, s))
    if len(groups) < 2:
        return None
    spec = _Spec(build, staged[0] if staged else None, joint.rates, joint.limit,
                 joint.training, beam, joint.chain, dict(joint.leads), joint.plateau,
                 dict(joint.parents))  # fmt: skip
    groups = list(groups.values())
    lead_group = {}  # mesh sizes -> the group of its lead, which the others' seeds wait on
    for g, pairs in enumerate(groups):
        for mesh, s in pairs:
            if joint.leads.get(_sizes(mesh)) == s:
                lead_group[_sizes(mesh)] = g
    after = {g: lead_group[_sizes(pairs[0][0])] for g, pairs in enumerate(groups)
             if lead_group.get(_sizes(pairs[0][0]), g) != g}  # fmt: skip
    for sizes, parent in joint.parents.items():  # a pipelined lead waits on its parent's
        if sizes in lead_group and _sizes(parent) in lead_group:
            after[lead_group[sizes]] = lead_group[_sizes(parent)]

    def task(pairs):
        flops = lambda m, s: {x: whole.model_flops(x) for x in (s, joint.leads.get(_sizes(m)))
                              if x is not None}  # fmt: skip
        work = [(m, s, flops(m, s) if _staged(m, staged) else None, _seeds(joint, m, s, beam))
                for m, s in pairs]  # fmt: skip
        return functools.partial(search_group, spec, work)

    return Workers(min(jobs, len(groups)), groups, task, wanted, joint.cache.update,
                   after)  # fmt: skip


@dataclass(frozen=True)
class _Spec:
    """What a worker needs to search a pair as `joint_search` does (it pickles)."""

    build: object
    evaluate: object  # `staged`'s, or None
    rates: Rates
    limit: float
    training: Training
    beam: int
    chain: tuple
    leads: dict  # Joint.leads
    plateau: float  # Joint.plateau
    parents: dict  # Joint.parents


@few_collections()
def search_group(spec: _Spec, pairs: list) -> dict:
    """In a worker: the cache entries of `pairs` ((mesh, settings, for a pipelined pair
    the model flops of its settings and its lead's (a dict) else None, the seeds of its
    climb: None where its lead's search was not in the caller's cache, which is then
    searched here first)), searched as the serial search does, their tables detached
    from their programs (`Search.detach`) to pickle."""
    joint = Joint([], spec.rates, spec.training, spec.limit, 0, plateau=spec.plateau,
                  pipelined=spec.evaluate is not None)  # fmt: skip
    joint.chain, joint.leads, joint.parents = spec.chain, spec.leads, spec.parents
    joint.beam = spec.beam
    joint.seeds = {(_sizes(m), s): seeds for m, s, _, seeds in pairs if seeds is not None}
    joint.left = Counter(_body_group(m, s) for m, s, flops, _ in pairs if flops is None)
    try:
        for mesh, settings, flops, _ in pairs:
            if flops is not None:
                _fill_staged(joint, spec.build, flops.__getitem__, spec.evaluate, mesh,
                             settings)  # fmt: skip
            else:
                _fill_pair(joint, spec.build, mesh, settings, spec.beam)
                joint.left[_body_group(mesh, settings)] -= 1
    finally:
        for shared in joint.bodies.values():
            shared.forget()
    for value in joint.cache.values():
        if isinstance(value, Search):
            value.detach()
    return joint.cache


def _fit(joint, mesh, settings, beam) -> bool:
    """Whether the pair's search in `joint.cache` found a layout that fits (False when
    it is not there)."""
    key = _key(joint, mesh, settings, beam)
    table = [] if key is None else joint.cache.get(key, [])
    uneven = joint.cache.get(_uneven_key(joint, mesh, settings), [])
    return any(c.valid for c in [*table, *uneven])


def _cached(joint, mesh, settings, beam) -> bool:
    """Whether the pair's search is in `joint.cache` already."""
    key = _key(joint, mesh, settings, beam)
    return key is not None and key in joint.cache


def _sizes(mesh: Mesh) -> tuple:
    return tuple(mesh.sizes.items())


def _frugal(settings: Settings) -> tuple:
    """Order of settings by the memory they likely need: the most remat, blockwise
    attention, the narrower dtype, the fewest microbatches (a chain's first) first."""
    return (-REMATS.index(settings.remat), settings.attention != "blockwise",
            settings.dtype != "bfloat16", settings.grad_accum)  # fmt: skip


def _frugal_staged(settings: Settings) -> tuple:
    """`_frugal` for a pipelined pair: the most microbatches first. A stage holds
    min(M, S - s) of them in flight, each of batch / M rows, so more hold no more
    activations, and the bubble (S - 1) / (M + S - 1) is the least, so its least step
    time is the chain's least: the last of its chain to be pruned by time."""
    return (*_frugal(settings)[:3], -settings.grad_accum)


def _seeds(joint, mesh, settings, beam) -> tuple[Layout, ...] | None:
    """The layouts the pair's layout search may climb from beside its phase 1
    (auto_layout's `seeds`): its mesh's lead's best (the first of its search: the
    fastest that fits, else the closest to fitting; adding the lead's least memory too,
    for the pairs that need more, planned more candidates of the Llama 3 70B plan, not
    fewer; a pipelined lead's, the one layout of its stages, `StagedChoice.layout`). ()
    for the lead itself (but a pipelined lead with a `_parent` mesh: its parent's lead's
    best) and where there is no lead (an exhaustive search); None while the lead's search
    is not in `joint.cache`. A function of the lead's search alone,
    not of which pairs were searched before: the plan is the same in any order and with
    any `jobs`."""
    if (_sizes(mesh), settings) in joint.seeds:
        return joint.seeds[(_sizes(mesh), settings)]
    lead = joint.leads.get(_sizes(mesh))
    if lead is None:
        return ()
    if lead == settings:  # a pipelined lead climbs from its parent's lead's layout
        parent = joint.parents.get(_sizes(mesh))
        if parent is None:
            return ()
        table = joint.cache.get(_pair_key(joint, parent, joint.leads[_sizes(parent)],
                                          joint.beam, ()))  # fmt: skip
        if table is None:
            return None
        return tuple(c.layout for c in table[:1] if not c.note.startswith("invalid"))
    if _pipelined(joint, mesh):  # the lead's StagedChoice: its one layout of every stage
        own = _seeds(joint, mesh, lead, beam)  # the lead's (its parent's lead's)
        choice = None if own is None else joint.cache.get(_staged_key(joint, mesh, lead, own))
        if choice is None:
            return None
        valid = all(c.candidate.step is not None for c in choice.costs)
        return (choice.layout,) if valid else ()
    table = joint.cache.get(_pair_key(joint, mesh, lead, beam, ()))
    if table is None:
        return None
    return tuple(c.layout for c in table[:1] if not c.note.startswith("invalid"))


def _key(joint, mesh, settings, beam) -> tuple | None:
    """The pair's key in `joint.cache`; None while its seeds are not known."""
    seeds = _seeds(joint, mesh, settings, beam)
    if seeds is None:
        return None
    if _pipelined(joint, mesh):
        return _staged_key(joint, mesh, settings, seeds)
    return _pair_key(joint, mesh, settings, beam, seeds)


def _shared(joint: Joint, mesh: Mesh, settings: Settings) -> Shared:
    """The Shared of the pair's group, keeping its plans while more pairs of it are left
    (`joint.left`, the pair's own counted) to cost them."""
    group = _body_group(mesh, settings)
    if group not in joint.bodies:
        joint.bodies[group] = Shared()
    joint.bodies[group].keep = joint.left[group] > 1
    return joint.bodies[group]


def _body_group(mesh: Mesh, settings: Settings) -> tuple:
    """The pairs whose programs hold the same scan bodies and plan alike: of one mesh,
    their settings alike but remat (lowering/bodies.py `Shared`)."""
    return (tuple(mesh.sizes.items()), settings.dtype, settings.attention, settings.grad_accum)


def _staged(mesh: Mesh, staged) -> bool:
    return staged is not None and STAGE_AXIS in mesh.sizes


def _pipelined(joint: Joint, mesh: Mesh) -> bool:
    """Whether the mesh's pairs are pipelined pairs (`joint_search`'s `staged`)."""
    return joint.pipelined and STAGE_AXIS in mesh.sizes


def _space_of(mesh: Mesh, space: list, staged) -> list:
    return staged[1] if _staged(mesh, staged) else space


def _search_staged(joint, build, flops, evaluate, mesh, settings, best_fit: list) -> None:
    """A pipelined pair (lowering/stages.py) into `joint`."""
    joint.searched += 1
    choice = _fill_staged(joint, build, flops, evaluate, mesh, settings)
    joint.choices.append(choice)
    if choice.fits:
        best_fit[0] = min(best_fit[0], choice.step_seconds)


def _fill_staged(joint, build, flops, evaluate, mesh, settings):
    """The pipelined pair's StagedChoice, in `joint.cache` (evaluated unless there, its
    layout searches seeded with its lead's layout, `_seeds`, the lead's evaluated first,
    and the lead's with its parent's lead's, `_parent`, searched first; stopped at a
    plateau as the other pairs'); `flops(settings)`: its model flops."""
    seeds = _seeds(joint, mesh, settings, joint.beam)
    if seeds is None:  # its lead's first (a lead: its parent's lead's): it seeds this one's
        lead = joint.leads[_sizes(mesh)]
        if lead == settings:
            parent = joint.parents[_sizes(mesh)]
            _fill_pair(joint, build, parent, joint.leads[_sizes(parent)], joint.beam)
        else:
            _fill_staged(joint, build, flops, evaluate, mesh, lead)
        seeds = _seeds(joint, mesh, settings, joint.beam)
    key = _staged_key(joint, mesh, settings, seeds)
    if key not in joint.cache:
        joint.cache[key] = evaluate(mesh, settings, flops(settings), seeds=seeds,
                                    plateau=joint.plateau)  # fmt: skip
    return joint.cache[key]


def _parent(mesh: Mesh, plain: list) -> Mesh | None:
    """Of the meshes without a stage axis, the one whose lead's layout a pipelined
    mesh's lead climbs from: its axes those of the stage's devices (`mesh` but its stage
    axis), each the same size but the outermost (the data axis of `--devices N
    --stages S`: data=N/(S m), model=m beside data=N/m, model=m); None if none is."""
    inner = [(a, n) for a, n in mesh.sizes.items() if a != STAGE_AXIS]
    for other in plain:
        items = list(other.sizes.items())
        if [a for a, _ in items] == [a for a, _ in inner] and items[1:] == inner[1:]:
            return other
    return None


def _staged_key(joint, mesh, settings, seeds) -> tuple:
    return ("staged", tuple(mesh.sizes.items()), settings, joint.limit, repr(joint.rates),
            joint.training, seeds, joint.plateau)  # fmt: skip


def _pair_key(joint, mesh, settings, beam, seeds) -> tuple:
    return (tuple(mesh.sizes.items()), settings, beam, joint.limit, repr(joint.rates),
            joint.training, seeds, joint.plateau)  # fmt: skip


def _uneven_key(joint, mesh, settings) -> tuple:
    return ("uneven", tuple(mesh.sizes.items()), settings, joint.limit, repr(joint.rates),
            joint.training, joint.chain)  # fmt: skip


def _count(d: dict, reason: str, n: int = 1) -> None:
    if reason and n:
        d[reason] = d.get(reason, 0) + n


BOUND = "least possible memory over the limit"  # `_pruned`'s reason: `_WholeCosts.least_bytes`


def _pruned(whole, settings, mesh, rates, limit, best: float) -> str:
    """Why the pair is not searched ("" if it is): memory first, then time."""
    if whole.state_bytes(settings) / mesh.size > limit:
        return "parameters, gradients and optimizer state alone over the limit"
    if STAGE_AXIS not in mesh.sizes and whole.least_bytes(settings) / mesh.size > limit:
        return BOUND
    if whole.least(settings, mesh, rates) >= best:
        return "least possible step time no better than the best that fits"
    return ""


def _search_pair(joint, whole, build, mesh, settings, beam, best_fit: list) -> bool:
    """auto_layout of one (mesh, settings) pair into `joint`: its best candidates, and
    its closest when none fits. Whether one fits."""
    joint.searched += 1
    costed, uneven = _fill_pair(joint, build, mesh, settings, beam)
    flops = whole.model_flops(settings)
    kept = [c for c in costed if c.valid][:3] + [c for c in uneven if c.valid]
    kept += sorted((c for c in costed + uneven if not c.valid), key=lambda c: c.memory)[:1]
    fits = False
    for c in kept:
        joint.choices.append(Choice(mesh, settings, c, flops, joint.limit))
        if joint.choices[-1].fits:
            fits = True
            best_fit[0] = min(best_fit[0], joint.choices[-1].step_seconds)
    return fits


def _fill_pair(joint, build, mesh, settings, beam) -> tuple[list, list]:
    """The pair's layout search and uneven candidates, in `joint.cache` (searched unless
    there): (its candidates costed, its uneven ones)."""
    t = joint.training
    seeds = _seeds(joint, mesh, settings, beam)
    if seeds is None:  # its lead's search first: it seeds this one's
        _fill_pair(joint, build, mesh, joint.leads[_sizes(mesh)], beam)
        seeds = _seeds(joint, mesh, settings, beam)
    key = _pair_key(joint, mesh, settings, beam, seeds)
    if key not in joint.cache:
        fn, inputs = build(settings)
        run = Training(t.optimizer, t.moment_dtype, t.zero1, settings.grad_accum)
        try:
            _, joint.cache[key] = auto_layout(fn, mesh, *inputs, grad_argnums=(0,),
                                              rates=joint.rates, memory_limit=joint.limit,
                                              training=run, beam=beam, seeds=seeds,
                                              plateau=joint.plateau,
                                              shared=_shared(joint, mesh, settings),
                                              )  # fmt: skip
        except LayoutError as e:
            if getattr(e, "search", None) is None:
                raise
            joint.cache[key] = e.search
    costed = [c for c in joint.cache[key] if c.step is not None]
    return costed, _uneven_candidates(joint, build, mesh, settings, costed)


def uneven_stage_layouts(fn, mesh: Mesh, *inputs, base: Layout | None = None) -> list[Layout]:
    """The pipelined layouts that the search's divisibility never proposes: for each scan
    of `fn(*inputs)` over a dim whose length the mesh's `stage` axis does not divide
    (DeepSeek-V3's 61 layers on 16 stages), `base` (default: the batch over the mesh's
    other axes) without the stage axis, plus `dim:stage`: a padded split
    (namedmesh/uneven.py), which `lower` runs and its report costs with the pads'
    compute. [] without a stage axis of more than one device."""
    s = mesh.sizes.get(STAGE_AXIS, 1)
    if s <= 1:
        return []
    graph = nm.trace(fn, *inputs)
    dims = sorted({e.params["dim"] for e in graph.eqns
                   if e.primitive.name == "scan" and e.params["length"] % s})  # fmt: skip
    if base is None:
        others = ",".join(a for a, n in mesh.sizes.items() if n > 1 and a != STAGE_AXIS)
        base = Layout(f"batch:{others}" if others else "")
    rules = [(d, tuple(a for a in axes if a != STAGE_AXIS)) for d, axes in base.rules]
    rules = [(d, axes) for d, axes in rules if axes and d not in dims]
    return [Layout([*rules, (d, (STAGE_AXIS,))], options=base.options) for d in dims]


def _uneven_candidates(joint, build, mesh, settings, costed) -> list[Candidate]:
    """The pair's best layout with a stack its stage axis does not divide split over the
    stages (`uneven_stage_layouts`), each costed as the trainer runs it: its stacks
    padded ahead (a PaddedStack each stage device holds 1/S of), the pads' compute in
    the padded scan. Cached with the pair."""
    if STAGE_AXIS not in mesh.sizes:
        return []
    t = joint.training
    key = _uneven_key(joint, mesh, settings)
    if key not in joint.cache:
        fn, inputs = build(settings)
        best = next((c.layout for c in costed if c.valid), None)
        run = Training(t.optimizer, t.moment_dtype, t.zero1, settings.grad_accum)
        joint.cache[key] = [padded_candidate(fn, mesh, inputs, layout, joint.rates, run,
                                             joint.limit, joint.chain)
                            for layout in uneven_stage_layouts(fn, mesh, *inputs, base=best)
                            ]  # fmt: skip
    return [c for c in joint.cache[key] if c.step is not None]


def padded_candidate(fn, mesh, inputs, layout, rates: Rates, training: Training, limit,
                     chain=()):  # fmt: skip
    """The Candidate of `layout` (it splits a stack over uneven stages) for the training
    step of `fn(*inputs)` (its parameters the first input), the stacks padded ahead
    (`namedmesh.uneven.pad_stacks`), as auto_layout's candidates are costed: its report's
    flops, bytes and step memory at `rates`, over `limit` or invalid said in its note."""
    cand = Candidate(layout)
    lowered = lower(fn, mesh, layout)
    params = pad_stacks(inputs[0], lowered.stage_sizes, chain=chain)
    try:
        rep = lowered.report(params, *inputs[1:], wrt=0, show=False)
    except NamedMeshError as e:
        cand.note = "invalid: " + str(e).splitlines()[0]
        return cand
    return report_candidate(cand, rep, mesh, rates, training, limit)


class _WholeCosts:
    """Per settings, the program's costs run whole on one device (memoised): its
    parameters' bytes and the step's flops (forward, backward, remat's recompute)."""

    def __init__(self, build, training: Training):
        self.build, self.training, self.reports = build, training, {}

    def report(self, settings: Settings):
        """The gradient report of the settings' program on one device."""
        if settings not in self.reports:
            fn, inputs = self.build(settings)
            one = Mesh({"whole": 1}, devices="abstract")
            self.reports[settings] = lower(fn, one, "").report(*inputs, wrt=0, show=False)
        return self.reports[settings]

    def model_flops(self, settings: Settings) -> float:
        """Forward and backward flops of every microbatch, run whole."""
        rep = self.report(settings)
        return (rep.flops + rep.backward_flops) * settings.grad_accum

    staged = False  # whether meshes with a stage axis are pipelined (lowering/stages.py)

    def least(self, settings: Settings, mesh: Mesh, rates: Rates) -> float:
        """The least step time a pair could plan at: its flops (with recompute) shared
        by every device at the flop rate, no communication; a pipelined pair's times its
        ticks over its microbatches, (M + S - 1) / M (its slowest stage does at least the
        average share of each microbatch, once a tick)."""
        t = self.step_flops(settings) / (mesh.size * rates.flops_per_s * rates.efficiency)
        if self.staged and STAGE_AXIS in mesh.sizes:
            m = settings.grad_accum
            t *= (m + mesh.sizes[STAGE_AXIS] - 1) / m
        return t

    def step_flops(self, settings: Settings) -> float:
        """`model_flops` and remat's recompute."""
        again = self.report(settings).recompute_flops * settings.grad_accum
        return self.model_flops(settings) + again

    def least_bytes(self, settings: Settings) -> float:
        """The whole step's memory (lowering.train_step.step_memory: parameters,
        gradients, optimizer state, activations, other) run on one device: no layout
        divides a value more ways than the mesh has devices, so over them it is the
        least a plan on a mesh without pipeline stages can hold per device (the stages'
        microbatches in flight are not this program's)."""
        t = self.training
        run = Training(t.optimizer, t.moment_dtype, t.zero1, settings.grad_accum)
        return step_memory(self.report(settings), {"whole": 1}, (), run).total

    def state_bytes(self, settings: Settings) -> float:
        """Parameters, gradients (and the accumulator) and optimizer state, whole."""
        rep = self.report(settings)
        params = sum(b for b, _, _ in rep.parameter_shards)
        moments = optimizer_bytes(rep, {"whole": 1}, (), self.training)
        grads = params * (2 if settings.grad_accum > 1 else 1)
        return params + grads + moments


def gib(n: float) -> str:
    """Bytes as GiB, 3 figures."""
    return f"{n / 2**30:.3g} GiB"


def parts_text(m: StepMemory) -> str:
    """A StepMemory's parts in words."""
    return (
        f"parameters {gib(m.parameters)}, gradients {gib(m.gradients)}, optimizer "
        f"{gib(m.optimizer)}, activations {gib(m.activations)}, other {gib(m.other)}"
    )


def refusal(joint: Joint, whole: _WholeCosts) -> str:
    """Why nothing fits: the closest plan's memory by part, and the changes that would
    bring it under the limit (ZeRO-1, bfloat16 moments, more devices)."""
    limit = joint.limit
    if not joint.choices:
        settings = min(_evaluated(whole), key=whole.state_bytes, default=None)
        need = whole.state_bytes(settings) if settings else math.inf
        return (
            f"no plan fits {gib(limit)} per device: the parameters, gradients and optimizer "
            f"state alone take {gib(need)}, so at least {math.ceil(need / limit)} devices are "
            f"needed however they are split"
        )
    close = min(joint.choices, key=lambda c: c.memory.total)
    m = close.memory
    fixes = []
    t = joint.training
    if not t.zero1 and m.optimizer:
        data = close.layout.assign(("batch",))[0]
        ways = math.prod(close.mesh.sizes[a] for a in data)
        saved = m.optimizer - m.optimizer / max(ways, 1)
        if m.total - saved <= limit:
            fixes.append(f"ZeRO-1 (optimizer state split over the {ways} data-parallel "
                         f"devices too) brings it to {gib(m.total - saved)}")  # fmt: skip
    if t.moment_bytes > 2 and m.optimizer and m.total - m.optimizer / 2 <= limit:
        fixes.append(f"bfloat16 moments bring it to {gib(m.total - m.optimizer / 2)}")
    ways = math.ceil(m.total / limit)
    fixes.append(f"about {ways}x the devices (its memory split {ways} ways further)")
    return (
        f"no plan fits {gib(limit)} per device ({len(joint.choices)} weighed). The closest: "
        f"{close.layout or '(replicated)'} on {close.mesh} with {close.settings} needs "
        f"{gib(m.total)} ({parts_text(m)}), {gib(m.total - limit)} over. To fit: "
        + "; or ".join(fixes)
        + "."
    )


def _evaluated(whole: _WholeCosts) -> list[Settings]:
    """The settings whose whole-program costs were found."""
    return list(whole.reports)


def why_not(best: Choice, other: Choice) -> str:
    """One sentence: how `other` differs from `best` and what it costs."""
    diffs = []
    if other.mesh.sizes != best.mesh.sizes:
        diffs.append(f"mesh {other.mesh}")
    a, b = best.settings.as_dict(), other.settings.as_dict()
    diffs += [f"{k}={b[k]}" for k in a if a[k] != b[k]]
    if other.layout.rules != best.layout.rules or not diffs:
        diffs.append(f"layout {other.layout or '(replicated)'}")
    ratio = other.step_seconds / best.step_seconds
    dc = other.compute_seconds - best.compute_seconds
    dm = other.comm_seconds - best.comm_seconds
    if dc >= dm:
        cause = (f"{_s(dc, '+')} of compute ({_s(other.compute_seconds)} against "
                 f"{_s(best.compute_seconds)})")  # fmt: skip
    else:
        cause = (f"{_s(dm, '+')} of communication ({_s(other.comm_seconds)} against "
                 f"{_s(best.comm_seconds)})")  # fmt: skip
    return f"{', '.join(diffs)}: {ratio:.3g}x the step time, {cause}"


def _s(seconds: float, sign: str = "") -> str:
    """Seconds in words: ms below one second."""
    if abs(seconds) < 1:
        return f"{seconds * 1e3:{sign}.4g} ms"
    return f"{seconds:{sign}.4g} s"


def with_uneven_stages(fn, mesh: Mesh, inputs, found, chain=()):
    """(layout, its Candidate): `found`, auto_layout's (layout, Search) for the training
    step of `fn(*inputs)` (its parameters the first input), or the LayoutError it raised,
    weighed against the uneven `dim:stage` splits its divisibility never proposes
    (`uneven_stage_layouts`, on its choice), each costed as the trainer runs it, its
    stacks padded by `chain` (`padded_candidate`) at the search's rates and limit: the
    fastest that is valid and fits. The LayoutError again where nothing does."""
    failed = isinstance(found, LayoutError)
    search = found.search if failed else found[1]
    layout, best = (None, None) if failed else (found[0], search[0])
    for option in uneven_stage_layouts(fn, mesh, *inputs, base=layout):
        c = padded_candidate(fn, mesh, inputs, option, search.rates, None, search.memory_limit,
                             chain)  # fmt: skip
        if c.valid and (best is None or c.time < best.time):
            layout, best = option, c
    if layout is None:
        raise found
    return layout, best
