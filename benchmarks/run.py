"""`python -m benchmarks.run [--quick]`: the distributed benchmarks, written to
benchmarks/results/<date>.json and to docs/benchmarks.md (`--quick`: to
benchmarks/results/<date>-quick.json and .md, never the published page).

Runs on 8 simulated CPU devices: collective bytes per device per training step of an
MLP, multi-head attention, a Transformer layer and a MoE layer under data-parallel,
Megatron, 2D, FSDP, sequence-parallel, expert-parallel and 2x2x2 layouts, for namedmesh,
XLA's partitioner and a hand-written shard_map, beside the analytical minimum, with
step times and the cost model's bytes (benchmarks/collectives.py); compile time vs
depth and planner time (benchmarks/scaling.py); the paper's LM1B models planned on
their 512-core meshes (benchmarks/paper.py); the LM pipelined over a stage axis beside
FSDP and data parallelism (benchmarks/pipeline.py). The quality benchmark is
`python -m benchmarks.quality`, the GPU one `python -m benchmarks.gpu`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np

from benchmarks import cli, report

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Collective bytes per training step"
SCALING = "## Compile time vs depth, and planner time"
STEP_TIME = "## Step time: namedmesh vs the partitioner and hand-written"
COST = "## The cost model's bytes vs the compiled HLO"
TIME_MODEL = "## The cost model's step time vs measured"
MEMORY = "## Peak memory per device vs the ideal"
FIELDS = report.FIELDS


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


def _key_cells(r: dict) -> list[str]:
    return [r["case"], f"`{r['layout']}`", r["mesh"]]


def table(rows: list[dict]) -> str:
    fmt = lambda v: "—" if v is None else f"{v:.2f}" if isinstance(v, float) and v < 100 else (
        f"{v:,.0f}" if isinstance(v, float) else str(v)
    )  # fmt: skip
    head = ["case", "layout", "mesh", "namedmesh", "minimum", "GSPMD", "hand"]
    head += ["/min", "/GSPMD", "/hand"]
    numbers = ("namedmesh", "minimum", "gspmd", "hand", "ratio_to_min", "ratio_to_gspmd")
    cells = lambda r: _key_cells(r) + [fmt(r[k]) for k in (*numbers, "ratio_to_hand")]
    rows = [r for r in rows if r["bench"] == "collective_bytes"]
    return report.md_table(head, [cells(r) for r in rows])


# Why a row misses a goal, by (model kind, layout name); checked against the rows.
GAPS = {
    ("moe", "2d expert-parallel"): "the minimum leaves out the gating's reductions over the "
    "split experts dim (the softmax's max and sum, the two top-1 choices, their backward)",
    ("moe", "3d"): "as above: the gating's reductions over the split experts dim are not in "
    "the minimum",
}


def _gap(r: dict) -> str | None:
    return GAPS.get((r["case"].split()[0], r["layout"].split(":")[0]))


def write_docs(path: Path, rows: list[dict], command: str, info: dict) -> None:
    rows = [r for r in rows if r["bench"] == "collective_bytes"]
    off_min = [r for r in rows if r["ratio_to_min"] != 1.0]
    worse = [r for r in rows if r["ratio_to_gspmd"] is not None and r["ratio_to_gspmd"] > 1.0]
    made_by = (
        f"Made by `{command}` on {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
        "raw rows in `benchmarks/results/`."
    )
    lines = [
        *report.heading(SECTION, made_by, info),
        "Bytes one device sends per training step (forward, backward, gradient sync), read "
        "from the compiled HLO of `jax.grad` of each implementation and costed as ring "
        "collectives (all-reduce 2(n-1)/n·S, reduce-scatter and all-gather (n-1)/n of the "
        "full buffer, all-to-all (n-1)/n·S). The models (float32, loss mean(out²), plus "
        "the balancing loss for moe, gradients "
        "of every parameter): `mlp` relu(x·wi)·wo; `attention` multi-head self-attention; "
        "`layer` the zoo's pre-norm Transformer block (LayerNorm, causal attention, GELU "
        "FFN, residuals); `moe` the zoo's top-2 mixture-of-experts FFN (b batch, l length, "
        "d d_model, h heads or d_ff, k d_kv, f d_ff, e experts). GSPMD is the same traced "
        "program run with jax.numpy under `jit`, every input given its NamedSharding and "
        "every value a sharding constraint to the layout namedmesh gives it "
        "(benchmarks/steps.py); hand is Megatron's MLP or attention written as a "
        "`jax.shard_map`. The minimum is the Mesh-TensorFlow paper's analysis "
        "(benchmarks/cases.py): each parameter's gradient all-reduced over the data axes "
        "that do not split it, FSDP's all-gather and reduce-scatter over those that do, "
        "Megatron's all-reduce of each block's output (and of its input's gradient when "
        "the input needs one), sequence parallelism's all-gather of the attention input "
        "over the length axis. Every run checks that the implementations' gradients agree.",
        "",
        table(rows),
        "",
        "Goals: namedmesh / minimum = 1.00 in every row — "
        + ("**met**" if not off_min else f"**not met** in {len(off_min)} of {len(rows)} rows")
        + "; namedmesh ≤ GSPMD in every row — "
        + ("**met**." if not worse else f"**not met** in {len(worse)} of {len(rows)} rows."),
    ]
    for r in off_min + [r for r in worse if r not in off_min]:
        lines.append(
            f"- `{r['case']}`, `{r['layout']}`: x{r['ratio_to_min']:.2f} of the minimum, "
            f"x{r['ratio_to_gspmd']:.3f} of GSPMD — " + (_gap(r) or "cause not yet known") + "."
        )
    lines += ["", "![bytes per layout](img/bytes_per_layout.png)", ""]
    report.write_section(path, SECTION, "\n".join(lines))


def write_step_docs(path: Path, rows: list[dict], command: str) -> None:
    rows = [r for r in rows if r["bench"] == "step_time"]
    fmt = lambda v: "—" if v is None else f"{v * 1e3:.2f}"
    cells = [
        _key_cells(r) + [fmt(r["namedmesh"]), fmt(r["gspmd"]), fmt(r["hand"]),
         f"{r['ratio_to_gspmd']:.2f}",
         "—" if r["ratio_to_hand"] is None else f"{r['ratio_to_hand']:.2f}"]
        for r in rows
    ]  # fmt: skip
    g = [r["ratio_to_gspmd"] for r in rows]
    h = [r["ratio_to_hand"] for r in rows if r["ratio_to_hand"] is not None]
    lines = [
        STEP_TIME,
        "",
        f"Made by `{command}` (the run and machine of the collective-bytes section). "
        f"{rows[0]['metric'].capitalize()}: each repeat runs namedmesh, GSPMD and hand once "
        "in turn, after a warm-up call, on 8 simulated devices that share this machine's "
        "CPUs, so a collective here is a memory copy and the times are dominated by compute "
        "and dispatch: these ratios say little about a real interconnect.",
        "",
        report.md_table(
            ["case", "layout", "mesh", "namedmesh ms", "GSPMD ms", "hand ms", "/GSPMD", "/hand"],
            cells,
        ),
        "",
        f"Goals (reported, not asserted): ≤ 1.00 vs GSPMD — met in {sum(x <= 1.0 for x in g)} "
        f"of {len(g)} rows (median ratio {np.median(g):.2f}); ≤ 1.05 vs hand — met in "
        f"{sum(x <= 1.05 for x in h)} of {len(h)} rows"
        + (f" (median ratio {np.median(h):.2f})." if h else "."),
        "",
    ]
    report.write_section(path, STEP_TIME, "\n".join(lines))


def _pairs(rows: list[dict], bench: str) -> dict:
    """{(case, layout, mesh): {metric: namedmesh figure}} of one bench's rows."""
    out: dict = {}
    for r in rows:
        if r["bench"] == bench:
            out.setdefault((r["case"], r["layout"], r["mesh"]), {})[r["metric"]] = r["namedmesh"]
    return out


