"""Timing two libraries side by side so that a shared machine cannot bias the ratio:
both single-threaded (XLA, PyTorch and the BLAS under NumPy), each call timed by the
process's CPU time (`time.process_time`, every thread of the process counted), the
sides alternated in one process over several rounds (the order reversed every other
round), each side's min and median reported, and the machine's load recorded.

Wall-clock time of multi-threaded runs on a busy machine measures the other work as
much as the code: a side whose threads wait on a busy core looks slow, and one that
spins looks fast. CPU time of one thread per side counts only the work done.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

# One thread for XLA:CPU's Eigen pool and intra-op work; read when jax's CPU backend
# starts (its first computation), so `single_threaded` sets it before that
XLA_SINGLE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def single_threaded() -> str:
    """Make XLA, PyTorch and NumPy's BLAS use one thread each; returns what was set, for
    the method line of a report. Call it before jax's first computation (XLA reads its
    flags when its CPU backend starts; a benchmark's `main` does)."""
    notes = []
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {XLA_SINGLE_THREAD}".strip()
    notes.append(f"XLA_FLAGS={os.environ['XLA_FLAGS']!r}")
    if "torch" in sys.modules or _importable("torch"):
        import torch

        torch.set_num_threads(1)
        notes.append(f"torch threads {torch.get_num_threads()}")
    try:
        import threadpoolctl

        threadpoolctl.threadpool_limits(1)
        notes.append("BLAS/OpenMP pools limited to 1 thread (threadpoolctl)")
    except ImportError:
        notes.append("BLAS threads as the library starts (threadpoolctl missing)")
    return "; ".join(notes)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def cpu_seconds(fn: Callable[[], object]) -> float:
    """The process's CPU seconds of one call of `fn` (which must block until done)."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def alternate(sides: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """CPU seconds of each side per round: every round calls every side once, in the
    given order on even rounds and reversed on odd ones, after one untimed warm-up
    round (compilation, caches)."""
    names = list(sides)
    for name in names:
        sides[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(cpu_seconds(sides[name]))
    return times


def why_not(e: Exception) -> str:
    """A side that could not run, in a table cell: the error's type and first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def min_median(ts: list[float]) -> tuple[float, float]:
    return min(ts), statistics.median(ts)


def load() -> str:
    """The machine's 1, 5 and 15 minute load averages, as text."""
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def cell(ts: list[float], scale: float = 1e3) -> str:
    """'min / median' of seconds `ts`, in milliseconds by default."""
    lo, mid = min_median(ts)
    return f"{lo * scale:.4g} / {mid * scale:.4g}"


def ratio(ours: list[float], theirs: list[float]) -> str:
    """'by min / by median' of ours over theirs."""
    (a, b), (c, d) = min_median(ours), min_median(theirs)
    return f"{a / c:.2f} / {b / d:.2f}"


METHOD = (
    "Both sides single-threaded (XLA_FLAGS `{flags}`, `torch.set_num_threads(1)`, NumPy's "
    "BLAS limited to one thread), each timed by `time.process_time()` (the process's CPU "
    "time: a loaded machine slows the wall clock, not the work), alternated in one process "
    "(the order reversed every other round) over {rounds} rounds after an untimed warm-up; "
    "cells are min / median, ratios namedmesh over PyTorch by min / by median. Load "
    "average (1/5/15 min) before and after: {before} and {after}."
)


def table(
    rows: dict[str, dict[str, list[float]]],
    first: str = "",
    failed: dict[str, dict[str, str]] | None = None,
    notes: tuple[str, dict[str, str]] | None = None,
    unit: str = "ms",
) -> list[str]:
    """Markdown lines: per row ({label: {side: seconds per round}}, namedmesh first)
    namedmesh's cell, then each other side's cell and namedmesh's ratio to it. A side that
    did not run in a row (`failed`: {label: {side: reason}}) shows its reason; `notes`
    (column name, {label: text}) adds a last column."""
    failed = failed or {}
    sides = [n for r in rows.values() for n in r if n != "namedmesh"]
    sides += [n for f in failed.values() for n in f]
    sides = list(dict.fromkeys(sides))
    scale = {"ms": 1e3, "s": 1.0}[unit]
    head = [first, f"namedmesh {unit}"]
    for name in sides:
        head += [f"{name} {unit}", f"namedmesh / {name}"]
    head += [notes[0]] if notes else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, times in rows.items():
        cells = [label, cell(times["namedmesh"], scale)]
        for name in sides:
            if name in times:
                cells += [cell(times[name], scale), ratio(times["namedmesh"], times[name])]
            else:
                cells += [f"not run: {failed.get(label, {}).get(name, 'not asked')}", "—"]
        cells += [notes[1][label]] if notes else []
        lines.append("| " + " | ".join(cells) + " |")
    return lines
