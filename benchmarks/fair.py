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

# XLA:CPU's Eigen pool off: read when jax's CPU backend starts (its first computation),
# so `single_threaded` sets it before that. (`intra_op_parallelism_threads=1`, which this
# line also held until 2026-12, is not an XLA flag and did nothing.)
XLA_SINGLE_THREAD = "--xla_cpu_multi_thread_eigen=false"


def single_threaded(keep_memory: bool = True) -> str:
    """Make XLA, PyTorch and NumPy's BLAS use one thread each; returns what was set, for
    the method line of a report. Call it before jax's first computation and before
    torch is imported (a benchmark's `main` does).

    No XLA flag makes XLA:CPU single-threaded: its client runs a program's independent
    ops on a pool sized by the CPUs the process may use (a long-sequence step took 0.63 s
    of wall time and 1.18 s of CPU time on 2 CPUs), so the process is pinned to one CPU.
    With `keep_memory`, glibc keeps freed memory for reuse (`keep_freed_memory`)."""
    notes = []
    if keep_memory and (kept := keep_freed_memory()):
        notes.append(kept)
    if hasattr(os, "sched_setaffinity"):
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        notes.append(f"process pinned to CPU {cpu}")
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


# glibc's malloc keeping freed memory for reuse: one arena, no mmap, no trimming
KEEP_MEMORY = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "1099511627776",
}


def keep_freed_memory() -> str:
    """Make glibc's malloc keep freed memory for the next allocation (`KEEP_MEMORY`, as
    environment variables). XLA:CPU allocates each run's temporaries as one block (267 MB
    for the 2048-token step of benchmarks/long_seq.py), which glibc maps anew and the
    kernel faults in page by page every run: 0.14 s of system time in a 1.1 s step;
    PyTorch's smaller tensors come from the heap either way. It applies to both sides of
    a comparison (one process). glibc reads the variables when a process starts (mallopt
    later does not reach the arenas of threads already running), so a benchmark started
    as `python -m benchmarks.NAME` without them starts itself again with them; "" where
    glibc is not the allocator or the process was started otherwise."""
    import platform

    if platform.libc_ver()[0] != "glibc":
        return ""
    if all(os.environ.get(k) == v for k, v in KEEP_MEMORY.items()):
        return (
            "glibc malloc keeps freed memory ("
            + " ".join(f"{k}={v}" for k, v in KEEP_MEMORY.items())
            + ")"
        )
    argv = getattr(sys, "orig_argv", [])
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    if module.startswith("benchmarks."):
        sys.stdout.flush()
        os.execve(sys.executable, argv, {**os.environ, **KEEP_MEMORY})
    return ""


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
    "Both sides single-threaded (the process pinned to one CPU, XLA_FLAGS `{flags}`, "
    "`torch.set_num_threads(1)`, NumPy's BLAS limited to one thread; what was set is "
    "in parentheses below), each timed by `time.process_time()` (the process's CPU "
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
    sides = [n for n in table_sides(rows, failed) if n != "namedmesh"]
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


def table_sides(rows: dict[str, dict], failed: dict[str, dict[str, str]] | None = None) -> list:
    """The sides of `table`'s rows in their order of appearance, those that failed too."""
    names = [n for r in rows.values() for n in r] + [n for f in (failed or {}).values() for n in f]
    return list(dict.fromkeys(names))


def with_columns(lines: list[str], columns: dict[str, dict[str, str]]) -> list[str]:
    """`table`'s markdown lines with more columns ({name: {row label: cell}}) at the end;
    "—" where a column has no cell for a row."""
    head, rule, *rows = lines
    out = [head + "".join(f" {c} |" for c in columns), rule + "---|" * len(columns)]
    for line in rows:
        label = line.split(" | ")[0].removeprefix("| ")
        out.append(line + "".join(f" {col.get(label, '—')} |" for col in columns.values()))
    return out
