"""`python -m benchmarks.long_seq [--configs tiny,small] [--lengths 1024,2048,4096]
[--docs docs/benchmarks.md]`: the memory of a long-sequence training step.

For each config, length, attention (full, blockwise), remat policy (none, full) and
layout (one device; a 2x4 mesh splitting batch... see LAYOUTS), the LM's loss and
gradients at batch 1 are compiled and XLA's memory_analysis() peak (arguments + outputs
+ temporaries - aliased) is held against the lowering report's estimate
(`report(wrt=0).peak_memory`). The goals are ratios measured in the same run: the
`small` LM at 4k with blockwise attention and full remat against full attention
without remat; the peak's growth from 1k to 4k; and trained tokens/s at 1k with remat
against without.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

import namedmesh as nm
from benchmarks.memory import peak_bytes
from lowering import Mesh, lower
from models import config, transformer

LAYOUTS = {
    "one device": ({"one": 1}, ""),
    "2x4": ({"rows": 2, "cols": 4}, "length:rows;heads:cols;d_ff:cols;vocab:cols"),
}
SECTION = "## Long sequences: training-step memory, estimate vs XLA"


def _batch(cfg, length: int) -> dict:
    r = np.random.default_rng(0)
    tok = r.integers(0, cfg.vocab, (1, length + 1)).astype(np.int32)
    ones = np.ones((1, length), np.float32)
    return {
        k: nm.tensor(v, ("batch", "length"))
        for k, v in (("inputs", tok[:, :-1]), ("targets", tok[:, 1:]), ("weights", ones))
    }


def row(name: str, length: int, attention: str, remat: str, layout: str, run: bool = False):
    """One measurement: (estimate bytes, XLA bytes, tokens/s or None)."""
    cfg = config.get(name, length=length, batch=1, attention=attention, remat=remat)
    cfg = cfg.replace(attention_block=min(512, length))
    sizes, rules = LAYOUTS[layout]
    params = transformer.init(transformer.lm_shapes(cfg), 0)
    batch = _batch(cfg, length)
    lowered = lower(lambda p, b: transformer.lm_loss(p, b, cfg), Mesh(sizes), rules)
    estimate = lowered.report(params, batch, wrt=0, show=False).peak_memory
    step = jax.jit(jax.value_and_grad(lambda p, b: lowered(p, b).data))
    compiled = step.lower(params, batch).compile()
    rate = None
    if run:
        jax.block_until_ready(compiled(params, batch))
        start, n = time.perf_counter(), 3
        for _ in range(n):
            jax.block_until_ready(compiled(params, batch))
        rate = n * length / (time.perf_counter() - start)
    return estimate, peak_bytes(compiled), rate


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="tiny,small")
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--layouts", default="one device,2x4")
    p.add_argument("--docs", default=None, help="append the table to this markdown file")
    p.add_argument("--goals", action="store_true", help="only the rows the goals need")
    args = p.parse_args(argv)
    lines = ["| config | length | attention | remat | layout | estimate MiB | XLA MiB | est/XLA |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    peaks, rates = {}, {}
    for name, length, attention, remat, layout in _rows(args):
        run = (name, length, attention, layout) == ("small", 1024, "blockwise", "one device")
        est, xla, rate = row(name, length, attention, remat, layout, run)
        peaks[name, length, attention, remat, layout] = xla
        if rate is not None:
            rates[remat] = rate
        lines.append(
            f"| {name} | {length} | {attention} | {remat} | {layout} | "
            f"{est / 2**20:.1f} | {xla / 2**20:.1f} | {est / xla:.2f} |"
        )
        print(lines[-1], flush=True)
    goals = _goals(peaks, rates)
    text = "\n".join([SECTION, "", *lines, "", *goals])
    print("\n".join(goals))
    if args.docs:
        with open(args.docs, "a") as f:
            f.write("\n" + text + "\n")
    return 0


def _rows(args) -> list[tuple]:
    """(config, length, attention, remat, layout) of every row to measure."""
    if args.goals:
        one = "one device"
        return [
            ("small", 1024, "blockwise", "none", one),
            ("small", 1024, "blockwise", "full", one),
            ("small", 4096, "blockwise", "full", one),
            ("small", 4096, "full", "none", one),
        ]
    return [
        (name, length, attention, remat, layout)
        for name in args.configs.split(",")
        for length in map(int, args.lengths.split(","))
        for attention in ("full", "blockwise")
        for remat in ("none", "full")
        for layout in args.layouts.split(",")
    ]


def _goals(peaks: dict, rates: dict) -> list[str]:
    out = []
    one = "one device"
    base = peaks.get(("small", 4096, "full", "none", one))
    best = peaks.get(("small", 4096, "blockwise", "full", one))
    if base and best:
        out.append(f"- small, 4k, blockwise + full remat vs full attention, no remat: "
                   f"{best / base:.3f} (goal <= 0.125)")  # fmt: skip
    k1 = peaks.get(("small", 1024, "blockwise", "full", one))
    if k1 and best:
        out.append(f"- small, blockwise + full remat, peak 4k / 1k: {best / k1:.2f} (goal <= 4.5)")
    if "none" in rates and "full" in rates:
        out.append(f"- small, 1k, blockwise: tokens/s without remat / with full remat: "
                   f"{rates['none'] / rates['full']:.2f} (goal <= 1.4)")  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