def write_cost_docs(path: Path, rows: list[dict], command: str) -> None:
    cells, equal = [], 0
    for (case, layout, mesh), v in _pairs(rows, "cost_model_bytes").items():
        pairs = [(v[f"{p} bytes per device, cost model"], v[f"{p} bytes per device, compiled HLO"])
                 for p in ("forward", "training-step")]  # fmt: skip
        same = all(abs(a - b) < 0.5 for a, b in pairs)
        equal += same
        cells.append([case, f"`{layout}`", mesh, *(f"{x:,.0f}" for p in pairs for x in p),
                      "yes" if same else "**no**"])  # fmt: skip
    goal = "**met** in every row." if equal == len(cells) else (
        f"**not met** in {len(cells) - equal} of {len(cells)} rows.")  # fmt: skip
    lines = [
        COST,
        "",
        f"Made by `{command}`. The cost model (`Lowered.report(wrt=0)`, lowering/cost.py) "
        "costs the plan before anything compiles: the forward pass, and the backward pass "
        "as jax transposes it (gradient syncs included). The compiled columns are the "
        "forward pass's HLO and that of `jax.value_and_grad` of the lowered loss (not "
        "`grad`, in which XLA drops the loss's own all-reduce), costed alike. Goal: equal — "
        + goal,
        "",
        report.md_table(["case", "layout", "mesh", "forward, model", "forward, HLO",
                         "training step, model", "training step, HLO", "equal"], cells),
        "",
    ]  # fmt: skip
    report.write_section(path, COST, "\n".join(lines))


