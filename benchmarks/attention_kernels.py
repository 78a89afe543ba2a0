"""`python -m benchmarks.attention_kernels [--lengths 1024,2048,8192] [--rounds 5]
[--blocks 128,256] [--forward] [--docs docs/benchmarks.md]`: one layer's causal
self-attention alone (batch 1, 4 heads of 64), its output and the gradients of q, k and
v, timed for nm.dot_product_attention (kernel "auto", and each of its KERNELS) against
PyTorch's scaled_dot_product_attention (its fused CPU flash kernel), single-threaded, by
CPU time, alternated (benchmarks/fair.py). `--blocks` adds namedmesh.flash's kernel at
those row blocks (to choose flash.block_for); `--forward` times the forward pass alone;
`--baseline FILE` adds another version of namedmesh/flash.py (e.g. `git show
REV:namedmesh/flash.py > old.py`) at flash.block_for's blocks, to time a change within
one run.
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np

import namedmesh as nm
from benchmarks import cli, fair
from namedmesh import attention, flash

SECTION = "## Attention alone: namedmesh's kernels against PyTorch's SDPA"
DIMS = ("length", "heads", "d_kv")


def _module(path: str):
    """The flash kernel's module at `path` (another version of namedmesh/flash.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("flash_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sides(n: int, heads: int, d: int, blocks: list[int], forward: bool, baseline=None) -> dict:
    """name: a call that blocks until its step is done, for each side."""
    import torch

    r = np.random.default_rng(0)
    q, k, v, g = (r.standard_normal((n, heads, d), np.float32) for _ in range(4))
    scale = 1 / np.sqrt(d)

    def nm_loss(kernel):
        def loss(q, k, v):
            t = lambda x, m: nm.tensor(x, ("length" if m else "memory", "heads", "d_kv"))
            out = nm.dot_product_attention(
                t(q, 1), t(k, 0), t(v, 0), scale=scale, causal=True, kernel=kernel
            )
            return (out.data * g).sum()

        return loss

    def block_loss(block, kernel=flash):
        def loss(q, k, v):
            qa, ka, va = (x.transpose(1, 0, 2) for x in (q, k, v))
            out = kernel.attention(qa[:, None], ka, va, None, scale, True, 0, block)
            return (out[:, 0].transpose(1, 0, 2) * g).sum()

        return loss

    losses = {"namedmesh auto": nm_loss("auto")}
    losses |= {f"namedmesh {name}": nm_loss(name) for name in attention.KERNELS}
    losses |= {f"flash block {b}": block_loss(b) for b in blocks}
    if baseline:
        losses["flash baseline"] = block_loss(flash.block_for(n, heads), _module(baseline))
    sides = {}
    for name, loss in losses.items():
        step = jax.jit(loss if forward else jax.grad(loss, argnums=(0, 1, 2)))
        sides[name] = lambda s=step: jax.block_until_ready(s(q, k, v))
    tq, tk, tv = (torch.tensor(x.transpose(1, 0, 2)[None], requires_grad=True) for x in (q, k, v))
    tg = torch.tensor(g.transpose(1, 0, 2)[None])

    def torch_step():
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if forward:
            with torch.no_grad():
                return sdpa(tq, tk, tv, is_causal=True, scale=scale)
        (sdpa(tq, tk, tv, is_causal=True, scale=scale) * tg).sum().backward()
        for x in (tq, tk, tv):
            x.grad = None

    sides["PyTorch SDPA"] = torch_step
    return sides


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=cli.counts, default=[1024, 2048, 8192])
    p.add_argument("--heads", type=cli.count, default=4)
    p.add_argument("--d", type=cli.count, default=64)
    p.add_argument("--rounds", type=cli.count, default=5)
    p.add_argument("--blocks", type=cli.counts, default=[], help="flash row blocks to time besides")
    p.add_argument("--forward", action="store_true", help="the forward pass alone")
    p.add_argument("--baseline", default=None, help="another namedmesh/flash.py to time besides")
    p.add_argument("--docs", default=None, help="write the table into this markdown file")
    args = p.parse_args(argv)
    threads = fair.single_threaded()  # before jax's first computation
    blocks = args.blocks
    before = fair.load()
    lines = []
    for n in args.lengths:
        sides = _sides(n, args.heads, args.d, blocks, args.forward, args.baseline)
        t = fair.alternate(sides, args.rounds)
        torch_t = t.pop("PyTorch SDPA")
        if not lines:
            head = ["length", *[f"{s} s / PyTorch" for s in t], "PyTorch SDPA s"]
            lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        cells = [f"{fair.cell(ts, 1)} / {fair.ratio(ts, torch_t)}" for ts in t.values()]
        lines.append("| " + " | ".join([str(n), *cells, fair.cell(torch_t, 1)]) + " |")
        print(lines[-1], flush=True)
    what = "forward pass" if args.forward else "output and gradients of q, k, v"
    method = fair.METHOD.format(flags=fair.XLA_SINGLE_THREAD, rounds=args.rounds,
                                before=before, after=fair.load())  # fmt: skip
    intro = (f"Causal self-attention, batch 1, {args.heads} heads of {args.d}, {what}; cells "
             f"are seconds min / median, then the ratio to PyTorch by min / by median. "
             f"{method} ({threads})")  # fmt: skip
    command = " ".join(["python -m benchmarks.attention_kernels", *(argv or sys.argv[1:])])
    text = "\n".join([SECTION, "", "```sh", command, "```", "", intro, "", *lines])
    print(text)
    if args.docs:
        from benchmarks import report

        report.write_section(args.docs, SECTION, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
