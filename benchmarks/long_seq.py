"""`python -m benchmarks.long_seq [--configs tiny,small] [--lengths 1024,2048,4096]
[--docs docs/benchmarks.md]`: the memory of a long-sequence training step; with
`--vs-torch 2048,8192`, its time against PyTorch's scaled dot-product attention instead;
with `--memory 16384,32768`, its peak memory against PyTorch's.

For each config, length, attention (full, blockwise), remat policy (none, full) and
layout (one device; a 2x4 mesh splitting batch... see LAYOUTS), the LM's loss and
gradients at batch 1 are compiled and XLA's memory_analysis() peak (arguments + outputs
+ temporaries - aliased) is held against the lowering report's estimate
(`report(wrt=0).peak_memory`). The goals are ratios measured in the same run: the
`small` LM at 4k with blockwise attention and full remat against full attention
without remat; the peak's growth from 1k to 4k; and trained tokens/s at 1k with remat
against without.

`--vs-torch LENGTHS`: a GPT-2 architecture of the small LM's shape (4 layers, d_model
256, 4 heads, d_ff 1024, a 256-token vocabulary, LENGTH positions) built by transformers
with `attn_implementation="sdpa"`, loaded into the zoo, and the loss and gradients of
one batch-1 sequence timed for namedmesh (each of KINDS: full attention up to 4k tokens;
fused, nm.dot_product_attention, whose CPU kernel from 512 tokens is namedmesh.flash's
row blocks, with the layers as Config.scan_layers's default "auto" picks, in one loop
and unrolled; blockwise, which skips the causally masked key blocks, without and with
full remat; `--kinds` picks some, ';' between) against PyTorch, single-threaded, by CPU
time, alternated (benchmarks/fair.py), each cell with the CPU seconds its step took to
trace, lower and compile.

`--memory LENGTHS`: the same step's peak memory per kind, namedmesh's from XLA's memory
analysis of the compiled step (nothing run), PyTorch's measured (one step in a fresh
process: its peak resident memory less that before the step).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

import namedmesh as nm
from benchmarks import cli, fair
from benchmarks.memory import peak_bytes
from lowering import Mesh, lower
from models import catalog, transformer

LAYOUTS = {
    "one device": ({"one": 1}, ""),
    "2x4": ({"rows": 2, "cols": 4}, "length:rows;heads:cols;d_ff:cols;vocab:cols"),
}
SECTION = "## Long sequences: training-step memory, estimate vs XLA"
TORCH_SECTION = "## Long sequences: training-step time against PyTorch's SDPA"


def lm_batch(cfg, length: int, rows: int = 1) -> dict:
    """`rows` sequences of `length` random tokens (seed 0): the LM's inputs, their next
    tokens as targets, every weight 1."""
    tok = lm_tokens(cfg.vocab, length, rows)
    ones = np.ones((rows, length), np.float32)
    return {
        k: nm.tensor(v, ("batch", "length"))
        for k, v in (("inputs", tok[:, :-1]), ("targets", tok[:, 1:]), ("weights", ones))
    }


def lm_tokens(vocab: int, length: int, rows: int = 1) -> np.ndarray:
    """`lm_batch`'s tokens: `rows` of `length` + 1 random ids below `vocab` (seed 0)."""
    return np.random.default_rng(0).integers(0, vocab, (rows, length + 1)).astype(np.int32)


