"""`namedmesh plan`: the training step's plan for a cluster, on abstract meshes (no devices).

    namedmesh plan --config llama3-70b --mesh data=256,model=8 --rates h100,node=8 \\
        --batch 2048 --length 8192
    namedmesh plan --config llama3-8b --devices 256 --rates h100,node=8 --batch 256 \\
        --length 8192 --json

Searches layout x remat x compute dtype x attention kernel x gradient accumulation x the
mesh's shape (lowering/joint.py; a flag given fixes its setting) and prints the chosen
plan, its memory per device by part (parameters, gradients, optimizer, activations,
other), its step time split into compute and communication, tokens/s per device and MFU,
and the next best plan with why it lost. `--compare LAYOUT` weighs a layout of yours
(under the chosen settings) beside it. `--json`: one JSON object instead. `--jobs N`:
the search in N worker processes (default 1: this process), the plan the same. Exit status 2
with one line on stderr for a bad flag, and 1 when no plan fits (the line names the
closest plan's memory and what would make it fit).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

from models.cli.train import fail, one_line_on_ctrl_c, user_errors
from models.cli.train_flags import Defaults, Parser, parse_mesh

REMATS = ("none", "dots", "full")
KERNELS = ("full", "blockwise")
EXIT_NO_PLAN = 1


def arguments(argv=None, prog: str = "python -m models.cli.plan") -> argparse.Namespace:
    p = Parser(prog=prog, description=__doc__.split("\n")[0],
               formatter_class=Defaults)  # fmt: skip
    p.add_argument("--config", required=True,
                   help="a named config (llama3-70b, ...) or a Hugging Face folder")  # fmt: skip
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--mesh", type=parse_mesh, help="the mesh, e.g. data=256,model=8")
    where.add_argument("--devices", type=int, help="a device count: the search shapes the mesh")
    p.add_argument("--rates", default="h100",
                   help="hardware and levels, e.g. h100,node=8 or tpu_v5p,slice=4096 "
                   "(devices per node or slice: more devices must be whole nodes; "
                   "lowering/rates.py parse: efficiency=, overlap=, memory= ...)")  # fmt: skip
    p.add_argument("--batch", type=int, required=True, help="sequences per step (global)")
    p.add_argument("--length", type=int, required=True, help="tokens per sequence")
    p.add_argument("--compare", action="append", default=[], metavar="LAYOUT[@MESH]",
                   help="a layout to weigh beside the chosen one (repeatable), on the "
                   "chosen mesh or on MESH (e.g. @stage=16,data=2,expert=64: the same "
                   "devices)")  # fmt: skip
    p.add_argument("--stages", type=int, action="append", default=[], metavar="S",
                   help="--devices: also weigh meshes with a pipeline axis stage=S "
                   "outermost (repeatable; S must divide the devices; the layers are "
                   "dealt out as evenly as they go, uneven stages included)")  # fmt: skip
    p.add_argument("--remat", choices=REMATS, help="fix remat (default: searched)")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="the compute dtype (parameters stay float32)",
    )
    p.add_argument("--attention", choices=KERNELS, help="fix the kernel (default: searched)")
    p.add_argument("--grad-accum", type=int, help="fix the microbatches (default: searched)")
    p.add_argument(
        "--optimizer",
        default="adamw",
        help="adamw, adafactor (factored moments), lion, momentum or sgd",
    )
    p.add_argument("--moment-dtype", default="float32", help="the optimizer state's dtype")
    p.add_argument("--zero1", action="store_true", help="optimizer state split over data too")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--jobs", type=int, default=1,
                   help="worker processes searching the (mesh, settings) pairs ahead, the "
                   "plan the same (default 1: in this process; for idle cores: it costs "
                   "more CPU in all, docs/layouts.md)")  # fmt: skip
    return p.parse_args(argv)


def load_config(text: str):
    """The Config named `text`, or what the hub makes of a folder's config.json."""
    from models import catalog
    from models.io import hub

    if Path(text).is_dir():
        family, hf = hub.read_config(Path(text))
        return hub.family_config(family, hf, set(), text)
    return catalog.get(text)


