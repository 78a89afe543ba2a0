"""Eager `nm.einsum` against NumPy's plain operation on the same operands: `a @ b` for a
matrix product, `np.linalg.multi_dot` (which orders the products) for a chain.

Run it as

    .venv/bin/python -m benchmarks.eager [--quick] [--out docs/benchmarks.md]

Cases (float32, standard-normal data):

- small: a 32x32 @ 32x32 matmul, where per-call overhead is most of the cost;
- large: a 1024x1024 @ 1024x1024 matmul, where BLAS is nearly all of it;
- chain: four operands `[i=1024,j=64] [j=64,k=1024] [k=1024,l=64] [l=64,m=1024] -> (i, m)`.
  Summed naively this is ~1.8e13 flops, left to right ~4e8, and the best order
  (`(jk)(kl)` first) ~1.5e8, so it measures whether both libraries pick a good path.

Method: both implementations run in one process, interleaved (A, B, A, B, ...), after a
warm-up (which also fills namedmesh's plan caches, as in any steady-state loop), NumPy's
BLAS limited to one thread (benchmarks/fair.py). Each repeat times one batch of calls by
the process's CPU time (`time.process_time`) and divides by the batch size (1000 calls
per batch in the small case, 1 otherwise); the garbage collector is off while timing, as
in `timeit`. The table reports the median over repeats for each implementation, the
ratio of medians nm/np, and nm median - np median in microseconds per call; the machine,
its load and library versions are recorded with the results.

- ops: the other small eager ops on 32x32 float32 operands with dims `(i, j)`, each
  against its plain NumPy equivalent (`x + y` against `a + b`, `x.sum("j")` against
  `a.sum(axis=1)`, ...: the table `OPS`), where dispatch is most of the cost.

For the small case the run also times the layers that `nm.einsum` stacks on top of
`np.matmul` (the primitive's NumPy implementation, `bind`, the public wrapper) and the
pieces `bind` runs, so a reader can see where the added time goes.

With `--out PATH` the results replace the section headed
`## Eager einsum vs NumPy's plain operation` in PATH (other sections are kept); PATH is
created when missing.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import importlib
import operator
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import opt_einsum

import namedmesh as nm
from benchmarks import cli, fair, report

SECTION = "## Eager einsum vs NumPy's plain operation"
LARGE_RATIO_GOAL = 1.05  # nm/np median ratio on large operands, at most
SMALL_RATIO_GOAL = 3.0  # nm/np median ratio on small operands (dispatch), at most


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    spec: str  # positional einsum string; each letter is also the dim name
    sizes: dict[str, int]
    nm_out: str | None  # `out=` passed to nm.einsum (None: its default)
    batch: int  # calls per timed batch
    repeats: int
    quick_repeats: int
    goal: str  # "small" or "large": which ratio goal
    numpy: str = "a @ b"  # the NumPy baseline, a key of BASELINES

    @property
    def inputs(self) -> list[str]:
        return self.spec.split("->")[0].split(",")

    @property
    def output(self) -> str:
        return self.spec.split("->")[1]


CASES = [
    Case("small", "32x32 @ 32x32 matmul", "ij,jk->ik", dict(i=32, j=32, k=32), None,
         batch=1000, repeats=60, quick_repeats=10, goal="small"),
    Case("large", "1024x1024 @ 1024x1024 matmul", "ij,jk->ik",
         dict(i=1024, j=1024, k=1024), None, batch=1, repeats=100, quick_repeats=15,
         goal="large"),
    Case("chain", "4-operand chain [i=1024,j=64] [j,k=1024] [k,l=64] [l,m=1024] -> (i, m)",
         "ij,jk,kl,lm->im", dict(i=1024, j=64, k=1024, l=64, m=1024), "i m",
         batch=1, repeats=200, quick_repeats=20, goal="large",
         numpy="np.linalg.multi_dot"),
]  # fmt: skip

BASELINES = {  # the NumPy call of each case's operands
    "a @ b": lambda arrays: functools.partial(operator.matmul, *arrays),
    "np.linalg.multi_dot": lambda arrays: functools.partial(np.linalg.multi_dot, arrays),
}

WARMUP = 3  # untimed interleaved batches before each measurement


def _np_softmax(a):
    e = np.exp(a - a.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@dataclass(frozen=True)
class OpCase:
    """A small eager op and its plain NumPy equivalent, each a function of the operands:
    NumPy arrays `a`, `b` (32x32 float32) and the Tensors `x`, `y` of them, dims (i, j)."""

    name: str
    numpy: str  # the NumPy call, as shown
    nm: str  # the namedmesh call, as shown
    np_fn: Callable
    nm_fn: Callable


OPS = [
    OpCase("add", "a + b", "x + y", lambda a, b: a + b, lambda x, y: x + y),
    OpCase("multiply", "a * b", "x * y", lambda a, b: a * b, lambda x, y: x * y),
    OpCase("scale", "a * 2.0", "x * 2.0", lambda a, b: a * 2.0, lambda x, y: x * 2.0),
    OpCase("exp", "np.exp(a)", "nm.exp(x)", lambda a, b: np.exp(a), lambda x, y: nm.exp(x)),
    OpCase("sum", "a.sum(axis=1)", 'x.sum("j")', lambda a, b: a.sum(axis=1),
           lambda x, y: x.sum("j")),
    OpCase("mean", "a.mean(axis=1)", 'x.mean("j")', lambda a, b: a.mean(axis=1),
           lambda x, y: x.mean("j")),
    OpCase("transpose", "a.transpose(1, 0)", 'x.transpose("j", "i")',
           lambda a, b: a.transpose(1, 0), lambda x, y: x.transpose("j", "i")),
    OpCase("reshape", "a.reshape(1024)", 'nm.reshape(x, {"k": 1024}, from_="i j")',
           lambda a, b: a.reshape(1024), lambda x, y: nm.reshape(x, {"k": 1024}, from_="i j")),
    OpCase("softmax", "exp(a - max) / sum, over axis 1", 'nm.softmax(x, "j")',
           lambda a, b: _np_softmax(a), lambda x, y: nm.softmax(x, "j")),
    OpCase("index", "a[3]", "x.isel(i=3)", lambda a, b: a[3], lambda x, y: x.isel(i=3)),
    OpCase("slice", "a[:, 2:10]", "x.isel(j=slice(2, 10))", lambda a, b: a[:, 2:10],
           lambda x, y: x.isel(j=slice(2, 10))),
    OpCase("concat", "np.concatenate([a, b], axis=0)", 'nm.concat([x, y], "i")',
           lambda a, b: np.concatenate([a, b], axis=0), lambda x, y: nm.concat([x, y], "i")),
]  # fmt: skip
OPS_BATCH = 1000
OPS_REPEATS = 30


# --- timing -------------------------------------------------------------------------------


def _time_batch(f: Callable[[], object], batch: int) -> float:
    t0 = time.process_time()
    for _ in range(batch):
        f()
    return (time.process_time() - t0) / batch


def interleaved(fns: list[Callable[[], object]], batch: int, repeats: int) -> list[list[float]]:
    """Seconds per call of each of `fns`, one entry per repeat, the fns run round-robin."""
    for _ in range(WARMUP):
        for f in fns:
            _time_batch(f, batch)
    times: list[list[float]] = [[] for _ in fns]
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            for f, ts in zip(fns, times, strict=True):
                ts.append(_time_batch(f, batch))
    finally:
        if was_enabled:
            gc.enable()
    return times


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def fmt_time(s: float) -> str:
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.2f} µs"


# --- the cases ----------------------------------------------------------------------------


@dataclass
class Result:
    case: Case
    np_times: list[float]
    nm_times: list[float]
    np_path: str
    nm_path: str

    @property
    def np_median(self) -> float:
        return statistics.median(self.np_times)

    @property
    def nm_median(self) -> float:
        return statistics.median(self.nm_times)

    @property
    def ratio(self) -> float:
        return self.nm_median / self.np_median

    @property
    def added_us(self) -> float:
        return (self.nm_median - self.np_median) * 1e6

    @property
    def paired_ratio(self) -> tuple[float, float, float]:
        """Quartiles of the per-repeat ratios nm_i/np_i (adjacent runs, so drift cancels)."""
        return _quartiles([b / a for a, b in zip(self.np_times, self.nm_times, strict=True)])

    @property
    def goal_met(self) -> bool:
        return self.ratio <= (SMALL_RATIO_GOAL if self.case.goal == "small" else LARGE_RATIO_GOAL)


def _operands(case: Case, rng: np.random.Generator):
    arrays = [
        rng.standard_normal(tuple(case.sizes[d] for d in sub), dtype=np.float32)
        for sub in case.inputs
    ]
    tensors = [nm.tensor(a, tuple(sub)) for a, sub in zip(arrays, case.inputs, strict=True)]
    return arrays, tensors


def _einsum_module():
    # `namedmesh.einsum` the attribute is the function; the module lives in sys.modules.
    return importlib.import_module("namedmesh.einsum")


def _nm_path(case: Case, tensors) -> str:
    if len(tensors) <= 2:
        return "one pairwise einsum"
    path_fn = getattr(_einsum_module(), "_path", None)
    if path_fn is None:
        return "n/a (namedmesh.einsum._path not found)"
    try:
        in_dims = tuple(t.dims for t in tensors)
        steps = path_fn(in_dims, tuple(case.output), tuple(t.shape for t in tensors))
        return str([tuple(sorted(step[0])) for step in steps])
    except Exception as e:  # the library is under active development; report, don't die
        return f"n/a ({type(e).__name__}: {e})"


def run_case(case: Case, quick: bool, rng: np.random.Generator) -> Result:
    arrays, tensors = _operands(case, rng)
    np_call = BASELINES[case.numpy](arrays)
    if case.nm_out is None:
        nm_call = functools.partial(nm.einsum, *tensors)
    else:
        nm_call = functools.partial(nm.einsum, *tensors, out=case.nm_out)

    ref, got = np_call(), nm_call()
    if got.dims != tuple(case.output) or got.data.dtype != ref.dtype:
        raise AssertionError(
            f"{case.name}: nm.einsum gave dims {got.dims} dtype {got.data.dtype}, expected "
            f"{tuple(case.output)} {ref.dtype}"
        )
    scale = float(np.max(np.abs(ref)))
    np.testing.assert_allclose(np.asarray(got.data), ref, rtol=1e-3, atol=1e-4 * scale)

    repeats = case.quick_repeats if quick else case.repeats
    np_times, nm_times = interleaved([np_call, nm_call], case.batch, repeats)
    np_path = (
        str(np.einsum_path(case.spec, *arrays, optimize="greedy")[0][1:])  # multi_dot's: optimal
        if len(arrays) > 2
        else "one pairwise einsum"
    )
    return Result(case, np_times, nm_times, np_path, _nm_path(case, tensors))


# --- the other small ops -------------------------------------------------------------------


@dataclass
class OpResult:
    case: OpCase
    np_times: list[float]
    nm_times: list[float]

    @property
    def ratio(self) -> float:
        return statistics.median(self.nm_times) / statistics.median(self.np_times)


def run_ops(quick: bool, rng: np.random.Generator) -> list[OpResult]:
    """Each op of OPS against its NumPy equivalent, interleaved; each result is checked
    against NumPy's first (values, and the dims NumPy's axes stand for)."""
    a, b = (rng.standard_normal((32, 32), dtype=np.float32) for _ in range(2))
    x, y = nm.tensor(a, "i j"), nm.tensor(b, "i j")
    results = []
    for case in OPS:
        np_call = functools.partial(case.np_fn, a, b)
        nm_call = functools.partial(case.nm_fn, x, y)
        want, got = np_call(), nm_call()
        if got.shape != want.shape or got.dtype != want.dtype:
            raise AssertionError(f"{case.name}: {got!r} against NumPy's {want.shape} {want.dtype}")
        np.testing.assert_allclose(np.asarray(got.data), want, rtol=1e-6, atol=1e-6)
        times = interleaved([np_call, nm_call], OPS_BATCH, 8 if quick else OPS_REPEATS)
        results.append(OpResult(case, *times))
    return results


def ops_table(results: list[OpResult]) -> str:
    header = ["op", "NumPy", "namedmesh", "NumPy median", "nm median", "ratio nm/np",
              f"≤ {SMALL_RATIO_GOAL:g}", "before: nm median", "before: ratio"]  # fmt: skip
    rows = []
    for r in results:
        np_us, nm_us = BEFORE_OPS.get(r.case.name, (None, None))
        rows.append([
            r.case.name, f"`{r.case.numpy}`", f"`{r.case.nm}`",
            fmt_time(statistics.median(r.np_times)), fmt_time(statistics.median(r.nm_times)),
            f"{r.ratio:.2f}", "met" if r.ratio <= SMALL_RATIO_GOAL else "not met",
            "" if nm_us is None else f"{nm_us:.2f} µs",
            "" if nm_us is None else f"{nm_us / np_us:.2f}",
        ])  # fmt: skip
    return report.md_table(header, rows)


# --- small-case overhead breakdown ----------------------------------------------------------


@dataclass
class Row:
    label: str
    note: str
    median: float | None  # seconds per call; None when the row could not run
    error: str = ""


def breakdown(quick: bool, rng: np.random.Generator) -> tuple[list[Row], list[Row]]:
    """Layers from np.matmul up to nm.einsum, and the pieces bind runs, on the small case."""
    case = CASES[0]
    (a, b), (x, w) = _operands(case, rng)
    spec = case.spec
    out = tuple(case.output)
    in_dims = (x.dims, w.dims)
    mod = _einsum_module()
    prim_mod = importlib.import_module("namedmesh.primitive")
    tensor_cls = nm.Tensor

    def private(m, name):
        f = getattr(m, name, None)
        if f is None:
            raise LookupError(f"{m.__name__}.{name} not found")
        return f

    def layer_rows():
        yield "a @ b", "the baseline: NumPy's matmul operator", lambda: lambda: a @ b
        yield "np.matmul(a, b)", "the BLAS call itself", lambda: functools.partial(np.matmul, a, b)
        yield (
            "_einsum_np(a, b, out=, in_dims=)",
            "the primitive's NumPy implementation (cached plan; no transpose needed here)",
            lambda: functools.partial(private(mod, "_einsum_np"), a, b, out=out, in_dims=in_dims),
        )
        yield (
            "bind(_einsum, x, w, out=, in_dims=)",
            "primitive dispatch: the remembered shape rule answer and kernel (np.matmul "
            "itself), dtype check, Tensor wrap",
            lambda: functools.partial(
                private(prim_mod, "bind"), private(mod, "_einsum"), x, w, out=out, in_dims=in_dims
            ),
        )
        yield (
            "nm.einsum(x, w)",
            "the public call, remembered per signature (namedmesh/eager.py): its key, then "
            "the kernel and the Tensor, without the checks or bind of its first call",
            lambda: functools.partial(nm.einsum, x, w),
        )
        yield (
            f"np.einsum('{spec}', a, b, optimize=True)",
            "for reference: NumPy einsum, which plans its path on every call",
            lambda: functools.partial(np.einsum, spec, a, b, optimize=True),
        )

    def piece_rows():
        r = a @ b
        yield (
            "_einsum_rule(x, w, out=, in_dims=)",
            "the shape rule: run once per signature (dims, shapes, dtypes, params)",
            lambda: functools.partial(private(mod, "_einsum_rule"), x, w, out=out, in_dims=in_dims),
        )
        yield (
            "_signature.__wrapped__(in_dims, None, None, None)",
            "einsum's checks of its dims and params, uncached (run once per signature)",
            lambda: functools.partial(private(mod, "_signature").__wrapped__, in_dims, *[None] * 3),
        )
        yield (
            "Tensor._make(r, dims)",
            "wrapping the result (bind)",
            lambda: functools.partial(private(tensor_cls, "_make"), r, out),
        )

    def measure(rows) -> list[Row]:
        runnable, results = [], []
        for label, note, make in rows:
            try:
                f = make()
                f()
            except Exception as e:  # a renamed private; report it and carry on
                results.append(Row(label, note, None, f"{type(e).__name__}: {e}"))
                continue
            runnable.append(f)
            results.append(Row(label, note, 0.0))
        times = iter(interleaved(runnable, case.batch, 10 if quick else 40))
        for row in results:
            if row.median is not None:
                row.median = statistics.median(next(times))
        return results

    return measure(layer_rows()), measure(piece_rows())


# --- reporting ----------------------------------------------------------------------------


def machine() -> dict[str, str]:
    """The shared machine description, plus what einsum timings depend on: the BLAS
    NumPy links and its threads (set to one here), opt_einsum's version, the load."""
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except Exception:
        blas = "unknown"
    threads = fair.single_threaded()
    info = report.machine()
    info["NumPy"] = f"{info['NumPy']} (BLAS: {blas})"
    info["opt_einsum"] = opt_einsum.__version__
    info["threads"] = threads
    info["load average (1/5/15 min) at the start"] = fair.load()
    return info


