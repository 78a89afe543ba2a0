"""The rate of every dot of a zoo family's compiled training step, per shape, against
PyTorch's matmul (MKL) of the same shape (issue 40 item 3):

    python -m benchmarks.dot_shapes --family llama --rounds 5

The step (forward, backward, AdamW; benchmarks/step_movement.py's, at the realistic
size by default) is compiled and its dots read from the HLO (`lowering.hlo.dots`). Each
distinct dot, [batch] x [M, K] x [K, N], is timed alone under every arrangement that
computes the same product (`ARRANGEMENTS`: each operand stored as is or transposed,
the product or its transpose, i.e. the operands swapped; batch dims last; the output's
rows split into a 3-d operand; the output in 4 column chunks; the sum in 4 K blocks),
each arrangement's operands stored in its order before the clock starts, its result
checked against NumPy's float64 product first; and torch.matmul of the same product in
each operand order (a transposed operand is a strided view, which MKL reads in place).
Both single-threaded, CPU time, alternated (benchmarks/fair.py). The table gives, per
shape, its count in the step, the step's GFLOP, XLA's rate in the step's arrangement,
its best and worst arrangement, MKL's best, and the ratios.

    python -m benchmarks.dot_shapes --family llama --rounds 7 --reachable

times instead what a dot plan (namedmesh/dot_layout.py) can choose with the operands
as the step stores them (`REACHABLE`: the operands swapped, the result transposed back;
an operand copied to its other order first; both), end to end, copies included, each
behind an optimization barrier as `namedmesh.contract` pins them; per shape the step's
own rate, the fastest reachable choice's and the step's seconds lost to it. An
arrangement of the table above that needs an operand stored otherwise is a producer's
order (the value's own layout), not a dot plan's choice; and the best of twelve noisy
rates is biased up, so a shape's gap there is not all time a plan can win.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from typing import NamedTuple

import numpy as np

from benchmarks import cli, fair


class Product(NamedTuple):
    """A dot as [b] x [m, k] x [k, n] (dims of a group multiplied), with the order the
    step stores its operands in: "mk" or "km" for the left, "kn" or "nk" for the right."""

    b: int
    m: int
    k: int
    n: int
    lhs: str
    rhs: str

    @property
    def flops(self) -> int:
        return 2 * self.b * self.m * self.k * self.n

    def __str__(self) -> str:
        batch = f"{self.b} x " if self.b > 1 else ""
        return f"{batch}{self.m} x {self.k} x {self.n}"


def _order(shape, layout, contracting, batch) -> str:
    """Whether an operand stores its contracting dims before (major to) its free dims,
    "kf", or after, "fk", by its layout (minor to major); dims of size 1 do not count."""
    major_first = [d for d in layout[::-1] if d not in batch and shape[d] > 1]
    return "kf" if major_first and major_first[0] in contracting else "fk"


def product(dot) -> Product:
    """The Product of a `lowering.hlo.Dot`."""
    size = lambda shape, dims: math.prod(shape[d] for d in dims)
    free = lambda shape, used: [d for d in range(len(shape)) if d not in used]
    lhs_free = free(dot.lhs, dot.lhs_contracting + dot.lhs_batch)
    rhs_free = free(dot.rhs, dot.rhs_contracting + dot.rhs_batch)
    lo = _order(dot.lhs, dot.lhs_layout, dot.lhs_contracting, dot.lhs_batch)
    ro = _order(dot.rhs, dot.rhs_layout, dot.rhs_contracting, dot.rhs_batch)
    return Product(
        size(dot.lhs, dot.lhs_batch),
        size(dot.lhs, lhs_free),
        size(dot.lhs, dot.lhs_contracting),
        size(dot.rhs, rhs_free),
        "mk" if lo == "fk" else "km",
        "kn" if ro == "kf" else "nk",
    )


def step_products(hlo_text: str) -> Counter:
    """{Product: times it runs} of compiled HLO text."""
    from lowering.hlo import dots

    counts: Counter = Counter()
    for d in dots(hlo_text):
        counts[product(d)] += d.times
    return counts


# name -> (left operand's storage, right's, output): "mk"/"km", "kn"/"nk", "mn"/"nm"
ORIENTED = {
    f"A[{a}] B[{b}] -> [{o}]": (a.lower(), b.lower(), o.lower())
    for o in ("MN", "NM")
    for a in ("MK", "KM")
    for b in ("KN", "NK")
}
ARRANGEMENTS = (*ORIENTED, "batch dims last", "rows as [4, M/4]", "4 column chunks",
                "4 K blocks")  # fmt: skip


def stored(x: np.ndarray, order: str) -> np.ndarray:
    """[b, r, c] `x` stored as "rc" (as is) or "cr" (transposed)."""
    return x if order in ("mk", "kn") else np.ascontiguousarray(x.transpose(0, 2, 1))


def arrangement(p: Product, name: str, a: np.ndarray, b: np.ndarray):
    """(a jax function, its operands stored in the arrangement's order) computing `a @ b`
    ([p.b, m, k] x [p.b, k, n]) by arrangement `name`, or None where it does not apply;
    the function's result, read by `as_product`, is [b, m, n]."""
    import jax

    dg = jax.lax.dot_general
    if name in ORIENTED:
        lo, ro, oo = ORIENTED[name]
        lk, rk = (2 if lo == "mk" else 1), (1 if ro == "kn" else 2)
        if oo == "mn":
            fn = lambda x, y: dg(x, y, (([lk], [rk]), ([0], [0])))
        else:
            fn = lambda x, y: dg(y, x, (([rk], [lk]), ([0], [0])))
        return fn, (stored(a, lo), stored(b, ro))
    if name == "batch dims last":
        if p.b == 1:
            return None
        fn = lambda x, y: dg(x, y, (([1], [0]), ([2], [2])))
        return fn, (np.ascontiguousarray(a.transpose(1, 2, 0)),
                    np.ascontiguousarray(b.transpose(1, 2, 0)))  # fmt: skip
    if name == "rows as [4, M/4]":
        if p.b > 1 or p.m % 4:
            return None
        fn = lambda x, y: dg(x, y, (([2], [0]), ([], [])))
        return fn, (a.reshape(4, p.m // 4, p.k), b[0])
    if name == "4 column chunks":
        if p.n % 4:
            return None
        fn = lambda x, y: [dg(x, c, (([2], [1]), ([0], [0]))) for c in y]
        return fn, (a, np.ascontiguousarray(b.reshape(p.b, p.k, 4, p.n // 4).transpose(2, 0, 1, 3)))
    if name == "4 K blocks":
        if p.k % 4:
            return None
        fn = lambda x, y: sum(dg(x[i], y[i], (([2], [1]), ([0], [0]))) for i in range(4))
        return fn, (
            np.ascontiguousarray(a.reshape(p.b, p.m, 4, p.k // 4).transpose(2, 0, 1, 3)),
            np.ascontiguousarray(b.reshape(p.b, 4, p.k // 4, p.n).transpose(1, 0, 2, 3)),
        )
    raise KeyError(name)


def as_product(p: Product, name: str, y) -> np.ndarray:
    """An arrangement's result as [b, m, n]."""
    if name == "4 column chunks":
        return np.concatenate([np.asarray(c) for c in y], axis=-1)
    y = np.asarray(y)
    if name in ORIENTED and ORIENTED[name][2] == "nm":
        return y.transpose(0, 2, 1)
    return y.reshape(p.b, p.m, p.n)


# name -> (operands swapped, A copied to its other order, B copied): a dot plan's choices
REACHABLE = {
    "as stored": (False, False, False),
    "swapped": (True, False, False),
    "A copied": (False, True, False),
    "B copied": (False, False, True),
    "A copied, swapped": (True, True, False),
    "B copied, swapped": (True, False, True),
}


def reachable(p: Product, name: str):
    """A jax function of [b, .., ..] operands stored as the step stores them (`stored`
    of `p.lhs`, `p.rhs`) computing their [b, m, n] product by dot-plan choice `name`:
    a copy and a swapped result's transpose each behind an optimization barrier."""
    import jax

    swap, copy_a, copy_b = REACHABLE[name]
    dg, pin = jax.lax.dot_general, jax.lax.optimization_barrier

    def fn(x, y):
        xk, yk = (2 if p.lhs == "mk" else 1), (1 if p.rhs == "kn" else 2)
        if copy_a:
            x, xk = pin(x.transpose(0, 2, 1)), 3 - xk
        if copy_b:
            y, yk = pin(y.transpose(0, 2, 1)), 3 - yk
        if not swap:
            return dg(x, y, (([xk], [yk]), ([0], [0])))
        return pin(dg(y, x, (([yk], [xk]), ([0], [0])))).transpose(0, 2, 1)

    return fn


def operands(p: Product, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((p.b, p.m, p.k), np.float32),
            rng.standard_normal((p.b, p.k, p.n), np.float32))  # fmt: skip


def xla_sides(p: Product, a: np.ndarray, b: np.ndarray) -> dict:
    """{arrangement: a call that blocks until done}, each checked against NumPy's
    float64 product first (SystemExit naming the arrangement otherwise)."""
    import jax

    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    tol = 1e-4 * math.sqrt(p.k) * float(np.abs(want).max())
    sides = {}
    for name in ARRANGEMENTS:
        got = arrangement(p, name, a, b)
        if got is None:
            continue
        fn, args = got
        jitted, placed = jax.jit(fn), [jax.device_put(x) for x in args]
        err = float(np.abs(as_product(p, name, jitted(*placed)) - want).max())
        if not err <= tol:
            raise SystemExit(f"{p}: arrangement {name!r} is off by {err:.3g} (tolerance {tol:.3g})")
        sides[name] = lambda f=jitted, xs=placed: jax.block_until_ready(f(*xs))
    return sides


def reachable_sides(p: Product, a: np.ndarray, b: np.ndarray) -> dict:
    """{`REACHABLE` name: a call that blocks until done}, the operands stored as the step
    stores them, each checked against NumPy's float64 product first."""
    import jax

    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    tol = 1e-4 * math.sqrt(p.k) * float(np.abs(want).max())
    placed = [jax.device_put(stored(a, p.lhs)), jax.device_put(stored(b, p.rhs))]
    sides = {}
    for name in REACHABLE:
        jitted = jax.jit(reachable(p, name))
        err = float(np.abs(np.asarray(jitted(*placed)) - want).max())
        if not err <= tol:
            raise SystemExit(f"{p}: choice {name!r} is off by {err:.3g} (tolerance {tol:.3g})")
        sides[name] = lambda f=jitted: jax.block_until_ready(f(*placed))
    return sides


def torch_sides(a: np.ndarray, b: np.ndarray) -> dict:
    """{"MKL A[..] B[..]": torch.matmul of a and b, each stored as is or transposed}."""
    import torch

    sides = {}
    for lo in ("mk", "km"):
        for ro in ("kn", "nk"):
            x, y = torch.tensor(stored(a, lo)), torch.tensor(stored(b, ro))
            x = x if lo == "mk" else x.transpose(1, 2)
            y = y if ro == "kn" else y.transpose(1, 2)
            sides[f"MKL A[{lo.upper()}] B[{ro.upper()}]"] = lambda x=x, y=y: torch.matmul(x, y)
    return sides


def measure(p: Product, rounds: int) -> dict[str, float]:
    """{side: GFLOP/s by its min} of XLA's arrangements and MKL's, alternated."""
    a, b = operands(p)
    times = fair.alternate({**xla_sides(p, a, b), **torch_sides(a, b)}, rounds)
    return {name: p.flops / min(ts) / 1e9 for name, ts in times.items()}


def measure_reachable(p: Product, rounds: int) -> dict[str, tuple[float, float]]:
    """{`REACHABLE` name: (GFLOP/s by its min, by its median)}, alternated."""
    times = fair.alternate(reachable_sides(p, *operands(p)), rounds)
    rate = lambda t: p.flops / t / 1e9
    return {k: (rate(min(ts)), rate(sorted(ts)[len(ts) // 2])) for k, ts in times.items()}


def reachable_table(rows: dict[Product, tuple[int, dict]]) -> list[str]:
    """Markdown lines, a row per shape: the step's rate as stored, the fastest reachable
    choice by min (its rate by min / median), and the step's seconds lost to it."""
    head = ["b x M x K x N", "step's arrangement", "count",
            "as stored GFLOP/s (min / median)", "fastest reachable (min / median)",
            "next (min / median)", "step's ms lost"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lost = as_stored = 0.0
    for p, (n, rates) in sorted(rows.items(), key=lambda r: -r[0].flops * r[1][0]):
        ranked = sorted(rates, key=lambda k: -rates[k][0])
        best, stored = ranked[0], rates["as stored"]
        ms = n * p.flops / 1e6 * (1 / stored[0] - 1 / rates[best][0])
        lost, as_stored = lost + ms, as_stored + n * p.flops / 1e9 / stored[0]
        cell = lambda k, r=rates: f"{k}: {r[k][0]:.0f} / {r[k][1]:.0f}"
        lines.append("| " + " | ".join([
            str(p), step_name(p), str(n), f"{stored[0]:.0f} / {stored[1]:.0f}", cell(best),
            cell(ranked[1]), f"{ms:.1f}"]) + " |")  # fmt: skip
    lines.append(
        f"\nThe step's dots: {as_stored:.3f} s as stored; they lose {lost:.1f} ms to the "
        "fastest reachable choices by min."
    )
    return lines


def step_name(p: Product) -> str:
    return f"A[{p.lhs.upper()}] B[{p.rhs.upper()}] -> [MN]"


def table(rows: dict[Product, tuple[int, dict]]) -> list[str]:
    """Markdown lines, a row per shape, and a total row: the step's dot seconds at each
    rate."""
    head = ["b x M x K x N", "step's arrangement", "count", "GFLOP", "XLA step's GFLOP/s",
            "XLA best", "XLA worst", "MKL best", "step / MKL", "best / MKL"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    total = Counter()
    for p, (n, rates) in sorted(rows.items(), key=lambda r: -r[0].flops * r[1][0]):
        xla = {k: v for k, v in rates.items() if not k.startswith("MKL")}
        mkl = {k: v for k, v in rates.items() if k.startswith("MKL")}
        best, worst, top = max(xla, key=xla.get), min(xla, key=xla.get), max(mkl, key=mkl.get)
        ours, gflop = rates[step_name(p)], n * p.flops / 1e9
        total.update({"step": gflop / ours, "best": gflop / xla[best], "mkl": gflop / mkl[top]})
        lines.append("| " + " | ".join([
            str(p), step_name(p), str(n), f"{gflop:.1f}", f"{ours:.0f}",
            f"{best}: {xla[best]:.0f}", f"{worst}: {xla[worst]:.0f}",
            f"{top[4:]}: {mkl[top]:.0f}", f"{ours / mkl[top]:.2f}",
            f"{xla[best] / mkl[top]:.2f}"]) + " |")  # fmt: skip
    lines.append(
        f"\nThe step's dots: {total['step']:.3f} s at XLA's rate in the step's arrangements, "
        f"{total['best']:.3f} s in each shape's best arrangement, {total['mkl']:.3f} s at "
        "MKL's best rate."
    )
    return lines


def compiled_hlo(family: str, layers, d_model, heads, vocab, length, batch) -> str:
    """The compiled training step's HLO text (benchmarks/step_movement.py's step)."""
    from benchmarks import step_movement, zoo_families

    spec = zoo_families.configs(layers, d_model, heads, vocab, length)[family]
    ids = np.random.default_rng(0).integers(0, vocab, (batch, length + 1)).astype(np.int32)
    _, loaded, inputs, _ = zoo_families.built(family, spec, ids[:, :-1])
    compiled, _, _ = step_movement.compiled_step(loaded, inputs, ids[:, 1:], {})
    return compiled.as_text()


def main(argv=None) -> dict:
    from models.io import hub

    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__)
    cli.step_size_flags(p, hub.FAMILIES)
    p.add_argument("--rounds", type=cli.count, default=5)
    p.add_argument("--reachable", action="store_true",
                   help="time a dot plan's choices, the operands as stored")  # fmt: skip
    args = p.parse_args(argv)
    threads = fair.single_threaded()
    hlo = compiled_hlo(args.family, args.layers, args.d_model, args.heads, args.vocab,
                       args.length, args.batch)  # fmt: skip
    before = fair.load()
    timing = measure_reachable if args.reachable else measure
    rows = {q: (n, timing(q, args.rounds)) for q, n in step_products(hlo).items()}
    print(f"{args.family}'s training step: {args.layers} layers, d_model {args.d_model}, "
          f"{args.heads} heads, vocab {args.vocab}, batch {args.batch} x {args.length} "
          f"tokens; {threads}; load {before} -> {fair.load()}; {args.rounds} rounds, "
          "rates by each side's min")  # fmt: skip
    print("\n".join((reachable_table if args.reachable else table)(rows)))
    return rows


if __name__ == "__main__":
    sys.exit(cli.run(main))