def _meshes(args, layers: int) -> list:
    """The meshes searched: --mesh, or every (data, model) shape of --devices with the
    model axis a power of two up to a node (the rates' node, else 8) innermost, and with
    each --stages S, those shapes of devices / S beside a stage axis outermost (pipeline
    stages cross nodes: their traffic is one activation per microbatch)."""
    from lowering import Mesh
    from models.training.run import UsageError

    node = args.rates_parsed.node
    n = math.prod(args.mesh.values()) if args.mesh is not None else args.devices
    if node and n > node and n % node:  # levels() fills nodes whole (lowering/rates.py)
        raise UsageError(f"--rates {args.rates}: {n} devices are not whole nodes of {node}")
    if args.mesh is not None:
        if args.stages:
            raise UsageError("--stages shapes the meshes of --devices; with --mesh name a "
                             "stage axis in it")  # fmt: skip
        if "stage" in args.mesh:  # a pipeline of the mesh's own (lowering/stages.py)
            args.stages = [args.mesh["stage"]]
        return [Mesh(args.mesh, devices="abstract")]
    if n < 1:
        raise UsageError(f"--devices {n}: must be >= 1")
    for s in args.stages:
        if s < 2 or n % s or layers < s:
            raise UsageError(f"--stages {s}: must be >= 2, divide --devices {n} and be at "
                             f"most the {layers} layers")  # fmt: skip
    node = node or 8
    shapes = []
    for s in [1, *args.stages]:
        m = 1
        while m <= min(n // s, node):
            if (n // s) % m == 0:
                shape = {"data": n // s // m, "model": m}
                shapes.append(shape if s == 1 else {"stage": s, **shape})
            m *= 2
    return [Mesh(s, devices="abstract") for s in shapes]


def _space(args, cfg) -> list:
    from lowering.joint import Settings

    accums = [args.grad_accum] if args.grad_accum else [g for g in (1, 2, 4, 8)
                                                       if args.batch % g == 0]  # fmt: skip
    return [
        Settings(r, d, a, g)
        for r in ([args.remat] if args.remat else REMATS)
        for d in [args.dtype]
        for a in ([args.attention] if args.attention else KERNELS)
        for g in accums
    ]


@dataclasses.dataclass(frozen=True)
class builder:  # noqa: N801 - used as the function it was: builder(cfg, batch, length)
    """`build(settings) -> (loss, (params, batch))` of the decoder LM of `cfg`: the loss
    of one microbatch (batch / grad_accum rows of `length` tokens) under the settings,
    on abstract inputs (lowering/joint.py `joint_search`). A class, so that it pickles
    to the search's worker processes (--jobs)."""

    cfg: object
    batch: int
    length: int

    def __call__(self, settings):
        from models import transformer, zoo
        from models.training import objectives

        model = zoo.get("lm")
        c = self.cfg.replace(batch=self.batch // settings.grad_accum, length=self.length,
                             remat=settings.remat, dtype=settings.dtype,
                             attention=settings.attention, dropout=0.0)  # fmt: skip
        params = transformer.abstract(model.shapes(c))
        rows = objectives.abstract_batch(model.objective, c.batch, c.length)
        return (lambda p, b: model.loss(p, b, c, None)), (params, rows)


@dataclasses.dataclass(frozen=True)
class stage_builder:  # noqa: N801 - used as the function it was
    """`build(settings, counts, first, last) -> (loss, (params, inputs))`: one pipeline
    stage of `cfg` holding `counts` layers of each of `stacks(cfg)` (the first with the
    embedding, the last with the loss head: models/training/stage_programs.py) on one microbatch
    of batch / settings.grad_accum rows; its routing (a MoE stack) is the microbatch's
    own (lowering/stages.py). A class: it pickles (--jobs)."""

    cfg: object
    batch: int
    length: int

    def __call__(self, settings, counts, first, last):
        from models.training.stage_programs import stage_program

        c = self.cfg.replace(remat=settings.remat, dtype=settings.dtype,
                             attention=settings.attention, dropout=0.0)  # fmt: skip
        return stage_program(c, counts, first, last, self.batch // settings.grad_accum,
                             self.length)  # fmt: skip


def _staged(args, cfg, rates, training):
    """joint_search's `staged`: (evaluate, space) for the stage meshes, or None when every
    stack divides each --stages and the model has no experts (then a layers:stage
    layout is searched and run as lowering.pipeline runs it)."""
    from lowering.joint import Settings
    from models.training.stage_programs import stacks

    parts = stacks(cfg)
    if not args.stages or (not cfg.experts and all(n % s == 0 for s in args.stages
                                                    for n in parts)):  # fmt: skip
        return None
    if args.grad_accum:
        counts = [args.grad_accum]
    else:
        s = max(args.stages)
        counts = [m for m in (1, s, 2 * s, 4 * s) if args.batch % m == 0]
    space = [Settings(r, args.dtype, a, m)
             for r in ([args.remat] if args.remat else REMATS)
             for a in ([args.attention] if args.attention else KERNELS)
             for m in counts]  # fmt: skip
    return StagedEvaluate(cfg, args.batch, args.length, tuple(parts), rates, training), space


@dataclasses.dataclass(frozen=True)
class StagedEvaluate:
    """`evaluate(mesh, settings, flops, layout=None, seeds=(), plateau=0.0)`: the
    pipelined plan of a stage mesh (lowering.stages.staged_choice, its layout searches
    seeded and stopped as a joint search's pairs) of `cfg` at --batch and --length, its
    stacks `parts`, held to the rates' memory. A class: it pickles (--jobs)."""

    cfg: object
    batch: int
    length: int
    parts: tuple
    rates: object
    training: object

    def __call__(self, mesh, settings, flops, layout=None, seeds=(), plateau=0.0):
        from lowering.stages import staged_choice

        itemsize = 2 if settings.dtype == "bfloat16" else 4
        boundary = self.batch // settings.grad_accum * self.length * self.cfg.d_model * itemsize
        build = stage_builder(self.cfg, self.batch, self.length)
        return staged_choice(build, mesh, settings, self.parts, self.rates, self.training,
                             self.rates.memory_bytes, flops, boundary, bool(self.cfg.experts),
                             layout=layout, seeds=seeds, plateau=plateau)  # fmt: skip


def plan(args, cache: dict | None = None) -> dict:
    """The plan as a dict (what --json prints), with the printout under "text".
    `cache`: lowering.joint.joint_search's, kept between calls."""
    from lowering import Layout
    from lowering.joint import joint_search, parts_text, why_not
    from lowering.rates import RatesError, parse
    from lowering.train_step import Training
    from models import transformer
    from models.training.run import UsageError

    for flag in ("batch", "length", "jobs"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} {getattr(args, flag)}: must be >= 1")
    if args.grad_accum is not None and (args.grad_accum < 1 or args.batch % args.grad_accum):
        raise UsageError(f"--grad-accum {args.grad_accum}: must be >= 1 and divide --batch")
    try:
        args.rates_parsed = rates = parse(args.rates)
    except RatesError as e:
        raise UsageError(f"--rates: {e}") from None
    try:
        training = Training(args.optimizer, args.moment_dtype, args.zero1)
    except ValueError as e:
        raise UsageError(f"--optimizer/--moment-dtype: {e}") from None
    cfg = load_config(args.config)
    build = builder(cfg, args.batch, args.length)
    tokens = args.batch * args.length
    meshes = _meshes(args, cfg.layers)
    staged = _staged(args, cfg, rates, training)
    joint = joint_search(build, meshes, rates, _space(args, cfg), training,
                         tokens=tokens, cache=cache, staged=staged,
                         chain=transformer.CHAIN, jobs=args.jobs)  # fmt: skip
    best, nxt = joint.best, joint.next_best()
    out = {
        "config": args.config,
        "mesh": dict(best.mesh.sizes),
        "layout": str(best.layout),
        "settings": {**best.settings.as_dict(), "stages": best.stages,
                     "microbatches": best.microbatches},  # fmt: skip
        "memory": best.memory.as_dict(),
        "memory_limit": joint.limit,
        "fits": best.fits,
        "step_seconds": best.step_seconds,
        "compute_seconds": best.compute_seconds,
        "communication_seconds": best.comm_seconds,
        "tokens_per_second_per_device": best.tokens_per_second_per_device(tokens),
        "mfu": best.mfu(rates),
        "rates": str(rates),
        "searched": joint.searched,
        "pruned": joint.pruned,
        "next_best": None if nxt is None else {
            "mesh": dict(nxt.mesh.sizes), "layout": str(nxt.layout),
            "settings": nxt.settings.as_dict(), "step_seconds": nxt.step_seconds,
            "why": why_not(best, nxt)},
    }  # fmt: skip
    lines = [
        f"plan for {args.config}: {args.batch} x {args.length} tokens per step on {best.mesh}",
        f"rates: {rates}",
        f"searched {joint.searched} (mesh, settings) pairs"
        + "".join(f"; {n} not: {why}" for why, n in joint.pruned.items()),
        f"layout:   {best.layout or '(replicated)'}",
        f"settings: {best.settings}, stages={best.stages}, microbatches={best.microbatches}",
        f"memory:   {_gib(best.memory.total)} of {_gib(joint.limit)} per device "
        f"({parts_text(best.memory)})",
        f"step:     {best.step_seconds:.4g} s = compute {best.compute_seconds:.4g} s + "
        f"communication {best.comm_seconds:.4g} s"
        + (" (overlapped: the larger)" if rates.overlap else ""),
        f"speed:    {out['tokens_per_second_per_device']:,.0f} tokens/s per device, "
        f"MFU {out['mfu']:.1%}",
    ]
    if hasattr(best, "assignment"):  # a pipelined plan (lowering/stages.py)
        from models.training.stage_programs import stacks
        from models.transformer import stack_names

        out["settings"]["stages_uneven"] = best.uneven
        out["settings"]["runtime"] = best.runtime
        out["stages"] = best.as_dict()
        lines[3:3] = [f"stages:   {best.stages} over {', '.join(map(str, stacks(cfg)))} layers "
                      f"({best.stages_text(stack_names(cfg))}), bubble {best.bubble:.1%} "
                      f"(1F1B), pads {best.planned_deal.pad_share:.1%} of the stages' ticks "
                      f"(skipped: the stages of fewer layers idle)",
                      f"runtime:  {best.runtime}"]  # fmt: skip
    piped = [c for c in joint.choices if hasattr(c, "assignment")]
    if piped and piped[0] is not best:  # --stages weighed, a plan without them chosen
        from models.transformer import stack_names

        p = piped[0]
        out["pipelined"] = {"mesh": dict(p.mesh.sizes), "layout": str(p.layout),
                            "settings": p.settings.as_dict(), "fits": p.fits,
                            "memory": p.memory.as_dict(), "step_seconds": p.step_seconds,
                            "stages": p.as_dict(), "why": why_not(best, p)}  # fmt: skip
        lines.append(f"pipelined: {p.stages} stages ({p.stages_text(stack_names(cfg))}), "
                     f"bubble {p.bubble:.1%}, {_gib(p.memory.total)} per device "
                     + ("(fits)" if p.fits else "(over the limit)")
                     + f"; {why_not(best, p)}; runtime: {p.runtime}")  # fmt: skip
    if nxt is not None:
        lines.append(f"next best: {why_not(best, nxt)}")
    out["compare"] = []
    searched = Searched(build, rates, training, staged, joint, args.batch)
    for text in args.compare:
        layout, _, where = text.partition("@")
        line = _compare(searched, Layout(layout), where and _on_mesh(where, best))
        out["compare"].append({"layout": text, **line})
        lines.append(f"yours: {text}: {line['verdict']}")
    out["text"] = "\n".join(lines)
    return out


def _on_mesh(text: str, best):
    """--compare's @MESH: a mesh of the chosen plan's devices."""
    from lowering import Mesh
    from models.training.run import UsageError

    try:
        mesh = Mesh(parse_mesh(text), devices="abstract")
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"--compare ...@{text}: {e}") from None
    if mesh.size != best.mesh.size:
        raise UsageError(f"--compare ...@{text}: {mesh.size} devices, the plan's mesh has "
                         f"{best.mesh.size}")  # fmt: skip
    return mesh


@dataclasses.dataclass(frozen=True)
class Searched:
    """What the plan's search weighed, as --compare weighs a layout again: the program
    builder, the rates, the training state's spec, the pipelined planners of --stages
    (None without), the joint search's result (its best plan, its memory limit) and
    --batch."""

    build: Callable
    rates: object
    training: object
    staged: object
    joint: object
    batch: int


def _compare(searched: Searched, layout, mesh=None) -> dict:
    """`layout` under the chosen plan's settings, on its mesh or `mesh`: its memory,
    time, verdict. On a mesh with a stage axis: under the settings of the best pipelined
    plan weighed (its microbatches, or the layout's option `microbatches=M`), beside the
    chosen plan."""
    from lowering.joint import Choice
    from lowering.search import auto_layout
    from lowering.stages import STAGE_AXIS
    from lowering.train_step import Training
    from models.training.run import UsageError

    joint, staged = searched.joint, searched.staged
    best, limit = joint.best, joint.limit
    mesh = mesh or best.mesh
    if STAGE_AXIS in mesh.sizes:
        piped = [c for c in joint.choices if hasattr(c, "assignment")] if joint else []
        if staged is None or not piped:
            raise UsageError(f"--compare on {mesh}: a stage axis is weighed beside the "
                             f"pipelined plans of --stages only")  # fmt: skip
        like = piped[0]  # the best pipelined plan weighed (choices are best first)
        settings, layout = _microbatches_of(layout, like.settings, searched.batch)
        mine = staged[0](mesh, settings, like.model_flops, layout=layout)
        if not mine.candidate.valid and not mine.candidate.note.startswith("over"):
            return {"fits": False, "verdict": f"not valid on {mesh} ({mine.candidate.note})"}
        return _verdict(mine, best, limit, mesh)
    if mesh is not best.mesh and hasattr(best, "assignment"):
        raise UsageError(f"--compare on {mesh}: the chosen plan is pipelined; name its "
                         f"stage axis")  # fmt: skip
    fn, inputs = searched.build(best.settings)
    training, rates = searched.training, searched.rates
    run = Training(training.optimizer, training.moment_dtype, training.zero1,
                   best.settings.grad_accum)  # fmt: skip
    _, table = auto_layout(fn, mesh, *inputs, grad_argnums=(0,), rates=rates,
                           memory_limit=math.inf, training=run, candidates=[layout],
                           beam=1)  # fmt: skip
    cand = table.theirs[0]
    if cand.note.startswith("invalid"):
        return {"fits": False, "verdict": f"not valid on {mesh} ({cand.note})"}
    return _verdict(Choice(mesh, best.settings, cand, best.model_flops, limit), best, limit,
                    mesh)  # fmt: skip


def _microbatches_of(layout, settings, batch: int):
    """(settings, layout): a compared pipelined layout's own `microbatches=M` option as the
    settings' microbatches (else the best pipelined plan's), the option taken out."""
    from dataclasses import replace

    from lowering import Layout
    from models.training.run import UsageError

    m = layout.options.get("microbatches")
    if m is None:
        return settings, layout
    if not isinstance(m, int) or m < 1 or batch % m:
        raise UsageError(f"--compare {layout}: microbatches={m} must be an int >= 1 that "
                         f"divides --batch")  # fmt: skip
    rest = {k: v for k, v in layout.options.items() if k != "microbatches"}
    return replace(settings, grad_accum=m), Layout(layout.rules, options=rest)


def _verdict(mine, best, limit, mesh) -> dict:
    from lowering.joint import parts_text, why_not

    fits = mine.fits
    verdict = (
        f"{_gib(mine.memory.total)} per device ({parts_text(mine.memory)}), "
        + ("fits" if fits else f"over the {_gib(limit)} limit")
        + f"; {why_not(best, mine)}"
    )
    return {"fits": fits, "memory": mine.memory.as_dict(), "step_seconds": mine.step_seconds,
            "verdict": verdict}  # fmt: skip


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


@one_line_on_ctrl_c
def main(argv=None, prog: str = "python -m models.cli.plan") -> int:
    args = arguments(argv, prog)
    from lowering.joint import PlanError

    name = prog.removeprefix("python -m ")
    try:
        out = plan(args)
    except PlanError as e:
        return fail(e, EXIT_NO_PLAN, name)
    except (*user_errors(), KeyError) as e:  # one line, never a traceback
        return fail(e, 2, name)
    if args.json:
        out.pop("text")
        print(json.dumps(out, indent=1))
    else:
        print(out["text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
