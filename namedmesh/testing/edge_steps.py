"""The edge programs' own steps (strategies.programs(edge=True)): Python and NumPy scalars
and 0-d tensors combined with a value, and constants made from no input (over a value's
dims, one of them, or none), which later steps sum, contract and move along split dims.
Each step is (a, b, d, k) -> Tensor, as a primitive's `example`, `k` choosing the variant
so that a program that shrinks keeps its kind."""

from __future__ import annotations

import numpy as np

import namedmesh as nm

# Edge programs' sizes: empty dims and dims of one besides the usual ones
EDGE_SIZES = (0, 1, 2, 4, 3, 8)
# Dtypes an edge program's input may have besides float32 (its steps' results are float32)
EDGE_DTYPES = ("float32", "int32", "bool", "bfloat16", "float16")

_SCALAR_STEPS = (
    lambda a: a * 2.5,
    lambda a: 3 - a,
    lambda a: a / 7,
    lambda a: nm.maximum(a, 0.5),
    lambda a: nm.where(a > 0, a, 1.5),
    lambda a: a % 3,
    lambda a: a // 2,
    lambda a: a**2,
    lambda a: 2.0**a,
    lambda a: np.float32(0.25) * a,  # a NumPy scalar
    lambda a: nm.tensor(np.float32(-1.5), ()) + a,  # a 0-d tensor
    lambda a: nm.clip(a, -0.5, 1),
    lambda a: nm.round(a, 1),
    lambda a: nm.where(a > 0.5, 1.0, -1.0),  # scalars both sides: a's dtype is cond's
)


def scalar_step(a, b, d, k):
    """`a` combined with a Python scalar, NumPy scalar or 0-d tensor (k chooses which)."""
    return _SCALAR_STEPS[k % len(_SCALAR_STEPS)](a)


def constant_step(a, b, d, k):
    """A constant made from no input: over a's dims (with or without a's data added),
    over dim d alone, 0-d (added to a, or alone), or a range along d."""
    c = 0.5 + k % 7
    which = k // 7 % 6
    if which == 0:
        return nm.full(a.sizes, c)
    if which == 1:
        return nm.full(a.sizes, c) + a
    if which == 2:
        return nm.full({d: a.size_of(d)}, c)
    if which == 3:
        return nm.full({}, c) + a
    if which == 4:
        return nm.full({}, c)
    return nm.arange(d, a.size_of(d), start=k % 3, dtype=np.float32) * a


EDGE_STEPS = {"scalar": scalar_step, "constant": constant_step}
EDGE_KINDS = tuple(EDGE_STEPS)


def edge_input(values: np.ndarray, dtype: str) -> np.ndarray:
    """Normal draws `values` as an edge program's input of `dtype`: integers near them,
    bools of their sign, the half floats rounded."""
    if dtype == "int32":
        return np.round(values * 3).astype(np.int32)
    if dtype == "bool":
        return values > 0
    if dtype == "bfloat16":
        import ml_dtypes

        return values.astype(ml_dtypes.bfloat16)
    return values.astype(dtype)
