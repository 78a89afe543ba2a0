"""`python -m benchmarks.run [--quick]`: the distributed benchmarks, written to
benchmarks/results/<date>.json and to docs/benchmarks.md.

Runs on 8 simulated CPU devices. So far: collective bytes per device per training step
of the two-layer MLP under data-parallel, Megatron, 2D and FSDP layouts, for
namedmesh, XLA's partitioner and a hand-written shard_map, beside the analytical
minimum (benchmarks/collectives.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Collective bytes per training step"
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
    head = "| case | layout | mesh | namedmesh | minimum | GSPMD | hand | /min | /GSPMD | /hand |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        cells = [r["case"], f"`{r['layout']}`", r["mesh"]]
        cells += [fmt(r[k]) for k in ("namedmesh", "minimum", "gspmd", "hand")]
        cells += [fmt(r[k]) for k in ("ratio_to_min", "ratio_to_gspmd", "ratio_to_hand")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if SECTION in text:
        start = text.index(SECTION)
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + (text[end + 1 :] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the smallest case only")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"), help="'' to skip")
    args = p.parse_args(argv)
    if "jax" not in sys.modules:
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    from tqdm import tqdm

    from benchmarks import collectives

    sizes = SIZES["quick" if args.quick else "full"]
    rows = []
    for b, d, h in tqdm(sizes, desc="collective bytes", unit="size"):
        rows += collectives.rows(b, d, h)
    info = machine()
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{datetime.date.today().isoformat()}{'-quick' if args.quick else ''}.json"
    (out / name).write_text(json.dumps({"machine": info, "rows": rows}, indent=1) + "\n")
    print(table(rows))
    print(f"wrote {out / name}")
    if args.docs:
        command = "python -m benchmarks.run" + (" --quick" if args.quick else "")
        write_docs(Path(args.docs), rows, command, info)
        print(f"wrote {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