def write_time_model_docs(
    path: Path, rows: list[dict], command: str, calibration: str, large: float
) -> None:
    """The roofline's step times beside the measured ones; `large` is the all-reduce
    rate with 64 MiB per device over its rate with 4 MiB (the calibration's)."""
    pairs = _pairs(rows, "cost_model_time")
    if not pairs:
        return
    cells, ratios = [], {}
    for (case, layout, mesh), v in pairs.items():
        pred = v["seconds per training step, cost model"]
        meas = v["seconds per training step, measured"]
        ratios[(case, layout, mesh)] = meas / pred
        cells.append([case, f"`{layout}`", mesh, f"{pred * 1e3:.2f}", f"{meas * 1e3:.2f}",
                      f"{meas / pred:.2f}"])  # fmt: skip
    r = np.array(list(ratios.values()))
    by_kind: dict = {}
    for (case, _, _), x in ratios.items():
        by_kind.setdefault(case.split()[0], []).append(x)
    kinds = "; ".join(f"{k} {np.median(v):.2f}" for k, v in by_kind.items())
    within = int(np.sum((r >= 0.5) & (r <= 2)))
    high = ", ".join(f"{c.split()[0]} {c.split()[1]} {lay.split(':')[0]} on {m} ({x:.1f})"
                     for (c, lay, m), x in ratios.items() if x > 2)  # fmt: skip
    lines = [
        TIME_MODEL,
        "",
        f"Made by `{command}`. The cost model's step time is a roofline "
        "(benchmarks/roofline.py) from constants measured by microbenchmarks at the "
        f"start of the same run, not fitted to these cases: {calibration}. Predicted = "
        "overhead + flops / flop rate + collectives × latency + Σ bytes / rate of their "
        "kind, with the flops, collectives and bytes of the forward and backward pass per "
        "device from `Lowered.report(wrt=0)`; measured is the median namedmesh step of "
        f"the step-time section. measured/predicted: median {np.median(r):.2f}, from "
        f"{r.min():.2f} to {r.max():.2f}, within a factor of 2 in {within} of {len(r)} "
        f"rows; by model: {kinds}.",
        "",
        f"Above 2: {high or 'none'}. What the roofline leaves out, and where it shows: "
        "(1) the memory traffic of elementwise ops, LayerNorm and softmax — most under "
        "Megatron, whose (batch, length, d_model) activations are whole on every device "
        "(attention and layer model-parallel); (2) collective rates fall once buffers "
        "leave the cache: "
        "XLA:CPU's in-process collectives are memory copies, not rings, and an all-reduce "
        f"of 64 MiB per device runs at {large:.2f}x the 4 MiB rate (measured in this run), "
        "so the largest "
        "MLP's 58 MB gradient all-reduce and FSDP's gathered weights take longer than "
        "predicted; (3) below 1, in the smallest cases, XLA runs collectives side by side "
        "where the model adds one latency each. The cost model's bytes are exact (the "
        "section above); its time is a lower bound to within these effects.",
        "",
        report.md_table(["case", "layout", "mesh", "predicted ms", "measured ms",
                         "measured/predicted"], cells),
        "",
    ]  # fmt: skip
    report.write_section(path, TIME_MODEL, "\n".join(lines))


