"""benchmarks/dot_shapes.py: a step's dots read as [b] x [m, k] x [k, n] products with the
operand orders the step stores (against tests/test_hlo_movement.py's hand-made module,
worked out by hand), every timed arrangement and dot-plan choice computing NumPy's
product, and the time the step loses to the fastest choice worked out by hand."""

import jax
import numpy as np

from benchmarks import dot_shapes
from benchmarks.dot_shapes import Product
from tests.test_hlo_movement import DOTS


def test_step_products_of_a_hand_made_module():
    # the fused dot: [2, 8, 16] stored column-major (its summed dim 16 outermost) x
    # [2, 16, 4], 4 iterations; the plain one: [3, 5] summed over its rows (dim 0)
    assert dot_shapes.step_products(DOTS) == {
        Product(2, 8, 16, 4, "km", "kn"): 4,
        Product(1, 5, 3, 5, "km", "kn"): 1,
    }


def test_every_arrangement_and_choice_computes_the_product():
    """Each timed arrangement and each dot-plan choice against NumPy's float64 product;
    all of them in one compiled program (one compile, where the benchmark jits each)."""
    p = Product(2, 8, 12, 8, "km", "nk")
    a, b = dot_shapes.operands(p)
    arranged = {n: dot_shapes.arrangement(p, n, a, b) for n in dot_shapes.ARRANGEMENTS}
    arranged = {n: got for n, got in arranged.items() if got is not None}
    assert set(arranged) == set(dot_shapes.ARRANGEMENTS) - {"rows as [4, M/4]"}  # a 2-d one
    assert dot_shapes.step_name(p) in arranged
    stored = (dot_shapes.stored(a, p.lhs), dot_shapes.stored(b, p.rhs))

    def every(arranged_args, stored):
        ys = {n: arranged[n][0](*xs) for n, xs in arranged_args.items()}
        choices = {n: dot_shapes.reachable(p, n)(*stored) for n in dot_shapes.REACHABLE}
        return ys, choices

    ys, choices = jax.jit(every)({n: got[1] for n, got in arranged.items()}, stored)
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    for name, y in ys.items():
        np.testing.assert_allclose(dot_shapes.as_product(p, name, y), want, rtol=1e-4, atol=1e-4)
    for name, y in choices.items():
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4, err_msg=name)


def test_reachable_table_counts_the_seconds_lost_to_the_fastest_choice():
    p = Product(1, 1000, 500, 1000, "mk", "nk")  # 1 GFLOP, 3 times a step
    rates = {k: (50.0, 40.0) for k in dot_shapes.REACHABLE}
    rates.update({"as stored": (100.0, 90.0), "swapped": (125.0, 80.0)})
    lines = dot_shapes.reachable_table({p: (3, rates)})
    # 3 x 1 GFLOP at 100 GFLOP/s: 30 ms; at 125: 24 ms
    assert lines[2].split(" | ")[-3:] == ["swapped: 125 / 80", "as stored: 100 / 90", "6.0 |"]
    assert lines[-1].endswith(
        "0.030 s as stored; they lose 6.0 ms to the fastest reachable choices by min."
    )