def command(argv: list[str]) -> str:
    return report.command("benchmarks.eager", argv)


def main_rows(results: list[Result]) -> tuple[list[str], list[list[str]]]:
    header = ["case", "NumPy", "NumPy median", "nm.einsum median", "ratio nm/np",
              "added µs/call", "paired ratio p25–p75", "repeats × batch"]  # fmt: skip
    rows = []
    for r in results:
        q1, _, q3 = r.paired_ratio
        rows.append([
            f"{r.case.name}: {r.case.what}",
            f"`{r.case.numpy}`",
            fmt_time(r.np_median),
            fmt_time(r.nm_median),
            f"{r.ratio:.3f}",
            f"{r.added_us:+.2f}",
            f"{q1:.3f}–{q3:.3f}",
            f"{len(r.np_times)} × {r.case.batch}",
        ])  # fmt: skip
    return header, rows


def goal_lines(results: list[Result]) -> list[str]:
    lines = []
    for r in results:
        status = "**met**" if r.goal_met else "**not met**"
        goal = SMALL_RATIO_GOAL if r.case.goal == "small" else LARGE_RATIO_GOAL
        lines.append(
            f"- {r.case.name} ({r.case.what}): ratio to `{r.case.numpy}` ≤ {goal:g} — "
            f"{status} ({r.ratio:.3f})"
        )
    return lines


