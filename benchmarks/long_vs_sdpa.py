"""The long-context training step (loss and gradients of one sequence, no optimizer:
benchmarks/long_seq.py's GPT-2 shape with PyTorch's SDPA attention) against PyTorch,
with the zoo's default settings only (whatever `Config` defaults to: its attention
kernel, layer loop and remat), compile time included, and memory measured the same
way on both sides (benchmarks/rss.py: the first step's peak resident memory above the
resident memory before it, each side in a fresh process of its own: namedmesh's in the
timing process, before any PyTorch step runs, after its compile; PyTorch's in a process
that builds the model and runs nothing else).

Each length runs in its own process (`python -m benchmarks.long_vs_sdpa --child LENGTH`)
under a time limit, so a length whose compile outlasts it is reported, not waited for.

`python -m benchmarks.long_vs_sdpa --lengths 2048,8192 [--rounds 3] [--limit 540]
[--set attention=full]`: the table of benchmarks.honest's long-context rows alone;
`--set FIELD=VALUE` (repeatable, Config's fields as `namedmesh train --set` takes them)
times a setting other than the defaults, named in the settings column."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

from benchmarks import cli, fair, long_seq, peak, rss, stack
from benchmarks.memory import peak_bytes


def measure(length: int, rounds: int, overrides: tuple[str, ...] = ()) -> dict:
    """In this (fresh) process: compile namedmesh's step (timed), its first step's memory
    (the process's one measurement: PyTorch's is `torch_step_bytes`'s, in another), the
    losses checked equal, then both sides alternated; `overrides` (`FIELD=VALUE` texts)
    change the config's defaults."""
    import jax
    import torch

    from models import transformer
    from models.io import hub
    from models.layers.common import attention_settings

    folder = tempfile.mkdtemp()
    model = long_seq.gpt2_sdpa(length, folder)
    zoo = hub.load(folder)
    from models import architecture

    cfg = zoo.config.replace(**architecture.parse_overrides(list(overrides)))
    batch = long_seq.lm_batch(cfg, length)
    ids = torch.tensor(jax.device_get(batch["inputs"].data), dtype=torch.long)
    targets = torch.tensor(jax.device_get(batch["targets"].data), dtype=torch.long)
    loss = lambda p, b: transformer.lm_loss(p, b, cfg).data
    start, cpu = time.perf_counter(), time.process_time()
    compiled = jax.jit(jax.value_and_grad(loss)).lower(zoo.params, batch).compile()
    # wall clock, and the CPU seconds the work took (a loaded machine stretches the former)
    compile_s, compile_cpu = time.perf_counter() - start, time.process_time() - cpu
    fits(peak_bytes(compiled), length)
    ours = lambda: jax.block_until_ready(compiled(zoo.params, batch))

    def theirs():
        logits = model(ids).logits
        value = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        value.backward()
        model.zero_grad(set_to_none=True)
        return float(value.detach())

    memory = {"namedmesh": rss.step_bytes(ours, f"namedmesh's {length}-token step")}
    our_loss, their_loss = float(ours()[0]), theirs()
    if abs(our_loss - their_loss) > 1e-4 * max(1.0, abs(their_loss)):
        raise SystemExit(f"{length} tokens: loss {our_loss} differs from PyTorch's {their_loss}")
    times = fair.alternate({"namedmesh": ours, "PyTorch SDPA": theirs}, rounds)
    settings = (
        f"{attention_settings(cfg, length, batch=1)}, "
        # "auto" (the default) is truthy: name it, not the loop
        + {True: "layer loop", False: "unrolled"}.get(cfg.scan_layers, f"layers {cfg.scan_layers}")
        + f", remat {cfg.remat}"
    )
    flops = peak.step_flops(peak.shape_of(model.config), 1, length)
    return {
        "times": times,
        "compile": compile_s,
        "compile_cpu": compile_cpu,
        "memory": memory,
        "flops": flops,
        "settings": settings,
        "losses": [our_loss, their_loss],
    }


def torch_step_bytes(length: int) -> int:
    """PyTorch's first step's memory (benchmarks/rss.py), run in a fresh process by
    `rss.fresh`: `measure`'s model and tokens, built and nothing else run before."""
    import torch

    model = long_seq.gpt2_sdpa(length, tempfile.mkdtemp())
    tokens = torch.tensor(long_seq.lm_tokens(model.config.vocab_size, length), dtype=torch.long)
    ids, targets = tokens[:, :-1], tokens[:, 1:]

    def step():
        logits = model(ids).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        model.zero_grad(set_to_none=True)

    return rss.step_bytes(step, f"PyTorch's {length}-token step")


def fits(needs: int, length: int) -> None:
    """Refuse to run a step whose compiled peak (XLA's memory analysis) is over 80% of
    the memory the machine has available now: on a shared machine the kernel's
    out-of-memory killer would pick a process, maybe another's."""
    with open("/proc/meminfo") as f:
        avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    if needs > 0.8 * avail:
        raise SystemExit(
            f"{length} tokens: the compiled step needs {needs / 2**20:.0f} MiB (XLA's "
            f"memory analysis), over 80% of the {avail / 2**20:.0f} MiB available"
        )


def run_child(length: int, rounds: int, limit_s: float, overrides: tuple[str, ...] = ()) -> dict:
    """`measure(length, rounds, overrides)` in a fresh process, then PyTorch's memory
    (`torch_step_bytes`) in another; {"failed": why} where the first does not finish
    within `limit_s` seconds or fails."""
    argv = [sys.executable, "-m", "benchmarks.long_vs_sdpa", "--child", str(length)]
    argv += ["--rounds", str(rounds), *(f"--set={o}" for o in overrides)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit_s,
                              env=rss.checkout_env())  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"failed": f"not done within {limit_s:.0f} s (compile and {rounds} rounds)"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"failed": f"exit status {done.returncode}: {last[:160]}"}
    r = json.loads(done.stdout.strip().splitlines()[-1])
    try:  # PyTorch's memory alone: after namedmesh's step it would reuse XLA's late frees
        r["memory"]["PyTorch SDPA"] = rss.fresh(
            "benchmarks.long_vs_sdpa:torch_step_bytes", [length], limit_s
        )
    except rss.MeasurementError as e:
        r["memory"]["PyTorch SDPA"] = None
        r["memory_failed"] = str(e)[:160]
    return r


