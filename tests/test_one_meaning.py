"""Issue 38's classes 3, 4 and 6, each with one meaning on every path (eager NumPy,
nm.reference, eager jax, jit, lowered), held to oracles computed without namedmesh
(namedmesh/testing/oracles.py): power of every integer/float combination (negative and
large exponents), update_slice's negative starts, and big-endian inputs."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, lower
from namedmesh.testing import compare
from namedmesh.testing.oracles import power_oracle, window_start
from namedmesh.testing.strategies import DTYPES, np_dtype

MESH = Mesh({"x": 4})
BASES = [0, 1, -1, 2, -3, 5, 0.5, -2.5, 127, 3, 1.5, 2]
EXPONENTS = [0, 1, 2, 3, -1, -2, -3, 7, 0.5, 64, 255, -64]  # 64, 255: past jnp.power's 6 squarings
PAIRS = list(itertools.product(DTYPES, DTYPES))


def values(dtype, vals):
    return np.array(vals).astype(np_dtype(dtype))


def powers(xs, ys):
    """power of every pair of dtypes, one program: one trace and one compile per path."""
    return [nm.power(xs[a], ys[b]) for a, b in PAIRS]


@functools.cache
def power_paths():
    xs = {d: nm.tensor(values(d, BASES), "i") for d in DTYPES}
    ys = {d: nm.tensor(values(d, EXPONENTS), "i") for d in DTYPES}
    as_jax = lambda ts: {d: nm.tensor(jnp.asarray(t.data), "i") for d, t in ts.items()}
    return {
        "eager NumPy": powers(xs, ys),
        "nm.reference": nm.reference(nm.trace(powers, xs, ys))(xs, ys),
        "eager jax": powers(as_jax(xs), as_jax(ys)),
        "jit": jax.jit(powers)(as_jax(xs), as_jax(ys)),
        "lowered": lower(powers, MESH, "i:x")(xs, ys),
    }


@pytest.mark.parametrize("path", ["eager NumPy", "nm.reference", "eager jax", "jit", "lowered"])
def test_power_of_every_integer_and_float_pair_equals_the_oracle(path):
    got = power_paths()[path]
    for (a, b), g in zip(PAIRS, got, strict=True):
        want = power_oracle(values(a, BASES), values(b, EXPONENTS))
        g = nm.tensor(np.asarray(g.data), "i")
        exact = want.dtype.kind in "iub"
        compare(g, nm.tensor(want, "i"), rtol=0.0 if exact else None, what=f"{path} {a}**{b}")


def test_power_of_float_by_negative_int_is_the_reciprocal_power():
    """The issue's case: 2.0 ** -2 was 0 in eager NumPy and nm.reference."""
    x = nm.tensor(np.array([2.0, 4.0, -2.0], np.float32), "i")
    y = nm.tensor(np.array([-2, -1, -3], np.int32), "i")
    np.testing.assert_array_equal(nm.power(x, y).data, [0.25, 0.25, -0.125])
    np.testing.assert_array_equal(nm.reference(nm.trace(nm.power, x, y))(x, y).data,
                                  [0.25, 0.25, -0.125])  # fmt: skip


# --- negative starts --------------------------------------------------------------------
STARTS = [  # (start, its dims): 0-d and per row, negative, beyond either end, narrow dtypes
    (np.int32(-1), ()),
    (np.int8(-3), ()),
    (np.int32(-9), ()),
    (np.array([-1, -7, 2, 9], np.int32), ("b",)),
    (np.array([-128, 127, -2, 0], np.int8), ("b",)),
    (np.array([250, 3, 1, 5], np.uint8), ("b",)),
]
X = np.arange(24, dtype=np.float32).reshape(4, 6)
V = -np.ones((4, 2), np.float32)


def write(x, start, v):
    return nm.update_slice(x, "m", start, v)


def write_oracle(start):
    out = X.copy()
    for b, s in enumerate(np.broadcast_to(start, 4)):
        at = window_start(s, 6, 2)
        out[b, at : at + 2] = V[b]
    return out


@pytest.mark.parametrize("start, dims", STARTS, ids=repr)
def test_update_slice_negative_starts_count_from_the_end_on_every_path(start, dims):
    args = (nm.tensor(X, "b m"), nm.tensor(start, dims), nm.tensor(V, "b m"))
    jax_args = [nm.tensor(jnp.asarray(a.data), a.dims) for a in args]
    got = {
        "eager NumPy": write(*args),
        "nm.reference": nm.reference(nm.trace(write, *args))(*args),
        "eager jax": write(*jax_args),
        "jit": jax.jit(write)(*jax_args),
        "lowered": lower(write, MESH, "b:x")(*args),
    }
    for path, g in got.items():
        np.testing.assert_array_equal(np.asarray(g.data), write_oracle(start), err_msg=path)


def test_gather_negative_indices_count_from_the_end_on_every_path():
    idx = nm.tensor(np.array([-1, -6, -7, 7], np.int8), "k")
    x = nm.tensor(X, "b m")
    want = X[:, [5, 0, 0, 5]]
    take = lambda x, i: nm.gather(x, "m", i)
    for path, g in {
        "eager NumPy": take(x, idx),
        "jit": jax.jit(take)(x, idx),
        "lowered": lower(take, Mesh({"x": 2}), "m:x")(x, idx),  # the table split along m
    }.items():
        np.testing.assert_array_equal(np.asarray(g.data), want, err_msg=path)


# --- byte order -------------------------------------------------------------------------
def mixed(a, i):
    """Elementwise ops, einsum, where and a reduction on a float and an int input."""
    return [a + 1, a * i, nm.exp(a), nm.einsum(a, nm.rename(a, b="c"), out="b c"),
            nm.where(a > 2, a, i), nm.power(a, i), nm.sum(i, "m")]  # fmt: skip


@pytest.mark.parametrize("order", [">", "<"])
def test_inputs_of_either_byte_order_equal_native_ones(order):
    a = np.arange(24, dtype=np.float32).reshape(4, 6) / 7
    i = (np.arange(24, dtype=np.int32).reshape(4, 6) % 5) - 2
    swapped = [nm.tensor(v.astype(v.dtype.newbyteorder(order)), "b m") for v in (a, i)]
    native = [nm.tensor(v, "b m") for v in (a, i)]
    want = mixed(*native)
    assert all(w.dtype.isnative for w in want)
    compare(mixed(*swapped), want, rtol=0.0, what="eager")
    compare(nm.reference(nm.trace(mixed, *native))(*(s.data for s in swapped)), want, rtol=0.0,
            what="reference of arrays")  # fmt: skip
    compare(jax.jit(mixed)(*swapped), want, what="jit")
    compare(lower(mixed, MESH, "b:x")(*swapped), want, what="lowered")
    assert nm.zeros({"b": 2}, ">f4").dtype == np.float32
    assert nm.astype(swapped[1], ">f4").dtype == np.float32
