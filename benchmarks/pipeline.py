"""`python -m benchmarks.pipeline [--docs PATH]`: the LM's training step with its layer
stack pipelined over a `stage` axis (lowering/pipeline.py), beside the same model under
FSDP and data parallelism, on 8 simulated CPU devices.

Per layout: the bytes each device sends per step as the cost model plans them (forward
and backward; a loop's collectives counted once per iteration, which the HLO text holds
once), against the least a pipeline must send (each microbatch's activations once
across its stage boundary, each way); the bubble; XLA's per-device peak memory and its
arguments (parameters and batch) from `memory_analysis()`, beside the cost model's
training-memory estimate; the median step time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

from benchmarks import cli

SECTION = "## Pipelines: the LM's layers over a stage axis"
MEGATRON = "layers:stage;batch:data;heads:model;d_ff:model"
LAYOUTS = [  # (name, mesh, layout)
    ("stage=8", {"stage": 8}, "layers:stage"),
    ("stage=4 x data=2", {"stage": 4, "data": 2}, "layers:stage;batch:data"),
    ("stage=2 x data=2 x model=2", {"stage": 2, "data": 2, "model": 2}, MEGATRON),
    ("the same, circular", {"stage": 2, "data": 2, "model": 2}, MEGATRON + ";schedule=circular"),
    ("FSDP", {"data": 8}, "batch:data;d_model:data"),
    ("data parallel", {"data": 8}, "batch:data"),
]


def _model():
    from benchmarks.long_seq import lm_batch
    from models import catalog, transformer

    cfg = catalog.get("tiny").replace(layers=8, length=32, batch=16)
    params = transformer.init(transformer.lm_shapes(cfg), 0)
    batch = lm_batch(cfg, cfg.length, cfg.batch)
    return cfg, params, batch, lambda p, b: transformer.lm_loss(p, b, cfg)


def rows(repeats: int = 5) -> list[dict]:
    """One row per (layout, metric); see the module docstring."""
    import jax

    from benchmarks import memory, report
    from lowering import Mesh, lower
    from lowering.rates import median_seconds

    cfg, params, batch, loss = _model()
    out = []
    for name, sizes, layout in LAYOUTS:
        lowered = lower(loss, Mesh(sizes), layout)
        step = jax.jit(jax.value_and_grad(lambda p, f=lowered: f(p, batch).data))
        compiled = step.lower(params).compile()
        rep = lowered.report(params, batch, wrt=0, show=False)
        plan = rep.pipelines[0] if rep.pipelines else None
        mesh = "x".join(str(n) for n in sizes.values())
        analysis = compiled.memory_analysis()
        jax.block_until_ready(compiled(params))
        seconds = median_seconds({"s": (compiled, (params,))}, repeats)["s"]
        figures = [
            ("bytes per step", rep.bytes + rep.backward_bytes,
             2 * plan.minimum_bytes if plan else None),
            ("bubble", plan.bubble if plan else 0.0, None),
            ("microbatches", plan.microbatches if plan else 1, None),
            ("peak memory", memory.peak_bytes(compiled), None),
            ("estimated memory", rep.peak_memory, None),
            ("argument bytes", analysis.argument_size_in_bytes, None),
            ("step seconds", seconds, None),
        ]  # fmt: skip
        out += [report.row("pipeline", name, layout, mesh, *f) for f in figures]
    return out


PAPER = "lm1b_5"  # 4.9B parameters, 6 layers; the paper's mesh is batch 16 x model 32
PAPER_LAYOUTS = [  # (name, mesh, layout), 512 cores each
    ("the paper's", {"batch": 16, "model": 32}, "batch:batch;vocab:model;d_ff:model;heads:model"),
    ("stage=2", {"stage": 2, "batch": 16, "model": 16},
     "layers:stage;batch:batch;vocab:model;d_ff:model;heads:model"),
    ("stage=2, wider batch", {"stage": 2, "batch": 32, "model": 8},
     "layers:stage;batch:batch;vocab:model;d_ff:model;heads:model"),
]  # fmt: skip


def paper_rows() -> list[dict]:
    """The paper's largest LM planned on 512 abstract cores (no devices), with and without
    a stage axis: per device, bytes per step (forward and backward), parameter bytes,
    the bubble and the activations the pipeline keeps."""
    import math

    from benchmarks import report
    from lowering import Layout, Mesh, lower
    from lowering.layout import local_shape
    from models import catalog, transformer
    from models.training import objectives

    cfg = catalog.get(PAPER)
    params = transformer.abstract(transformer.lm_shapes(cfg))
    batch = objectives.abstract_batch("lm", cfg.batch, cfg.length)
    leaves = [t for t in _leaves(params)]
    out = []
    for name, sizes, layout in PAPER_LAYOUTS:
        mesh = Mesh(sizes, devices="abstract")
        rep = lower(lambda p, b: transformer.lm_loss(p, b, cfg), mesh, layout).report(
            params, batch, wrt=0, show=False
        )
        plan = rep.pipelines[0] if rep.pipelines else None
        of = lambda t, mesh=mesh, layout=layout: Layout(layout).of(t.dims, t.shape, mesh)
        param_bytes = sum(math.prod(local_shape(of(t), t.shape, mesh)) * 4 for t in leaves)
        figures = [
            ("bytes per step", rep.bytes + rep.backward_bytes, None),
            ("parameter bytes", param_bytes, None),
            ("bubble", plan.bubble if plan else 0.0, None),
            ("microbatches", plan.microbatches if plan else 1, None),
            ("activations kept", plan.activation_bytes if plan else None, None),
        ]
        text = "x".join(f"{k}={n}" for k, n in sizes.items())
        out += [report.row("pipeline_paper", name, layout, text, *f) for f in figures]
    return out


def _leaves(tree):
    import jax

    import namedmesh as nm

    return jax.tree_util.tree_leaves(tree, is_leaf=lambda t: isinstance(t, nm.Tensor))


def _paper_table(rows_: list[dict]) -> str:
    from benchmarks import report

    by = {}
    for r in rows_:
        by.setdefault((r["case"], r["layout"], r["mesh"]), {})[r["metric"]] = r["namedmesh"]
    head = ["layout", "mesh", "bytes/step", "parameter bytes", "M", "bubble",
            "pipeline activations kept"]  # fmt: skip
    cells = [
        [f"{case}: `{layout}`", mesh, f"{m['bytes per step'] / 1e9:.2f} GB",
         f"{m['parameter bytes'] / 1e9:.2f} GB", str(m["microbatches"]), f"{m['bubble']:.0%}",
         "—" if m["activations kept"] is None else f"{m['activations kept'] / 1e9:.2f} GB"]
        for (case, layout, mesh), m in by.items()
    ]  # fmt: skip
    return report.md_table(head, cells)


def _table(rows_: list[dict]) -> str:
    from benchmarks import report

    by = {}
    for r in rows_:
        by.setdefault((r["case"], r["layout"], r["mesh"]), {})[r["metric"]] = r
    head = ["layout", "mesh", "bytes/step", "minimum", "/min", "M", "bubble", "peak memory",
            "estimate", "parameters + batch", "step ms"]  # fmt: skip
    cells = []
    for (case, layout, mesh), m in by.items():
        b = m["bytes per step"]
        cells.append([
            f"{case}: `{layout}`", mesh, f"{b['namedmesh']:,.0f}",
            "—" if b["minimum"] is None else f"{b['minimum']:,.0f}",
            "—" if b["ratio_to_min"] is None else f"{b['ratio_to_min']:.2f}",
            str(m["microbatches"]["namedmesh"]), f"{m['bubble']['namedmesh']:.0%}",
            f"{m['peak memory']['namedmesh']:,}", f"{m['estimated memory']['namedmesh']:,}",
            f"{m['argument bytes']['namedmesh']:,}",
            f"{m['step seconds']['namedmesh'] * 1e3:.1f}",
        ])  # fmt: skip
    return report.md_table(head, cells)


def write_docs(path: Path, rows_: list[dict], command: str) -> None:
    """Write (or replace) the SECTION of the markdown file at `path` from `rows_` (the
    8-device rows, then the paper-scale ones)."""
    from benchmarks import report

    paper = [r for r in rows_ if r["bench"] == "pipeline_paper"]
    rows_ = [r for r in rows_ if r["bench"] == "pipeline"]
    text = f"""{SECTION}

