"""Quality of the `tiny` LM on the default corpus under each layout, and its tokens/s.

Run it as

    .venv/bin/python -m benchmarks.quality [--steps N] [--quick] [--out docs/benchmarks.md]

The goal (from the project's issue): the `tiny` LM on the default corpus (CPython's
documentation text, byte tokenizer) reaches validation <= 2.5 bits/byte within 10 minutes
on 2 CPU cores.

Method: one invocation trains `tiny` once per layout, one after another, each in its own
`python -m models.cli.train ... --quiet` subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (so every run sees the same 8
simulated CPU devices and the same XLA thread setup) and `--out` in a temporary folder.
Every run has the same seed, data, steps and learning-rate schedule, so up to floating-point
reassociation the curves should coincide; the page reports how far they differ from the
one-device run.

While a run trains, this process polls its `metrics.jsonl` and timestamps each record as it
appears, so "seconds to 2.5 bits/byte" is wall-clock time from starting the subprocess
(Python and JAX start-up, tracing, compiling, training, evaluating and checkpointing
included) to the first validation record at or under 2.5 bits/byte. Tokens/s is the median
of the CLI's per-step `tokens_per_s` over the steps after the first 20 (compilation).
The ratio column divides by the one-device run's median of the same invocation.

With `--out PATH` the results replace the section headed
`## Quality: tiny LM on the default corpus` in PATH (other sections are kept; PATH is
created when missing) and the curves are drawn to `img/quality_curves.png` next to PATH
(or to `--plot`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import cli, report

SECTION = "## Quality: tiny LM on the default corpus"
GOAL_BPB = 2.5  # validation bits/byte, at most
GOAL_SECONDS = 600.0  # within 10 minutes
DEVICES = 8  # simulated CPU devices offered to every run
COMPILE_STEPS = 20  # per-step throughput of the first steps is left out
POLL_S = 0.2


@dataclass(frozen=True)
class Layout:
    name: str
    mesh: str
    rules: str
    flags: tuple[str, ...] = ()  # more flags of models.cli.train (a compute dtype)


LAYOUTS = [
    Layout("one device", "one=1", ""),
    Layout("data-parallel", "data=8", "batch:data"),
    Layout("model-parallel", "model=4", "heads:model;d_ff:model;vocab:model"),
    Layout("2D", "rows=2,cols=4", "batch:rows;heads:cols;d_ff:cols;vocab:cols"),
    Layout("FSDP-style", "data=4", "batch:data;d_model:data"),
    Layout("sequence-style", "rows=2,cols=2", "batch:rows;d_model:cols"),
    Layout("one device, bfloat16", "one=1", "", ("--dtype", "bfloat16")),
]
BF16_GOAL_BPB = 0.05  # the bf16 run's final bits/byte within this of the float32 run's
QUICK_LAYOUTS = ("one device", "2D")


@dataclass
class Run:
    layout: Layout
    steps: int
    records: list[dict] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # seconds from start, per record
    wall_s: float = 0.0
    returncode: int = 0
    log: str = ""
    load: list[float] = field(default_factory=list)  # 1-minute load average samples

    @property
    def evals(self) -> list[tuple[int, float, float, float]]:
        """(step, wall second, val bits/byte, val nats/token) of each validation record."""
        return [
            (r["step"], t, r["val_bits_per_byte"], r["val_loss"])
            for r, t in zip(self.records, self.times, strict=True)
            if "val_bits_per_byte" in r
        ]

    @property
    def tokens_per_s(self) -> float:
        xs = [r["tokens_per_s"] for r in self.records if r["step"] > COMPILE_STEPS]
        return statistics.median(xs) if xs else math.nan

    @property
    def reached(self) -> tuple[int, float] | None:
        """(step, wall second) of the first validation at or under the goal."""
        return next(((s, t) for s, t, b, _ in self.evals if b <= GOAL_BPB), None)

    @property
    def final_bpb(self) -> float:
        return self.evals[-1][2] if self.evals else math.nan

    @property
    def final_val(self) -> float:
        return self.evals[-1][3] if self.evals else math.nan


# --- running ------------------------------------------------------------------------------


def train_command(layout: Layout, steps: int, eval_every: int, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "models.cli.train", "--config", "tiny", "--mesh", layout.mesh,
        "--layout", layout.rules, "--steps", str(steps), "--eval-every", str(eval_every),
        "--out", str(out), "--quiet", *layout.flags,
    ]  # fmt: skip


def _new_records(path: Path, offset: int) -> tuple[list[dict], int]:
    """Complete JSON lines of `path` after byte `offset`, and the offset after them."""
    if not path.exists():
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    end = chunk.rfind(b"\n") + 1
    lines = chunk[:end].decode().splitlines()
    return [json.loads(ln) for ln in lines if ln.strip()], offset + end


def run_layout(layout: Layout, steps: int, eval_every: int, tmp: Path, bar) -> Run:
    out = tmp / layout.name.replace(" ", "-")
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}"}
    run = Run(layout, steps)
    log_path = tmp / f"{out.name}.log"
    metrics, offset = out / "metrics.jsonl", 0
    bar.set_description(f"{layout.name:>14}")
    bar.set_postfix(step=0, val_bpb="-")
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            train_command(layout, steps, eval_every, out),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        while True:
            done = proc.poll() is not None
            now = time.perf_counter() - t0
            recs, offset = _new_records(metrics, offset)
            for r in recs:
                run.records.append(r)
                run.times.append(now)
                if "val_bits_per_byte" in r:
                    bar.set_postfix(step=r["step"], val_bpb=f"{r['val_bits_per_byte']:.3f}")
            bar.update(len(recs))
            if len(run.times) // 100 > len(run.load):  # a sample per ~100 steps
                run.load.append(os.getloadavg()[0])
            if done:
                break
            time.sleep(POLL_S)
        run.wall_s = time.perf_counter() - t0
    run.returncode = proc.returncode
    run.log = log_path.read_text(errors="replace")
    bar.update(steps - len(run.records))  # a failed run: keep the bar's total honest
    if run.returncode != 0 or len(run.records) != steps:
        tail = "\n".join(run.log.splitlines()[-15:])
        bar.write(f"{layout.name}: exit status {run.returncode}, {len(run.records)} steps\n{tail}")
    else:
        hit = run.reached
        bar.write(
            f"{layout.name:>14} ({layout.mesh}; {layout.rules or 'replicated'}): "
            f"{run.wall_s:.1f} s, {run.tokens_per_s:,.0f} tokens/s, final "
            f"{run.final_bpb:.4f} bits/byte, <= {GOAL_BPB} at "
            + (f"step {hit[0]} ({hit[1]:.1f} s)" if hit else "never")
        )
    return run


# --- reporting ----------------------------------------------------------------------------


def command(argv: list[str]) -> str:
    return report.command("benchmarks.quality", argv)


def _ok(run: Run) -> bool:
    return run.returncode == 0 and len(run.records) == run.steps


def table(runs: list[Run]) -> str:
    base = runs[0]
    header = ["layout", "mesh", "rules", "steps", "train s", "load avg", "tokens/s (median)",
              "tokens/s ÷ one device", "step to ≤ 2.5", "seconds to ≤ 2.5",
              "final bits/byte", "final val Δ vs one device (nats/token)"]  # fmt: skip
    rows = []
    for r in runs:
        if not _ok(r):
            rows.append([r.layout.name, f"`{r.layout.mesh}`", f"`{r.layout.rules}`",
                         f"failed (exit {r.returncode}, {len(r.records)} steps)"]
                        + [""] * (len(header) - 4))  # fmt: skip
            continue
        hit = r.reached
        rows.append([
            r.layout.name,
            f"`{r.layout.mesh}`",
            f"`{r.layout.rules}`" if r.layout.rules else "(none)",
            str(r.steps),
            f"{r.wall_s:.1f}",
            f"{statistics.mean(r.load):.1f}" if r.load else "n/a",
            f"{r.tokens_per_s:,.0f}",
            f"{r.tokens_per_s / base.tokens_per_s:.2f}" if _ok(base) else "n/a",
            str(hit[0]) if hit else "not reached",
            f"{hit[1]:.1f}" if hit else "—",
            f"{r.final_bpb:.4f}",
            f"{r.final_val - base.final_val:+.2e}" if _ok(base) else "n/a",
        ])  # fmt: skip
    return report.md_table(header, rows)


def agreement(runs: list[Run]) -> tuple[float, float]:
    """Max |final val loss - one device's| and max |val bits/byte - one device's| over
    every evaluation step, across layouts (nan when nothing to compare)."""
    base, others = runs[0], [r for r in runs[1:] if _ok(r) and not r.layout.flags]
    if not _ok(base) or not others:
        return math.nan, math.nan
    final = max(abs(r.final_val - base.final_val) for r in others)
    curve = max(
        abs(b - b0)
        for r in others
        for (_, _, b, _), (_, _, b0, _) in zip(r.evals, base.evals, strict=True)
    )
    return final, curve


def precision_sentence(runs: list[Run]) -> str:
    """The bfloat16 run's final bits/byte against the float32 one-device run's."""
    base, bf16 = runs[0], [r for r in runs if "bfloat16" in r.layout.flags and _ok(r)]
    if not _ok(base) or not bf16:
        return "bfloat16: not run."
    gap = bf16[0].final_bpb - base.final_bpb
    met = "met" if abs(gap) <= BF16_GOAL_BPB else "not met"
    return (f"bfloat16 compute dtype: final bits/byte {bf16[0].final_bpb:.4f}, {gap:+.4f} from "
            f"float32 (goal: within {BF16_GOAL_BPB}): **{met}**.")  # fmt: skip


def goal_sentence(runs: list[Run]) -> str:
    met = [r for r in runs if _ok(r) and r.reached and r.reached[1] <= GOAL_SECONDS]
    missed = [r.layout.name for r in runs if r not in met]
    goal = (
        f"validation ≤ {GOAL_BPB} bits/byte within {GOAL_SECONDS / 60:g} minutes on "
        f"{os.cpu_count()} CPU cores"
    )
    if not met:
        return f"Goal ({goal}): **not met** under any layout."
    names = ", ".join(f"{r.layout.name} ({r.reached[1]:.0f} s)" for r in met)
    tail = f"; not under {', '.join(missed)}." if missed else ", that is, under every layout."
    return f"Goal ({goal}): **met** under {names}{tail}"


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = ["-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1))]
    for i, r in enumerate(runs):
        ev = r.evals
        if not ev:
            continue
        ax.plot([e[0] for e in ev], [e[2] for e in ev], linestyle=styles[i % len(styles)],
                marker="o", ms=3, lw=1.4, label=f"{r.layout.name} ({r.layout.mesh})")  # fmt: skip
    ax.axhline(GOAL_BPB, color="red", lw=1, alpha=0.7, label=f"goal ({GOAL_BPB} bits/byte)")
    ax.set_xlabel("step")
    ax.set_ylabel("validation bits/byte")
    ax.set_title("tiny LM, default corpus: validation bits/byte per layout")
    ax.set_ylim(top=min(ax.get_ylim()[1], 5.0))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section(runs, argv, when, info, steps, eval_every, plot_link) -> str:
    final_d, curve_d = agreement(runs)
    base = runs[0]
    evals = sorted({s for r in runs for s, *_ in r.evals})
    curves = report.md_table(
        ["step", *[r.layout.name for r in runs]],
        [
            [str(s)] + [next((f"{b:.4f}" for t, _, b, _ in r.evals if t == s), "") for r in runs]
            for s in evals
        ],
    )
    example = shlex.join(train_command(base.layout, steps, eval_every, Path("OUT"))[1:])
    parts = [
        *report.heading(SECTION, f"Made by `{command(argv)}` on {when}.", info),
        f"Method: one invocation trains the `tiny` LM (byte tokenizer, the default corpus: "
        f"CPython's documentation text) for {steps} steps under each layout, one after "
        f"another, each in its own `python -m models.cli.train` subprocess "
        f"(`XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES}`, `--out` in a "
        f"temporary folder, e.g. `python {example}` for the first row), with the CLI's "
        f"defaults otherwise (AdamW, lr 3e-3, warmup 50 then cosine over the {steps} steps, "
        f"seed 0, checkpoints every 100 steps, validation on the first "
        f"`--eval-batches 8` batches of the validation split every {eval_every} steps). "
        f"Train s is the subprocess's wall clock (start-up, compilation, evaluation and "
        f"checkpoints included); seconds to ≤ 2.5 is the wall clock from starting the "
        f"subprocess until the first validation record at or under {GOAL_BPB} bits/byte "
        f"appeared in its metrics.jsonl. Tokens/s is the median of the per-step "
        f"`tokens_per_s` after step {COMPILE_STEPS}; the ratio is to the one-device run of "
        f"the same invocation (the runs are sequential, so machine noise still differs "
        f"between rows). Load avg is the mean 1-minute load average sampled during the run "
        f"(other work on the machine shows up there: with {os.cpu_count()} cores, anything "
        f"above about 1 means the run shared its CPUs).",
        "",
        table(runs),
        "",
        f"Every float32 layout trains on the same seed, batches and schedule, so the curves should "
        f"coincide: the largest difference of the final validation loss from the one-device "
        f"run is {final_d:.2e} nats/token, and of any validation point {curve_d:.2e} "
        f"bits/byte.",
        "",
        f"![validation bits/byte per step, one line per layout]({plot_link})",
        "",
        "Validation bits/byte at each evaluation:",
        "",
        curves,
        "",
        goal_sentence(runs),
        "",
        precision_sentence(runs),
        "",
    ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=cli.count, default=None, help="steps per run (4000; quick 300)")
    p.add_argument("--eval-every", type=cli.count, default=None, help="(250; quick 50)")
    p.add_argument("--quick", action="store_true", help="~300 steps, two layouts (a smoke run)")
    p.add_argument("--layout", action="append", default=None, metavar="NAME",
                   help="run only the layout NAME (repeatable; the names of LAYOUTS)")  # fmt: skip
    p.add_argument("--out", type=Path, help="markdown file whose quality section to replace")
    p.add_argument("--plot", type=Path, help="the curves' PNG (default: img/ next to --out)")
    args = p.parse_args(argv)
    steps = args.steps or (300 if args.quick else 4000)
    eval_every = args.eval_every or (50 if args.quick else 250)
    layouts = [lt for lt in LAYOUTS if not args.quick or lt.name in QUICK_LAYOUTS]
    if args.layout:
        if unknown := set(args.layout) - {lt.name for lt in LAYOUTS}:
            p.error(f"--layout: no layout named {sorted(unknown)}; the layouts: "
                    f"{[lt.name for lt in LAYOUTS]}")  # fmt: skip
        layouts = [lt for lt in layouts if lt.name in args.layout]
    plot_path = args.plot or (args.out.parent / "img" / "quality_curves.png" if args.out else None)

    from tqdm import tqdm

    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    info = report.machine()
    print(f"{command(argv)}  ({when})")
    for k, v in info.items():
        print(f"  {k}: {v}")
    print(f"{len(layouts)} layouts x {steps} steps, validation every {eval_every}", flush=True)

    with tempfile.TemporaryDirectory(prefix="quality-") as tmp:
        bar = tqdm(total=steps * len(layouts), unit="step", dynamic_ncols=True, mininterval=1.0)
        runs = [run_layout(lt, steps, eval_every, Path(tmp), bar) for lt in layouts]
        bar.close()

    if plot_path is not None:
        plot(runs, plot_path)
        print(f"wrote {plot_path}")
    link = (
        os.path.relpath(plot_path, args.out.parent)
        if plot_path and args.out
        else str(plot_path or "")
    )
    text = section(runs, argv, when, info, steps, eval_every, link)
    print()
    print(text)
    if args.out is not None:
        report.write_section(args.out, SECTION, text)
        print(f"wrote section {SECTION!r} to {args.out}")
    return 0 if all(_ok(r) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(cli.run(main))