def _memory_causes(r: dict) -> tuple[str, ...]:
    """The causes named for a peak-memory row (benchmarks/memory.py), for a row off the
    ideal by more than 10%; () for the others."""
    from benchmarks import memory  # imports jax: not before main() sets XLA_FLAGS

    if abs(r["ratio_to_min"] - 1) <= 0.10:
        return ()
    return memory.causes(r["case"].split()[0], r["layout"].split(":")[0])


def write_memory_docs(path: Path, rows: list[dict], command: str) -> None:
    from benchmarks import memory

    rows = [r for r in rows if r["bench"] == "peak_memory"]
    fmt = lambda v: "—" if v is None else f"{v:,.0f}"
    cells = [
        _key_cells(r) + [fmt(r["namedmesh"]), fmt(r["minimum"]), fmt(r["gspmd"]),
         f"{r['ratio_to_min']:.2f}", f"{r['ratio_to_gspmd']:.2f}",
         ", ".join(_memory_causes(r)) or ("—" if abs(r["ratio_to_min"] - 1) <= 0.10
                                          else "**not yet known**")]
        for r in rows
    ]  # fmt: skip
    near = [r for r in rows if abs(r["ratio_to_min"] - 1) <= 0.10]
    used = dict.fromkeys(c for r in rows for c in _memory_causes(r))
    lines = [
        MEMORY,
        "",
        f"Made by `{command}`. Peak is XLA's `memory_analysis()` of the compiled training "
        "step on one device: arguments + outputs + temporaries − aliased outputs (each "
        "has its own buffers, so this is what the step reserves). The ideal is what the "
        "step must hold, from the model and the layout alone (`ideal_bytes` in "
        "benchmarks/memory.py): the device's shards of the parameters, of their gradients "
        "(laid out alike; the steps return gradients, so there is no optimizer state) and "
        "of the input, plus its shards of the activations that textbook reverse mode reads "
        "in the backward pass — the other operand of a product, the output or input of a "
        "nonlinear op, nothing for a linear one — each counted once and not when it is a "
        "parameter or the input, every value of the traced graph divided as the layout's "
        "rules divide it. It is what a step must keep while its gradients' buffers are "
        "held, not jax's choice of residuals (which counts x again and keeps relu's mask "
        "beside its output); below 1, XLA has put activations in the gradients' output "
        "buffers before writing them. "
        f"Goal: within 10% of the ideal — met in {len(near)} of {len(rows)} rows. Every "
        "other row names its causes (per model and layout, found at the full run's sizes) "
        "by reading which temporaries are live at XLA's worst instruction (`python -m "
        "benchmarks.memory KIND LAYOUT [gspmd]`) and by compiling the step again without "
        "its batch-only mesh axes; most are XLA:CPU's or the autodiff's, and GSPMD, whose "
        "peak is beside under the same ideal, shares them.",
        "",
        report.md_table(
            ["case", "layout", "mesh", "namedmesh", "ideal", "GSPMD", "/ideal", "/GSPMD", "cause"],
            cells,
        ),  # fmt: skip
        "",
        *(f"- **{c}**: {memory.REASONS[c]}." for c in used),
        "",
    ]
    report.write_section(path, MEMORY, "\n".join(lines))


