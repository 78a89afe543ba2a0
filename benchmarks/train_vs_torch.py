"""Rows of the zoo's training step (forward, backward, AdamW) against transformers'
eager PyTorch, by benchmarks/fair.py's method, at a size: each family's model built by
transformers (benchmarks/zoo_families.py's configs), loaded into the zoo, its step
compiled with the zoo's default settings (timed: lower and compile), the first losses
checked equal, then both steps alternated. Each row also gives the step's matmul
flops counted from the config (benchmarks/peak.py), the fraction of the machine's
matmul peak each side reaches by its min, and each side's memory: a training step's
peak resident memory above the resident memory before it (benchmarks/rss.py), each
side in a fresh process of its own (`step_bytes`), its optimizer state made first."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from benchmarks import fair, peak, rss, step_movement, zoo_families


@dataclass(frozen=True)
class Size:
    name: str
    layers: int
    d_model: int
    heads: int
    vocab: int
    length: int
    batch: int

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.layers} layers, d_model {self.d_model}, {self.heads} "
            f"heads, vocab {self.vocab}, batch {self.batch} x {self.length} tokens"
        )


SIZES = {
    "small": Size("small", 2, 256, 8, 8192, 128, 4),
    "realistic": Size("realistic", 4, 512, 8, 8192, 512, 4),
}
FAMILIES = ("llama", "qwen3", "gemma2", "mixtral")


def families(size: Size) -> dict:
    """The families' configs at `size` (benchmarks/zoo_families.py's)."""
    return zoo_families.configs(size.layers, size.d_model, size.heads, size.vocab, size.length)


def case(family: str, size: Size) -> tuple:
    """(ids, transformers' model, the zoo's loaded model, its batch, decodes): one
    family's step at `size` on the rows of seed 0 (ids: inputs then next tokens)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, size.vocab, (size.batch, size.length + 1)).astype(np.int32)
    return (ids, *zoo_families.built(family, families(size)[family], ids[:, :-1]))


def row(family: str, size: Size, rounds: int, peak_gflops: float) -> dict:
    """One family's measurements: seconds per round of both sides, compile seconds,
    matmul flops, the first losses."""
    ids, model, loaded, batch, decodes = case(family, size)
    compiled, state, compile_s = step_movement.compiled_step(loaded, batch, ids[:, 1:], {})
    ours, our_loss = step_movement.timed(compiled, state)
    torch_step = zoo_families.torch_sides(model, ids[:, :-1], ids[:, 1:], decodes, compile=False)[
        "PyTorch eager"
    ][1]
    their_loss = torch_step()
    if abs(our_loss - their_loss) > zoo_families.TOLERANCE * max(1.0, abs(their_loss)):
        raise SystemExit(
            f"{family} ({size.name}): first loss {our_loss} differs from "
            f"PyTorch's {their_loss}; timing them would compare two computations"
        )
    times = fair.alternate({"namedmesh": ours, "PyTorch eager": torch_step}, rounds)
    flops = peak.step_flops(peak.shape_of(model.config), size.batch, size.length)
    return {
        "memory": memory(family, size.name),
        "times": times,
        "compile": compile_s,
        "flops": flops,
        "peak": peak_gflops,
        "losses": (our_loss, their_loss),
        "experts": zoo_families.experts_path(model),
    }


SIDES = ("namedmesh", "PyTorch eager")
MEMORY_LIMIT_S = 900  # one side's process: build, compile, one step


def memory(family: str, size_name: str) -> dict:
    """{side: bytes, or the reason it was not measured}: `step_bytes` of each side, each
    run in a fresh process (benchmarks/rss.py's `fresh`)."""
    out = {}
    for side in SIDES:
        try:
            args = [family, size_name, side]
            out[side] = rss.fresh("benchmarks.train_vs_torch:step_bytes", args, MEMORY_LIMIT_S)
        except rss.MeasurementError as e:
            out[side] = str(e)[:120]
    return out


def step_bytes(family: str, size_name: str, side: str) -> int:
    """The memory of `side`'s training step of `family` at SIZES[size_name], this
    process's one measurement (rss.step_bytes): the models built, the optimizer state
    made (namedmesh's by optax's init; PyTorch's AdamW's at its first step, so PyTorch's
    second step is measured), namedmesh's step compiled and not run before."""
    ids, model, loaded, batch, decodes = case(family, SIZES[size_name])
    if side == "namedmesh":
        compiled, state, _ = step_movement.compiled_step(loaded, batch, ids[:, 1:], {})
        step = lambda: compiled(state)[1].block_until_ready()
    else:
        sides = zoo_families.torch_sides(model, ids[:, :-1], ids[:, 1:], decodes, compile=False)
        step = sides["PyTorch eager"][1]
        step()  # AdamW makes its state at its first step; PyTorch frees what it drops at once
    return rss.step_bytes(step, f"{side}'s {family} step, {size_name}")


def table(rows: dict[str, dict]) -> list[str]:
    """Markdown lines, a row per family."""
    head = [
        "family",
        "namedmesh s",
        "PyTorch eager s",
        "namedmesh / PyTorch",
        "compile s",
        "matmul GFLOP",
        "namedmesh % of peak",
        "PyTorch % of peak",
        "first loss",
        "namedmesh MiB",
        "PyTorch MiB",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for family, r in rows.items():
        ours, theirs = r["times"]["namedmesh"], r["times"]["PyTorch eager"]
        pct = lambda ts, r=r: f"{100 * peak.fraction(r['flops'], min(ts), r['peak']):.0f}%"
        label = f"{family} (experts: {r['experts']})" if r["experts"] else family
        cells = [
            label,
            fair.cell(ours, 1),
            fair.cell(theirs, 1),
            fair.ratio(ours, theirs),
            f"{r['compile']:.1f}",
            f"{r['flops'] / 1e9:.1f}",
            pct(ours),
            pct(theirs),
            "{:.5f} / {:.5f}".format(*r["losses"]),
            *(mib(r.get("memory", {}).get(side)) for side in SIDES),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def mib(value) -> str:
    """A memory cell: MiB, or why it was not measured."""
    if isinstance(value, int):
        return f"{value / 2**20:.0f}"
    return f"not measured: {value}" if value else "—"
