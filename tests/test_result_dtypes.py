"""Issue 26, classes 2 and 3, against NumPy computed here: a float-valued op of integers
or bools computes in its float result's dtype (softmax of int8 subtracted its max in
int8, which wraps); a bool moved along a split dim stays bool (a psum made it int32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

import namedmesh as nm
from lowering import Layout, Mesh, lower

MESH = Mesh({"m": 2, "n": 2})
X8 = np.array([[-128, 127, 0, 5], [1, -1, 100, -100]], np.int8)
X32 = np.array([[-(2**31), 2**31 - 1, 0, 5], [7, 7, 7, 7]], np.int32)
XB = np.array([[True, False, True, True], [False, False, False, False]])


def every_path(fn, x, layout="d:m,n"):
    """(path, result array) of fn on x eagerly in NumPy, in jax, under jit and lowered
    with `d` split."""
    jx = jnp.asarray(x)
    yield "numpy", fn(nm.tensor(x, "r d")).data
    yield "jax", fn(nm.tensor(jx, "r d")).data
    yield "jit", jax.jit(lambda a: fn(nm.tensor(a, "r d")).data)(jx)
    yield "lowered", lower(fn, MESH, Layout(layout))(nm.tensor(x, "r d")).data


FLOAT_OPS = {  # op -> NumPy on the float32 input, by hand
    "softmax": lambda x: scipy.special.softmax(x, axis=1),
    "log_softmax": lambda x: scipy.special.log_softmax(x, axis=1),
    "logsumexp": lambda x: scipy.special.logsumexp(x, axis=1),
    "mean": lambda x: x.mean(axis=1, dtype=np.float32),
    "var": lambda x: x.var(axis=1, dtype=np.float32),
    "std": lambda x: x.std(axis=1, dtype=np.float32),
}


@pytest.mark.parametrize("x", [X8, X8.astype(np.uint8), X32, XB], ids=lambda x: str(x.dtype))
@pytest.mark.parametrize("op", list(FLOAT_OPS))
def test_normalisations_of_integers_and_bools_compute_in_float32(op, x):
    want = FLOAT_OPS[op](x.astype(np.float32))
    for path, got in every_path(lambda t: getattr(nm, op)(t, "d"), x):
        assert got.dtype == np.float32, (path, got.dtype)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=1e-30, err_msg=path)


def test_softmax_of_int8_ends_is_the_distribution_not_the_wrapped_one():
    # 127 - (-128) wraps to -1 in int8: the old answer put 0.73 on -128
    for path, got in every_path(lambda t: nm.softmax(t, "d"), X8[:1]):
        np.testing.assert_allclose(np.asarray(got), [[0, 1, 0, 0]], atol=1e-30, err_msg=path)


@pytest.mark.parametrize("op", ["exp", "sqrt", "tanh", "sigmoid", "reciprocal", "log1p"])
def test_unary_float_ops_of_int8_compute_in_float32(op):
    # NumPy's exp of int8 is float16 (exp(100) overflowed to inf); jax's is float32
    x = np.array([[100, 12, 3, 1]], np.int8)
    np_fn = {"sigmoid": scipy.special.expit, "reciprocal": lambda v: 1 / v}.get(op)
    want = (np_fn or getattr(np, op))(x.astype(np.float32))
    for path, got in every_path(getattr(nm, op), x):
        assert got.dtype == np.float32, (path, got.dtype)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=1e-30, err_msg=path)


def test_mean_pool_of_int32_computes_in_float32():
    x = np.array([[2**31 - 1, 2**31 - 1, -5, 6]], np.int32)
    want = x.astype(np.float32).reshape(1, 2, 2).mean(axis=2, dtype=np.float32)
    for path, got in every_path(lambda t: nm.pool(t, {"d": 2}, kind="mean"), x, "d:m"):
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=path)


@pytest.mark.parametrize("op", ["negative", "subtract", "sign"])
def test_ops_bools_have_no_meaning_for_are_typed_errors(op):
    x = nm.tensor(XB, "r d")
    for data in (XB, jnp.asarray(XB)):
        with pytest.raises(nm.DtypeError, match=rf"{op} of a bool tensor \(r: 2, d: 4\)"):
            getattr(nm, op)(*[nm.tensor(data, "r d")] * (2 if op == "subtract" else 1))
    with pytest.raises(nm.DtypeError, match=op):
        lower(lambda t: getattr(nm, op)(*[t] * (2 if op == "subtract" else 1)), MESH, "")(x)


@pytest.mark.parametrize("op", ["square", "relu", "power", "mod", "round"])
def test_bool_arithmetic_keeps_numpys_bool_in_jax(op):
    fn = {"power": lambda t: t**t, "mod": lambda t: nm.mod(t, nm.ones_like(t))}.get(op)
    fn = fn or getattr(nm, op)
    want = {"power": XB**XB, "mod": np.mod(XB, True)}.get(op)
    want = getattr(np, op)(XB) if want is None and op != "relu" else want
    want = np.maximum(XB, False) if op == "relu" else want
    for path, got in every_path(fn, XB):
        assert got.dtype == np.bool_, (path, got.dtype)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=path)


BOOL = np.array([[True, False, False, True, True, True, False, False]] * 2)
IDX = np.array([7, 0, 3, 4], np.int32)
STRUCTURAL = {  # op -> (namedmesh, NumPy)
    "gather": (lambda t: nm.gather(t, "d", nm.tensor(IDX, "i")), lambda x: x[:, IDX]),
    "slice": (lambda t: nm.slice(t, "d", 2, 6), lambda x: x[:, 2:6]),
    "pad": (lambda t: nm.pad(t, {"d": (2, 2)}), lambda x: np.pad(x, ((0, 0), (2, 2)))),
    "max_pool": (
        lambda t: nm.pool(t, {"d": 3}, stride=1, padding="SAME"),
        lambda x: np.stack([x[:, max(i - 1, 0) : i + 2].max(1) for i in range(8)], 1),
    ),
    "top_k": (lambda t: nm.top_k(t, "d", 4, "k")[0], lambda x: -np.sort(-x.astype(int), 1)[:, :4]),
    "reshape": (lambda t: nm.reshape(t, {"a": 2, "b": 4}, "d"), lambda x: x.reshape(2, 2, 4)),
    "squeeze": (lambda t: nm.squeeze(nm.slice(t, "d", 3, 4), "d"), lambda x: x[:, 3]),
    "shift": (
        lambda t: nm.shift(t, "d", 3, fill=True),
        lambda x: np.pad(x, ((0, 0), (3, 0)), constant_values=True)[:, :8],
    ),
}


@pytest.mark.parametrize("layout", ["d:m", "d:n,m", "r:m"])
@pytest.mark.parametrize("op", list(STRUCTURAL))
def test_bool_along_a_split_dim_stays_bool(op, layout):
    fn, np_fn = STRUCTURAL[op]
    got = lower(lambda t: ~fn(t), MESH, Layout(layout))(nm.tensor(BOOL, "r d"))
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(np.asarray(got), ~np_fn(BOOL).astype(bool))
