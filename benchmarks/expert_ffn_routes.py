"""How often an expert-parallel MoE layer routes its tokens: the all-to-alls in the
compiled HLO of the zoo's dropless MoE layer (gated SiLU experts: wi, wg, wo) lowered on
8 CPU devices with the tokens and the experts split over one axis
(`batch:data;experts:data`), its forward alone and its training step (jax.value_and_grad
of the lowered layer under jit, by its parameters and its input, as a layer's inside a
model), with XLA's temporaries (`memory_analysis`) and their min and median times.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.expert_ffn_routes

Every all-to-all of a round's loop is one HLO op, which runs once a round (a balanced
load takes one round: lowering/expert_routes.py). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter

import jax
import numpy as np

import namedmesh as nm
from benchmarks import cli
from lowering import Mesh, lower
from lowering.hlo import collectives
from models import architecture as config
from models import transformer
from models.layers import moe


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=cli.count, default=16)
    ap.add_argument("--length", type=cli.count, default=32)
    ap.add_argument("--d-model", type=cli.count, default=64)
    ap.add_argument("--d-ff", type=cli.count, default=128)
    ap.add_argument("--experts", type=cli.count, default=8)
    ap.add_argument("--repeats", type=cli.count, default=30)
    a = ap.parse_args(argv)
    n = len(jax.devices())
    sizes = dict(d_model=a.d_model, d_ff=a.d_ff, length=a.length, batch=a.batch, experts=a.experts)
    cfg = config.Config(vocab=64, heads=2, d_kv=8, layers=1, ffn="gated_silu", **sizes)
    p = transformer.init(moe.moe_params(cfg), 0)
    x = np.random.default_rng(0).normal(size=(cfg.batch, cfg.length, cfg.d_model))
    x = nm.tensor(x.astype(np.float32), ("batch", "length", "d_model"))
    layer = lower(lambda p, x: moe.moe(x, p, cfg)[:2], Mesh({"data": n}), "batch:data;experts:data")

    def loss(p, x):
        out, stats = layer(p, x)
        return (out.data**2).mean() + 0.01 * stats["balance"].data.mean()

    forward = jax.jit(lambda p, x: layer(p, x)[0].data)
    step = jax.jit(jax.value_and_grad(loss, (0, 1)))  # x's too, as a layer's in a model
    print(f"| MoE layer, {n} devices, `batch:data;experts:data` | all-to-all ops | all-reduce "
          "ops | XLA temporaries MB | min / median ms |\n|---|---|---|---|---|")  # fmt: skip
    for name, fn in (("forward", forward), ("training step", step)):
        compiled = fn.lower(p, x).compile()
        kinds = Counter(k for k, _, _ in collectives(compiled.as_text()))
        temp = compiled.memory_analysis().temp_size_in_bytes / 1e6
        fast, mid = _times_ms(fn, (p, x), a.repeats)
        counts = f"{kinds['all-to-all']} | {kinds['all-reduce']} | {temp:.2f}"
        print(f"| {name} | {counts} | {fast:.2f} / {mid:.2f} |")
    return 0


def _times_ms(fn, args, repeats: int) -> tuple[float, float]:
    """(min, median) wall time of a call, in ms."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return min(times) * 1e3, statistics.median(times) * 1e3


if __name__ == "__main__":
    sys.exit(cli.run(main))
