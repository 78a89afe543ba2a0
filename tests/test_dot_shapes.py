"""benchmarks/dot_shapes.py: a step's dots read as [b] x [m, k] x [k, n] products with the
operand orders the step stores (against tests/test_hlo_movement.py's hand-made module,
worked out by hand), every timed arrangement and dot-plan choice computing NumPy's
product, and the time the step loses to the fastest choice worked out by hand."""

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


def test_every_arrangement_computes_the_product():
    p = Product(2, 8, 12, 8, "km", "nk")
    a, b = dot_shapes.operands(p)
    # each checked against NumPy's float64 product (SystemExit naming one that is off)
    sides = dot_shapes.xla_sides(p, a, b)
    assert dot_shapes.step_name(p) in sides
    assert set(sides) == set(dot_shapes.ARRANGEMENTS) - {"rows as [4, M/4]"}  # a 2-d one
    # a dot plan's choices from the operands as stored, each checked the same way
    assert set(dot_shapes.reachable_sides(p, a, b)) == set(dot_shapes.REACHABLE)


def test_reachable_table_counts_the_seconds_lost_to_the_fastest_choice():
    p = Product(1, 1000, 500, 1000, "mk", "nk")  # 1 GFLOP, 3 times a step
    rates = {k: (50.0, 40.0) for k in dot_shapes.REACHABLE}
    rates.update({"as stored": (100.0, 90.0), "swapped": (125.0, 80.0)})
    lines = dot_shapes.reachable_table({p: (3, rates)})
    # 3 x 1 GFLOP at 100 GFLOP/s: 30 ms; at 125: 24 ms
    assert lines[2].split(" | ")[-3:] == ["swapped: 125 / 80", "as stored: 100 / 90", "6.0 |"]
    assert lines[-1].endswith("lose 6.0 ms to the fastest reachable choices by min.")
