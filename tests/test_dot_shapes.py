"""benchmarks/dot_shapes.py: a step's dots read as [b] x [m, k] x [k, n] products with the
operand orders the step stores (against tests/test_hlo_movement.py's hand-made module,
worked out by hand), and every timed arrangement computing NumPy's product."""

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