def breakdown_table(rows: list[Row], stepwise: bool) -> str:
    """Rows as markdown; with `stepwise`, each layer's cost over the layer below it from
    np.matmul (the second row) up, and the np.einsum reference's cost over `a @ b` (the
    first row)."""
    header = ["call", "µs/call", "added by this layer", "what it is"]
    if not stepwise:
        header = ["call", "µs/call", "what it is"]
    out, base, prev = [], None, None
    for row in rows:
        t = "n/a" if row.median is None else f"{row.median * 1e6:.2f}"
        note = row.note if not row.error else f"{row.note} — not run: {row.error}"
        if not stepwise:
            out.append([f"`{row.label}`", t, note])
            continue
        step = ""
        if row.median is not None:
            if base is None:
                base = row.median
            elif prev is None:
                prev = row.median
            elif row.label.startswith("np.einsum"):
                step = f"{(row.median - base) * 1e6:+.2f} over a @ b"
            else:
                step = f"{(row.median - prev) * 1e6:+.2f}"
                prev = row.median
        out.append([f"`{row.label}`", t, step, note])
    return report.md_table(header, out)


def section(results, layers, pieces, argv, when, info, ops=()) -> str:
    header, rows = main_rows(results)
    chain = next((r for r in results if r.case.name == "chain"), None)
    parts = [
        *report.heading(SECTION, f"Made by `{command(argv)}` on {when}.", info),
        "Method: `nm.einsum` and NumPy's plain operation (`a @ b`; `np.linalg.multi_dot` for "
        "the chain) on the same float32 operands, run interleaved in one process after a "
        "warm-up, NumPy's BLAS on one thread; each repeat times a batch of calls by "
        "`time.process_time()` (CPU time, GC off) and divides by the batch size. Medians over "
        "repeats; ratio = nm median / np median; added = nm median − np median. The paired "
        "ratio column is the spread of per-repeat nm/np ratios of adjacent runs.",
        "",
        report.md_table(header, rows),
        "",
    ]
    if chain is not None:
        parts += [
            f"Chain contraction order (operand index pairs): np.einsum `{chain.np_path}`, "
            f"nm.einsum `{chain.nm_path}`.",
            "",
        ]
    parts += ["Goals:", "", *goal_lines(results), ""]
    if ops:
        parts += [
            "### Other small eager ops vs NumPy's plain operation",
            "",
            f"32x32 float32 operands, dims (i, j), timed like the table above ({OPS_BATCH} "
            "calls a batch, median of repeats); the goal is the small case's, a ratio of at "
            f"most {SMALL_RATIO_GOAL:g}.",
            "",
            ops_table(ops),
            "",
        ]
    parts += [
        "### Where the small-case time goes",
        "",
        "The layers `nm.einsum` stacks on `np.matmul`, 32x32 @ 32x32 float32, timed "
        "interleaved like the table above (batches of 1000 calls, median of repeats); "
        '"added by this layer" is a row minus the nm layer below it.',
        "",
        breakdown_table(layers, stepwise=True),
        "",
        "Pieces of those layers, each called on its own:",
        "",
        breakdown_table(pieces, stepwise=False),
        "",
        NOTES.format(**BEFORE),
    ]
    return "\n".join(parts)