def plot_bytes(rows: list[dict], path: Path) -> None:
    """Bytes per layout, one panel per model (the largest size of each kind)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["bench"] == "collective_bytes"]
    last = {}
    for r in rows:
        last[r["case"].split()[0]] = r["case"]
    panels = [[r for r in rows if r["case"] == c] for c in last.values()]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, rs in zip(np.atleast_1d(axes), panels, strict=True):
        x = np.arange(len(rs))
        for k, key in enumerate(("minimum", "namedmesh", "gspmd", "hand")):
            label = {"gspmd": "GSPMD"}.get(key, key)
            ax.bar(x + (k - 1.5) * 0.2, [r[key] or 0 for r in rs], 0.2, label=label)
        ax.set_xticks(x, [f"{r['layout'].split(':')[0]}\n{r['mesh']}" for r in rs],
                      fontsize=6, rotation=30)  # fmt: skip
        ax.set_title(rs[0]["case"], fontsize=8)
        ax.set_ylabel("bytes per device per step")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


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


DEVICES = 8  # the meshes' devices (2x4): simulated on CPU


def docs_path(docs: str | None, quick: bool, results: str) -> str:
    """The markdown a run writes ('' for none): `docs` when given, else the published
    docs/benchmarks.md for a full run and RESULTS/<date>-quick.md for a quick one."""
    if docs is not None:
        return docs
    if quick:
        return str(Path(results) / f"{datetime.date.today().isoformat()}-quick.md")
    return str(ROOT / "docs" / "benchmarks.md")


def simulate(n: int) -> None:
    """Ask XLA's CPU backend for n devices unless XLA_FLAGS sets a count: it reads the
    flags when jax starts its backend (the first device query), not at `import jax`, so
    this works in the `namedmesh` command, which has imported jax already."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick", action="store_true",
        help="the smallest sizes and about half the layouts (cases.QUICK_CASES)",
    )  # fmt: skip
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument(
        "--docs",
        default=None,
        help="the markdown to write the tables into; '' to skip (default: docs/benchmarks.md "
        "for a full run, a file of its own beside the results for --quick, so a quick run "
        "never rewrites the published page)",
    )
    args = p.parse_args(argv)
    args.docs = docs_path(args.docs, args.quick, args.results)
    simulate(DEVICES)
    import jax

    if jax.device_count() < DEVICES:
        p.error(
            f"the benchmarks run on {DEVICES} devices; jax has {jax.device_count()} (its "
            f"backend started before XLA_FLAGS could ask for {DEVICES} host devices): run "
            "`python -m benchmarks.run` in a fresh process"
        )
    from tqdm import tqdm

    from benchmarks import collectives, paper, pipeline, roofline, scaling

    size = "quick" if args.quick else "full"
    print("calibrating the roofline (matmul, all-reduce, empty step) ...", flush=True)
    machine_ = roofline.calibrate(repeats=5 if args.quick else 9)
    bar = tqdm(total=collectives.count(size), desc="collective bytes, step time", unit="case")
    rows = collectives.rows(
        size, repeats=3 if args.quick else 9, progress=bar.update, machine=machine_
    )
    bar.close()
    bytes_rows = [r for r in rows if r["bench"] == "collective_bytes"]
    print("compile time vs depth, planner time ...", flush=True)
    rows += scaling.rows(depths=(1, 4) if args.quick else (1, 2, 4, 8, 16, 32))
    print("the paper's LM1B models on their meshes (planned, no devices) ...", flush=True)
    paper_rows = paper.rows()
    rows += paper_rows
    pipeline_rows = []  # five LM training steps compiled: not in --quick (make test runs it)
    if not args.quick:
        print("the LM pipelined over a stage axis, beside FSDP and data parallel ...", flush=True)
        pipeline_rows = pipeline.rows() + pipeline.paper_rows()
    rows += pipeline_rows
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
        if not docs.exists():  # a quick run's own page
            docs.parent.mkdir(parents=True, exist_ok=True)
            docs.write_text(f"# Benchmarks ({command}, {datetime.date.today().isoformat()})\n")
        write_docs(docs, bytes_rows, command, info)
        write_step_docs(docs, rows, command)
        write_cost_docs(docs, rows, command)
        large = roofline.rates(1 << 26, 3, only=("psum",))["psum"] / machine_.bytes_per_s["psum"]
        write_time_model_docs(docs, rows, command, roofline.describe(machine_), large)
        write_memory_docs(docs, rows, command)
        plot = None if args.quick else docs.parent / "img" / "compile_vs_depth.png"
        if plot is not None:
            plot_compile(rows, plot)
            plot_bytes(rows, docs.parent / "img" / "bytes_per_layout.png")
        write_scaling_docs(docs, rows, command, plot)
        paper.write_docs(docs, paper_rows, command)
        if pipeline_rows:
            pipeline.write_docs(docs, pipeline_rows, command)
        print(f"wrote {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
