"""`python -m benchmarks.run [--quick]`: the distributed benchmarks, written to
benchmarks/results/<date>.json and to docs/benchmarks.md.

Runs on 8 simulated CPU devices. So far: collective bytes per device per training step
of the two-layer MLP under data-parallel, Megatron, 2D and FSDP layouts, for
namedmesh, XLA's partitioner and a hand-written shard_map, beside the analytical
minimum (benchmarks/collectives.py); compile time vs depth and planner time
(benchmarks/scaling.py). The quality benchmark is `python -m benchmarks.quality`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

from benchmarks import report

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Collective bytes per training step"
SCALING = "## Compile time vs depth, and planner time"
FIELDS = (
    "bench", "case", "layout", "mesh", "metric", "namedmesh", "minimum", "gspmd", "hand",
    "ratio_to_min", "ratio_to_gspmd", "ratio_to_hand",
)  # fmt: skip
SIZES = {"quick": [(16, 32, 64)], "full": [(16, 32, 64), (64, 256, 1024), (256, 1024, 4096)]}


def machine() -> dict:
    import jax

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "devices": f"{jax.device_count()} x {jax.devices()[0].platform} (simulated)",
    }


def table(rows: list[dict]) -> str:
    fmt = lambda v: "—" if v is None else f"{v:.2f}" if isinstance(v, float) and v < 100 else (
        f"{v:,.0f}" if isinstance(v, float) else str(v)
    )  # fmt: skip
    head = ["case", "layout", "mesh", "namedmesh", "minimum", "GSPMD", "hand"]
    head += ["/min", "/GSPMD", "/hand"]
    numbers = ("namedmesh", "minimum", "gspmd", "hand", "ratio_to_min", "ratio_to_gspmd")
    cells = lambda r: (
        [r["case"], f"`{r['layout']}`", r["mesh"]]
        + [fmt(r[k]) for k in (*numbers, "ratio_to_hand")]
    )
    return report.md_table(head, [cells(r) for r in rows])


def write_docs(path: Path, rows: list[dict], command: str, info: dict) -> None:
    below_min = [r for r in rows if r["ratio_to_min"] is not None and r["ratio_to_min"] != 1.0]
    worse = [r for r in rows if r["ratio_to_gspmd"] is not None and r["ratio_to_gspmd"] > 1.0]
    goal = (
        "Goals: namedmesh / minimum = 1.00 in every row — "
        + ("**met**" if not below_min else f"**not met** in {len(below_min)} rows")
        + "; namedmesh ≤ GSPMD in every row — "
        + ("**met**." if not worse else f"**not met** in {len(worse)} rows.")
    )
    section = "\n".join(
        [
            SECTION,
            "",
            f"Made by `{command}` on {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
            "raw rows in `benchmarks/results/`.",
            "",
            "Machine: " + "; ".join(f"{k}: {v}" for k, v in info.items()) + ".",
            "",
            "Bytes one device sends per training step (forward, backward, gradient sync) of "
            "the MLP y = relu(x·w1)·w2, loss mean(y²), gradients of w1 and w2 (b = batch, "
            "d = d_model, h = d_ff, float32), read from the compiled HLO of `jax.grad` of "
            "each implementation and costed as ring collectives (all-reduce 2(n-1)/n·S, "
            "reduce-scatter and all-gather (n-1)/n of the full buffer). GSPMD is the same "
            "loss in jax.numpy under `jit` with the inputs' NamedShardings and sharding "
            "constraints on the hidden and output activations, each value sharded as the "
            "namedmesh layout lays it out; hand is Megatron's MLP as a `jax.shard_map` "
            "(one psum of the output, weight gradients psummed over the batch axis). The "
            "minimum is the Mesh-TensorFlow paper's analysis: data parallelism all-reduces "
            "the weight gradients, splitting d_ff all-reduces the output once per forward "
            "pass, FSDP all-gathers the weights and reduce-scatters their gradients. Every "
            "run also checks that the three implementations' gradients agree.",
            "",
            table(rows),
            "",
            goal,
            "",
        ]
    )
    report.write_section(path, SECTION, section)


def write_scaling_docs(path: Path, rows: list[dict], command: str, plot: Path | None) -> None:
    compile_rows = [r for r in rows if r["bench"] == "compile_time"]
    planner = [r for r in rows if r["bench"] == "planner_time"]
    lines = [
        SCALING,
        "",
        f"Made by `{command}` (the run and machine of the collective-bytes section). "
        "Compile time is "
        "`jit(grad(lowered LM loss)).lower(...).compile()` of the tiny LM on the 2x4 mesh "
        "under `batch:rows;heads:cols;d_ff:cols;vocab:cols`; the planner time is trace + "
        "plan + report of the base LM (d_model 512) with 24 layers on an abstract 2x4 mesh, "
        "median of 3. Goals: compile time flat in depth (the layers are one `nm.scan`); "
        "planner under 1 second.",
        "",
        "| case | seconds |",
        "|---|---|",
        *(f"| {r['case']} | {r['namedmesh']:.2f} |" for r in compile_rows + planner),
        "",
    ]
    if compile_rows:
        t = [r["namedmesh"] for r in compile_rows]
        looped = t[1:] if len(t) > 2 else t  # a 1-layer scan is compiled without a loop
        spread = max(looped) / min(looped)
        lines.append(
            f"From {compile_rows[1 if len(t) > 2 else 0]['case'].split(', ')[1]} to "
            f"{compile_rows[-1]['case'].split(', ')[1]} the compile time stays within "
            f"x{spread:.2f} of itself — "
            + ("**flat**" if spread <= 1.5 else "**not flat**")
            + ". One layer compiles faster ("
            + f"{t[0]:.2f} s): XLA drops a loop of one "
            "trip, so there is no while loop to compile."
        )
    if planner:
        sec = planner[0]["namedmesh"]
        lines.append(f"Planner: {sec:.2f} s — " + ("**met**." if sec < 1 else "**not met**."))
    if plot is not None:
        lines += ["", f"![compile time vs depth](img/{plot.name})"]
    report.write_section(path, SCALING, "\n".join(lines) + "\n")


def plot_compile(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(int(r["case"].split(", ")[1].split()[0]), r["namedmesh"]) for r in rows
           if r["bench"] == "compile_time"]  # fmt: skip
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("layers")
    ax.set_ylabel("compile seconds")
    ax.set_title("training step compile time vs depth")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the smallest case only")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"), help="'' to skip")
    args = p.parse_args(argv)
    if "jax" not in sys.modules:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    from tqdm import tqdm

    from benchmarks import collectives, scaling

    sizes = SIZES["quick" if args.quick else "full"]
    rows = []
    for b, d, h in tqdm(sizes, desc="collective bytes", unit="size"):
        rows += collectives.rows(b, d, h)
    bytes_rows = list(rows)
    print("compile time vs depth, planner time ...", flush=True)
    rows += scaling.rows(depths=(1, 4) if args.quick else (1, 2, 4, 8, 16, 32))
    info = machine()
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{datetime.date.today().isoformat()}{'-quick' if args.quick else ''}.json"
    (out / name).write_text(json.dumps({"machine": info, "rows": rows}, indent=1) + "\n")
    print(table(bytes_rows))
    print(f"wrote {out / name}")
    if args.docs:
        command = "python -m benchmarks.run" + (" --quick" if args.quick else "")
        docs = Path(args.docs)
        write_docs(docs, bytes_rows, command, info)
        plot = None if args.quick else docs.parent / "img" / "compile_vs_depth.png"
        if plot is not None:
            plot_compile(rows, plot)
        write_scaling_docs(docs, rows, command, plot)
        print(f"wrote {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