# Kept with every rerun: what the section used to say, and the ops' figures before the
# dispatch work (issue 29), measured by the same code on the commit named.
NOTES = """**Correction.** This section used to compare `nm.einsum` with
`np.einsum(spec, *arrays, optimize=True)`, which plans its contraction path on every
call (9.5 µs for a 32x32 product, against 1.6 µs for `a @ b`), timed by the wall clock
with NumPy's BLAS on its default threads; its "+3.4 µs added" hid that the eager
einsum cost about 9.5x `a @ b` (15 µs). The baseline is now NumPy's plain operation,
the timing CPU time with one BLAS thread. The dispatch was cut for this (issue 29):
`bind` remembers each eager NumPy op's shape rule answer and kernel per (primitive,
params, input dims, shapes, dtypes), `nm.einsum` checks its dims and params once per
signature, and a plain matrix product runs as `np.matmul` itself.

**The other small ops** (issue 29, item 4) cost 3.7-16x NumPy's plain operation, and
25-100x a NumPy view (transpose, reshape, indexing), before their dispatch was cut:
most of the time was each op's Python wrapper (parse and check the dims, align the
operands, work out the params) and `bind`'s generic path, on every call. Now a public
op called on NumPy-backed Tensors remembers, per signature (its Tensors' dims, shapes
and dtypes, its other arguments by type and value), the binds its first call made
(namedmesh/eager.py) and replays their NumPy kernels on the new arrays; elementwise
ops of operands in the result's dim order run the ufunc itself, reductions the
ufunc's `reduce`, transpose, reshape, slices and squeeze the ndarray's own method.
Under a trace, on jax data, with arguments of other kinds, or where the first call
warned, an op runs itself as before. A view costs NumPy 0.1-0.2 µs, less than one
Python call that makes a Tensor, so those rows cannot reach the goal this way.
The "before" columns of the ops' table: `{before_command}` on {before_commit},
{before_when}.
"""
BEFORE = dict(
    before_command=".venv/bin/python -m benchmarks.eager",
    before_commit="main at edbb841 (namedmesh as at af6f6d1) with this file's cases",
    before_when="on 2026-12-05 00:06 UTC, load average 16.0/16.0/13.8 at the start; the "
    "small einsum then took 4.49 µs, 2.759x `a @ b`",
)
# that run's medians, µs per call: op -> (NumPy, namedmesh)
BEFORE_OPS = {
    "add": (0.61, 9.05),
    "multiply": (0.58, 9.01),
    "scale": (0.92, 10.77),
    "exp": (0.98, 9.35),
    "sum": (1.86, 6.7),
    "mean": (4.47, 11.34),
    "transpose": (0.15, 4.92),
    "reshape": (0.17, 13.26),
    "softmax": (8.53, 19.31),
    "index": (0.11, 11.14),
    "slice": (0.2, 5.73),
    "concat": (1.16, 8.07),
}


def write_doc(path: Path, new: str) -> None:
    report.write_section(path, SECTION, new)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    p.add_argument("--out", type=Path, help="markdown file whose einsum section to replace")
    args = p.parse_args(argv)

    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    info = machine()
    print(f"{command(argv)}  ({when})")
    for k, v in info.items():
        print(f"  {k}: {v}")
    print()

    rng = np.random.default_rng(0)
    results = []
    for case in CASES:
        print(f"running {case.name}: {case.what} ...", flush=True)
        results.append(run_case(case, args.quick, rng))
    print("running the other small ops ...", flush=True)
    ops = run_ops(args.quick, rng)
    print("running the small-case breakdown ...", flush=True)
    layers, pieces = breakdown(args.quick, rng)

    text = section(results, layers, pieces, argv, when, info, ops)
    print()
    print(text)
    if args.out is not None:
        write_doc(args.out, text)
        print(f"wrote section {SECTION!r} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
