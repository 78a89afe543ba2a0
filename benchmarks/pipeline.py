"""`python -m benchmarks.pipeline [--docs PATH]`: the LM's training step with its layer
stack pipelined over a `stage` axis (lowering/pipeline.py), beside the same model under
FSDP and data parallelism, on 8 simulated CPU devices.

Per layout: the bytes each device sends per step as the cost model plans them (forward
and backward; a loop's collectives counted once per iteration, which the HLO text holds
once), against the least a pipeline must send (each microbatch's activations once
across its stage boundary, each way); the bubble; XLA's per-device peak memory and its
arguments (parameters and batch) from `memory_analysis()`; the median step time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

SECTION = "## Pipelines: the LM's layers over a stage axis"
MEGATRON = "layers:stage;batch:data;heads:model;d_ff:model"
LAYOUTS = [  # (name, mesh, layout)
    ("stage=8", {"stage": 8}, "layers:stage"),
    ("stage=4 x data=2", {"stage": 4, "data": 2}, "layers:stage;batch:data"),
    ("stage=2 x data=2 x model=2", {"stage": 2, "data": 2, "model": 2}, MEGATRON),
    ("FSDP", {"data": 8}, "batch:data;d_model:data"),
    ("data parallel", {"data": 8}, "batch:data"),
]


def _model():
    import numpy as np

    import namedmesh as nm
    from models import config, transformer

    cfg = config.get("tiny").replace(layers=8, length=32, batch=16)
    params = transformer.init(transformer.lm_shapes(cfg), 0)
    tok = np.random.default_rng(0).integers(0, cfg.vocab, size=(cfg.batch, cfg.length + 1))
    dims = ("batch", "length")
    batch = {
        "inputs": nm.tensor(tok[:, :-1].astype(np.int32), dims),
        "targets": nm.tensor(tok[:, 1:].astype(np.int32), dims),
        "weights": nm.tensor(np.ones((cfg.batch, cfg.length), np.float32), dims),
    }
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
            ("argument bytes", analysis.argument_size_in_bytes, None),
            ("step seconds", seconds, None),
        ]  # fmt: skip
        out += [report.row("pipeline", name, layout, mesh, *f) for f in figures]
    return out


def _table(rows_: list[dict]) -> str:
    from benchmarks import report

    by = {}
    for r in rows_:
        by.setdefault((r["case"], r["layout"], r["mesh"]), {})[r["metric"]] = r
    head = ["layout", "mesh", "bytes/step", "minimum", "/min", "M", "bubble", "peak memory",
            "parameters + batch", "step ms"]  # fmt: skip
    cells = []
    for (case, layout, mesh), m in by.items():
        b = m["bytes per step"]
        cells.append([
            f"{case}: `{layout}`", mesh, f"{b['namedmesh']:,.0f}",
            "—" if b["minimum"] is None else f"{b['minimum']:,.0f}",
            "—" if b["ratio_to_min"] is None else f"{b['ratio_to_min']:.2f}",
            str(m["microbatches"]["namedmesh"]), f"{m['bubble']['namedmesh']:.0%}",
            f"{m['peak memory']['namedmesh']:,}", f"{m['argument bytes']['namedmesh']:,}",
            f"{m['step seconds']['namedmesh'] * 1e3:.1f}",
        ])  # fmt: skip
    return report.md_table(head, cells)


def write_docs(path: Path, rows_: list[dict], command: str) -> None:
    """Write (or replace) the SECTION of the markdown file at `path` from `rows_`."""
    from benchmarks import report

    text = f"""{SECTION}

Made by `{command}` on {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, on 8
simulated CPU devices (one machine's cores: the times say what the schedule costs in
work, not what a pipeline over real links gains). The model is the tiny LM with 8
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
**parameters + batch** its arguments: a pipeline keeps 1/S of the layer stack per
device, the rest of the model (embedding) replicated.
"""
    report.write_section(path, SECTION, text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pipeline",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--docs", default="docs/benchmarks.md", help="'' to skip")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per layout")
    args = p.parse_args(argv)
    if "jax" not in sys.modules:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    found = rows(args.repeats)
    print(_table(found))
    if args.docs:
        write_docs(Path(args.docs), found, "python -m benchmarks.pipeline")
        print(f"wrote {SECTION!r} in {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
