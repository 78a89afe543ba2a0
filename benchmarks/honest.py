"""`python -m benchmarks.honest --out docs/benchmarks.md`: every comparison with
PyTorch that issue 40 asks for, by one method, in one run, written as one section of
the page (replaced on a rerun):

- the machine's single-thread fp32 matmul peak (benchmarks/peak.py), measured first;
- the training step (forward, backward, AdamW) of Llama, Qwen3, Gemma 2 and Mixtral at
  the small and the realistic size against transformers' eager PyTorch, with compile
  time, each side's fraction of the peak and each side's memory, measured in a process
  of its own (benchmarks/train_vs_torch.py);
- the 2k- and 8k-token step against SDPA with the zoo's default settings, compile time
  and memory measured the same way on both sides (benchmarks/long_vs_sdpa.py);
- the MoE experts' FFN against transformers' default experts implementation
  (benchmarks/experts_vs_hf.py).

Each table's header names the CPU, both sides' math libraries, the date and the load
(benchmarks/stack.py). Progress goes to stdout as it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks import cli, fair

SECTION = "## PyTorch comparisons, one method (issue 40): training, long context, MoE"
COMMAND = "python -m benchmarks.honest --out docs/benchmarks.md"
EXPERT_SIZES = {  # (tokens, d_model, d_ff): the training table's Mixtral layers
    "small: 512 tokens, d_model 256, d_ff 512": (512, 256, 512),
    "realistic: 2048 tokens, d_model 512, d_ff 1024": (2048, 512, 1024),
}


def parse(argv):
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__)
    p.add_argument("--out", default=None, help="write the section into this markdown file")
    p.add_argument("--sizes", type=cli.names, default=["small", "realistic"])
    p.add_argument(
        "--families",
        type=cli.names,
        default=None,
        help="of llama,qwen3,gemma2,mixtral (all by default)",
    )
    p.add_argument("--rounds", type=cli.count, default=5, help="timed rounds per table")
    p.add_argument("--lengths", type=cli.counts, default=[2048, 8192], help="long-context lengths")
    p.add_argument(
        "--long-limit",
        type=cli.count,
        default=540,
        help="seconds one long-context length may take (compile included)",
    )
    p.add_argument("--long-child", type=cli.count, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from benchmarks.train_vs_torch import FAMILIES, SIZES

    if bad := sorted(set(args.sizes) - set(SIZES)):
        p.error(f"--sizes: unknown {bad}; known: {', '.join(SIZES)}")
    if args.families and (bad := sorted(set(args.families) - set(FAMILIES))):
        p.error(f"--families: unknown {bad}; known: {', '.join(FAMILIES)}")
    args.families = args.families or list(FAMILIES)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    threads = fair.single_threaded()  # before jax's first computation and torch's import
    if args.long_child:  # one long-context length, in this fresh process
        from benchmarks import long_vs_sdpa

        print(json.dumps(long_vs_sdpa.measure(args.long_child, args.rounds)))
        return 0
    text = "\n".join(sections(args, args.families, threads))
    print(text)
    if args.out:
        from benchmarks import report

        report.write_section(args.out, SECTION, text + "\n")
    return 0


def progress(what: str, started: float) -> None:
    print(f"[{time.monotonic() - started:6.0f} s, load {fair.load()}] {what}", flush=True)


def sections(args, families: list[str], threads: str) -> list[str]:
    """The section's markdown lines, each table measured in turn."""
    from benchmarks import experts_vs_hf, long_vs_sdpa, peak, rss, stack, train_vs_torch

    started, before = time.monotonic(), fair.load()
    progress("the matmul peak", started)
    peaks = peak.matmul_peak()
    best = max(("PyTorch", "XLA"), key=peaks.get)
    lines = [
        SECTION,
        "",
        "```sh",
        COMMAND,
        "```",
        "",
        f"Single-thread fp32 {peak.PEAK_SIZE}^3 matmul: PyTorch {peaks['PyTorch']:.0f} "
        f"GFLOP/s, XLA {peaks['XLA']:.0f} GFLOP/s; the peak below is {best}'s "
        f"({peaks['peak']:.0f} GFLOP/s). {stack.describe()}",
        "",
    ]
    for name in args.sizes:
        size, rows = train_vs_torch.SIZES[name], {}
        for family in families:
            progress(f"training step, {name}, {family}", started)
            rows[family] = train_vs_torch.row(family, size, args.rounds, peaks["peak"])
            rss.release()  # the next row, and the long-context processes, need the memory
        lines += [
            f"### Training step, {size}",
            "",
            stack.describe(),
            "",
            *train_vs_torch.table(rows),
            "",
        ]
    long_rows = {}
    for length in args.lengths:
        progress(f"long context, {length} tokens (a fresh process)", started)
        long_rows[length] = long_vs_sdpa.run_child(length, min(args.rounds, 3), args.long_limit)
    lines += [
        "### Long context: the step of one sequence against SDPA, default settings",
        "",
        stack.describe(),
        "",
        *long_vs_sdpa.table(long_rows, peaks["peak"]),
        "",
    ]
    progress("MoE experts against transformers' experts", started)
    expert_rows, default = experts_vs_hf.rows(EXPERT_SIZES, args.rounds)
    lines += [
        f"### MoE experts' FFN against transformers' default ({default})",
        "",
        stack.describe(),
        "",
        *fair.table(expert_rows, "size (8 experts, top 2)"),
        "",
    ]
    progress("done", started)
    return lines[:6] + intro(threads, args.rounds, before) + lines[6:]


def intro(threads: str, rounds: int, before: str) -> list[str]:
    return [
        fair.METHOD.format(
            flags=fair.XLA_SINGLE_THREAD, rounds=rounds, before=before, after=fair.load()
        )
        + f" ({threads})",
        "",
        "Every pair is checked equal before it is timed (first losses to 1e-4, or outputs). "
        "Compile s: namedmesh's lower and compile of the step, wall clock (PyTorch eager "
        "compiles nothing). % of peak: the step's matmul flops (counted from the config by "
        "benchmarks/peak.py: projections, attention over every query-key pair, FFN with "
        "each token's active experts, router, output layer; backward twice the forward) over "
        "the side's min time, against the peak below (a kernel that skips the causally masked "
        "half of attention, as PyTorch's SDPA can on CPU, does fewer flops than counted, so "
        "its fraction reads high where attention is much of the work: the long context). "
        "Long context: 3 rounds at most. "
        "Memory (MiB): a step's peak resident memory (VmHWM) above the resident memory "
        "just before it, after glibc's free pages are returned (benchmarks/rss.py), each "
        "side in a fresh process of its own (measured after another step in one process, "
        "a step reuses memory the other frees late and reads low): namedmesh's first step "
        "after its compile; PyTorch's first long-context step, and its second training "
        "step (AdamW makes its state at the first; namedmesh's is made before), with "
        "nothing else run before.",
        "",
    ]


if __name__ == "__main__":
    sys.exit(cli.run(main))
