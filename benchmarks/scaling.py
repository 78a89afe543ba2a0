"""How the cost of getting a program onto a mesh grows with depth: compile time of the
LM's training step for 1 to 32 layers (flat, since the layers are one scan), and the
planner's time (trace + plan + report, no compile) for a 24-layer model."""

from __future__ import annotations

import time

import jax
import numpy as np

from benchmarks import report
from lowering import Mesh, lower
from models import catalog, transformer
from models.training import objectives

MESH, LAYOUT = {"rows": 2, "cols": 4}, "batch:rows;heads:cols;d_ff:cols;vocab:cols"


def _abstract_inputs(cfg):
    batch = objectives.abstract_batch("lm", cfg.batch, cfg.length)
    return transformer.abstract(transformer.lm_shapes(cfg)), batch


def compile_seconds(layers: int, cfg_name: str = "tiny") -> float:
    """Seconds to compile jax.grad of the lowered LM loss on the 2x4 mesh."""
    # the layers as one loop (Config.scan_layers's "auto" unrolls small stacks, whose
    # compile time then grows with depth: benchmarks/layer_loop.py)
    cfg = catalog.get(cfg_name, layers=layers, scan_layers=True)
    f = lower(lambda p, b: transformer.lm_loss(p, b, cfg), Mesh(MESH), LAYOUT)
    params, batch = _abstract_inputs(cfg)
    step = jax.jit(jax.grad(lambda p, b: f(p, b).data))
    lowered = step.lower(params, batch)
    start = time.perf_counter()
    lowered.compile()
    return time.perf_counter() - start


def planner_seconds(layers: int = 24, cfg_name: str = "base", repeats: int = 3) -> float:
    """Median seconds for trace + plan + report of the LM loss (no compile, no devices)."""
    cfg = catalog.get(cfg_name, layers=layers)
    params, batch = _abstract_inputs(cfg)
    mesh = Mesh(MESH, devices="abstract")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        lower(lambda p, b: transformer.lm_loss(p, b, cfg), mesh, LAYOUT).report(
            params, batch, show=False
        )
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def rows(depths=(1, 2, 4, 8, 16, 32)) -> list[dict]:
    mesh = "x".join(f"{a}={s}" for a, s in MESH.items())
    out = [
        report.row("compile_time", f"tiny LM, {n} layers", LAYOUT, mesh,
                   "seconds to compile the training step", compile_seconds(n))
        for n in depths
    ]  # fmt: skip
    out.append(
        report.row("planner_time", "base LM, 24 layers", LAYOUT, mesh,
                   "seconds for trace + plan + report", planner_seconds())
    )  # fmt: skip
    return out