def compile_cell(r: dict) -> str:
    """Wall-clock seconds of the compile, and its CPU seconds where measured."""
    cpu = f" (CPU {r['compile_cpu']:.1f})" if "compile_cpu" in r else ""
    return f"{r['compile']:.1f}{cpu}"


def table(rows: dict[int, dict], peak_gflops: float) -> list[str]:
    """Markdown lines, a row per length."""
    head = [
        "length",
        "namedmesh settings (defaults)",
        "namedmesh s",
        "PyTorch SDPA s",
        "namedmesh / PyTorch",
        "compile s",
        "namedmesh MiB",
        "PyTorch MiB",
        "matmul GFLOP",
        "namedmesh % of peak",
        "PyTorch % of peak",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for length, r in rows.items():
        if "failed" in r:
            lines.append(f"| {length} | not run: {r['failed']} |" + " — |" * (len(head) - 2))
            continue
        ours, theirs = r["times"]["namedmesh"], r["times"]["PyTorch SDPA"]
        pct = lambda ts, r=r: f"{100 * peak.fraction(r['flops'], min(ts), peak_gflops):.0f}%"
        mib = lambda side, r=r: (
            f"{r['memory'][side] / 2**20:.0f}"
            if r["memory"].get(side) is not None
            else f"not measured: {r.get('memory_failed', '?')}"
        )
        cells = [
            str(length),
            r["settings"],
            fair.cell(ours, 1),
            fair.cell(theirs, 1),
            fair.ratio(ours, theirs),
            compile_cell(r),
            mib("namedmesh"),
            mib("PyTorch SDPA"),
            f"{r['flops'] / 1e9:.1f}",
            pct(ours),
            pct(theirs),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=cli.counts, default=[2048, 8192])
    p.add_argument("--rounds", type=cli.count, default=3, help="timed rounds per length")
    p.add_argument("--limit", type=cli.count, default=540, help="seconds one length may take")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a Config field other than its default (repeatable)")  # fmt: skip
    p.add_argument("--child", type=cli.count, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    threads = fair.single_threaded()  # before jax's first computation and torch's import
    if args.child:  # one length, in this fresh process
        print(json.dumps(measure(args.child, args.rounds, tuple(args.set))))
        return 0
    before = fair.load()
    rows = {n: run_child(n, args.rounds, args.limit, tuple(args.set)) for n in args.lengths}
    peak_gflops = peak.matmul_peak()["peak"]
    method = fair.METHOD.format(flags=fair.XLA_SINGLE_THREAD, rounds=args.rounds,
                                before=before, after=fair.load())  # fmt: skip
    print("\n".join([f"{method} ({threads})", "", stack.describe(), "", *table(rows, peak_gflops)]))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