def row(name: str, length: int, attention: str, remat: str, layout: str, run: bool = False):
    """One measurement: (estimate bytes, XLA bytes, tokens/s or None)."""
    cfg = catalog.get(name, length=length, batch=1, attention=attention, remat=remat)
    cfg = cfg.replace(attention_block=min(512, length))
    sizes, rules = LAYOUTS[layout]
    params = transformer.init(transformer.lm_shapes(cfg), 0)
    batch = lm_batch(cfg, length)
    lowered = lower(lambda p, b: transformer.lm_loss(p, b, cfg), Mesh(sizes), rules)
    estimate = lowered.report(params, batch, wrt=0, show=False).peak_memory
    step = jax.jit(jax.value_and_grad(lambda p, b: lowered(p, b).data))
    compiled = step.lower(params, batch).compile()
    rate = None
    if run:  # CPU time, so the machine's other work does not count
        jax.block_until_ready(compiled(params, batch))
        start, n = time.process_time(), 3
        for _ in range(n):
            jax.block_until_ready(compiled(params, batch))
        rate = n * length / (time.process_time() - start)
    return estimate, peak_bytes(compiled), rate


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", type=cli.names, default=["tiny", "small"])
    p.add_argument("--lengths", type=cli.counts, default=[1024, 2048, 4096])
    p.add_argument("--layouts", type=cli.names, default=["one device", "2x4"])
    p.add_argument("--docs", default=None, help="append the table to this markdown file")
    p.add_argument("--goals", action="store_true", help="only the rows the goals need")
    p.add_argument(
        "--vs-torch",
        type=cli.counts,
        default=None,
        metavar="LENGTHS",
        help="time the training step against PyTorch's SDPA at these lengths",
    )
    p.add_argument("--rounds", type=cli.count, default=3, help="timed rounds of --vs-torch")
    p.add_argument("--kinds", type=lambda text: [k.strip() for k in text.split(";")],
                   default=list(KINDS), help="--vs-torch's kinds, ';' between (KINDS)")  # fmt: skip
    p.add_argument(
        "--memory",
        type=cli.counts,
        default=None,
        metavar="LENGTHS",
        help="peak memory of the training step at these lengths, namedmesh against PyTorch",
    )
    p.add_argument("--torch-peak", type=cli.count, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if unknown := sorted(set(args.kinds) - set(KINDS)):
        p.error(f"--kinds: unknown {unknown}; known: {'; '.join(KINDS)}")
    threads = fair.single_threaded()  # before jax's first computation
    if args.torch_peak:  # one step in this fresh process: its peak resident memory
        print(_torch_peak(args.torch_peak))
        return 0
    if args.vs_torch:
        return vs_torch(args.vs_torch, args, threads)
    if args.memory:
        return memory_vs_torch(args.memory, args)
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


def gpt2_sdpa(length: int, folder: str):
    """The small LM's shape as a transformers GPT-2 with SDPA attention, saved to `folder`."""
    import torch
    import transformers

    cfg = transformers.GPT2Config(
        n_embd=256, n_layer=4, n_head=4, n_inner=1024, vocab_size=256, n_positions=length,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.save_pretrained(folder)
    return model


# namedmesh's kinds timed against PyTorch: Config overrides; blockwise attention skips
# the key blocks the causal mask hides whole; the layers as Config.scan_layers's default
# ("auto": unrolled where the program is small, nm.scan's unroll="auto"), as one loop
# (True; on XLA:CPU the loop keeps XLA from fusing and scheduling across layers) or
# unrolled (False)
KINDS = {
    "full attention": {"attention": "full"},
    "blockwise": {"attention": "blockwise"},
    "blockwise + full remat": {"attention": "blockwise", "remat": "full"},
    "fused": {"attention": "fused"},  # nm.dot_product_attention: namedmesh.flash on CPU
    "fused, layer loop": {"attention": "fused", "scan_layers": True},
    "fused, unrolled": {"attention": "fused", "scan_layers": False},
}
# the fused kernel's unrolled 4 layers compile for minutes past this (518 s at 8k tokens:
# its row blocks are a Python loop), which the default's loop avoids
UNROLLED_UP_TO = 4096
# full attention's (length, memory) matrices stop fitting the development machine here
# (the fused kernel's row blocks are linear in length on CPU from 512 tokens)
FULL_UP_TO = 4096
QUADRATIC = ("full",)


def block_for(length: int) -> int:
    """The attention block of a length: 256 keys (the fastest single-threaded on CPU,
    the logits of a block pair staying in cache) up to 8k, then length / 32, so the
    number of query blocks (each one scan in the program) stays at most 32."""
    return min(length, max(256, length // 32))


def vs_torch(lengths: list[int], args, threads: str) -> int:
    """Rows of CPU seconds per training step (loss and gradients), namedmesh against PyTorch."""
    kinds = [k for k in KINDS if k in args.kinds]
    head = ["length", *[f"namedmesh {k} s (compile s) | ratio" for k in kinds],
            "PyTorch SDPA s", "loss agrees"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * (2 * len(kinds) + 3)]
    before = fair.load()
    for length in lengths:
        lines.append("| " + " | ".join(_torch_row(length, args.rounds, kinds)) + " |")
        print(lines[-1], flush=True)
    method = fair.METHOD.format(flags=fair.XLA_SINGLE_THREAD, rounds=args.rounds,
                                before=before, after=fair.load())  # fmt: skip
    text = "\n".join([TORCH_SECTION, "", f"{method} ({threads})", "", *lines])
    print(text)
    if args.docs:
        from benchmarks import report

        report.write_section(args.docs, TORCH_SECTION, text + "\n")
    return 0


def _torch_row(length: int, rounds: int, kinds: list[str]) -> list[str]:
    """One row's cells: each kind's seconds and ratio, PyTorch's seconds, the loss check."""
    import torch

    from models.io import hub

    folder = tempfile.mkdtemp()
    model = gpt2_sdpa(length, folder)
    zoo = hub.load(folder)
    batch = lm_batch(zoo.config, length)
    ids = torch.tensor(np.asarray(batch["inputs"].data), dtype=torch.long)
    targets = torch.tensor(np.asarray(batch["targets"].data), dtype=torch.long)

    def torch_step():
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss.detach())

    sides, losses, compiled = {}, {}, {}
    for kind in kinds:
        overrides = KINDS[kind]
        if overrides["attention"] in QUADRATIC and length > FULL_UP_TO:
            continue
        if overrides.get("scan_layers") is False and length > UNROLLED_UP_TO:
            continue
        cfg = zoo.config.replace(**overrides, attention_block=block_for(length))
        loss = lambda p, b, c=cfg: transformer.lm_loss(p, b, c).data
        start = time.process_time()  # trace, lower and compile: CPU seconds
        step = jax.jit(jax.value_and_grad(loss)).lower(zoo.params, batch).compile()
        compiled[kind] = time.process_time() - start
        losses[kind] = float(step(zoo.params, batch)[0])
        sides[kind] = lambda s=step: jax.block_until_ready(s(zoo.params, batch))
    sides["PyTorch SDPA"] = torch_step
    t = fair.alternate(sides, rounds)
    agree = all(abs(v - torch_step()) < 1e-4 for v in losses.values())
    cells = [str(length)]
    for kind in kinds:
        if kind not in t:
            up_to = FULL_UP_TO if KINDS[kind]["attention"] in QUADRATIC else UNROLLED_UP_TO
            cells += [f"not run (over {up_to} tokens)", "-"]
            continue
        cells += [f"{fair.cell(t[kind], 1)} (compile {compiled[kind]:.0f})",
                  fair.ratio(t[kind], t["PyTorch SDPA"])]  # fmt: skip
    return [*cells, fair.cell(t["PyTorch SDPA"], 1), str(agree)]


MEMORY_SECTION = "## Long sequences: training-step memory against PyTorch's SDPA"


def memory_vs_torch(lengths: list[int], args) -> int:
    """Rows of the training step's peak memory: namedmesh's from XLA's memory analysis of
    the compiled step (nothing run), PyTorch's measured in a fresh process."""
    head = ["length", *[f"namedmesh {k} MiB" for k in KINDS], "PyTorch SDPA MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * (len(KINDS) + 2)]
    from models.io import hub

    for length in lengths:
        folder = tempfile.mkdtemp()
        gpt2_sdpa(length, folder)
        zoo = hub.load(folder)
        batch = lm_batch(zoo.config, length)
        cells = [str(length)]
        for overrides in KINDS.values():
            cfg = zoo.config.replace(**overrides, attention_block=block_for(length))
            loss = lambda p, b, c=cfg: transformer.lm_loss(p, b, c).data
            compiled = jax.jit(jax.value_and_grad(loss)).lower(zoo.params, batch).compile()
            cells.append(f"{peak_bytes(compiled) / 2**20:.0f}")
        torch_bytes = subprocess.run(
            [sys.executable, "-m", "benchmarks.long_seq", "--torch-peak", str(length)],
            capture_output=True, text=True, check=True,
        ).stdout.split()[-1]  # fmt: skip
        cells.append(f"{int(torch_bytes) / 2**20:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    text = "\n".join([MEMORY_SECTION, "", *lines])
    print(text)
    if args.docs:
        from benchmarks import report

        report.write_section(args.docs, MEMORY_SECTION, text + "\n")
    return 0


def _torch_peak(length: int) -> int:
    """Bytes PyTorch's training step (loss and gradients) adds to this process's peak
    resident memory: the peak after one step less the resident memory before it (the
    model, its parameters and the batch already made)."""
    import resource

    import torch

    model = gpt2_sdpa(length, tempfile.mkdtemp())
    ids = torch.randint(0, 256, (1, length))
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * resource.getpagesize()
    logits = model(ids).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before


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
        for name in args.configs
        for length in args.lengths
        for attention in ("full", "blockwise")
        for remat in ("none", "full")
        for layout in args.layouts
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
    sys.exit(cli.run(main))