Made by `{command}` on {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, on 8
simulated CPU devices (one machine's cores: the times say what the schedule costs in
work, not what a pipeline over real links gains; on this
shared 2-core machine they vary up to 2x between runs). The model is the tiny LM with 8
layers (d_model 64, 4 heads, d_ff 256, vocab 256), batch 16 x length 32, float32, one
training step (loss and gradients).

{_table(rows_)}

Per device and per step. **bytes/step** is what the cost model plans each device to
send, forward and backward (tests/test_pipeline.py holds the pipelines' permutes
against the compiled HLO); **minimum** is the least a pipeline sends, each
microbatch's activations (batch, length, d_model) once across its stage boundary each
way. A pipeline sends more than that for three reasons: every one of the M+S-1 ticks
sends a microbatch (the bubble's ticks send zeros), the last stage's result is
all-reduced to every stage (the rest of the program runs on each), and the backward
pass all-reduces the gradient of the carry that only stage 0 read. Data parallelism
and FSDP send the gradients' all-reduce (FSDP: reduce-scatter, and the parameters'
all-gathers) instead. **peak memory** is XLA's (arguments + outputs + temporaries);
**estimate** the cost model's (`report(wrt=0).peak_memory`, what `auto_layout` holds
against a memory limit; a pipeline's counts the activations of its M+S-1 ticks of one
microbatch on the stage's L/S layers, `PipelinePlan.activation_share`);
**parameters + batch** XLA's arguments: a pipeline keeps 1/S of the layer stack per
device, the rest of the model (embedding) replicated. The circular row
(`schedule=circular`: R = S = 2 rounds of 2 layers per stage) has a smaller bubble
than GPipe's on the same mesh, (S-1)/(R*M+S-1) against (S-1)/(M+S-1), for more bytes
(a microbatch each of R*M+S-1 ticks, and the all_to_all that deals the stage's layers
out) and more memory than the estimate says: XLA keeps each tick's chunk of layers for
the backward pass, which the estimate does not count.

At paper scale, planned without devices (`Mesh(sizes, devices="abstract")`): the 4.9B
`{PAPER}` LM (6 layers, batch 256 x length 256, float32) on 512 cores, the paper's
layout beside the same Megatron rules with a stage axis:

{_paper_table(paper)}

Per device; bytes/step is the cost model's (forward and backward). With stage=2 x
model=16 each device holds the paper's parameter bytes (the layer stack halved by the
stages, doubled by the smaller model axis) and sends about 13% less (Megatron's
all-reduces span 16 devices, not 32), for an 11% bubble and the activations of
M+S-1 ticks; halving the model axis again for a wider batch doubles the parameters
per device and sends more. "Activations kept" is the pipeline's estimate (ticks x
layers per stage x what one iteration on a microbatch keeps, remat "none").
"""
    report.write_section(path, SECTION, text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__.split("\n")[0])
    p.add_argument("--docs", default="docs/benchmarks.md", help="'' to skip")
    p.add_argument("--repeats", type=cli.count, default=5, help="timed steps per layout")
    args = p.parse_args(argv)
    if "jax" not in sys.modules:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    found = rows(args.repeats) + paper_rows()
    print(_table([r for r in found if r["bench"] == "pipeline"]))
    print(_paper_table([r for r in found if r["bench"] == "pipeline_paper"]))
    if args.docs:
        write_docs(Path(args.docs), found, "python -m benchmarks.pipeline")
        print(f"wrote {SECTION!r} in {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
