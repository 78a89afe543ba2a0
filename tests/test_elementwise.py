import jax
import numpy as np
import pytest
import scipy.special
import xarray as xr
from hypothesis import given
from hypothesis import strategies as st

import namedmesh as nm
from namedmesh import ShapeError
from namedmesh.elementwise import BINARY_OPS, UNARY_OPS

rng = np.random.default_rng(0)


def pair(dims, sizes, low=-2.0, high=2.0):
    data = rng.uniform(low, high, size=[sizes[d] for d in dims]).astype(np.float32)
    return nm.tensor(data, dims), xr.DataArray(data, dims=dims)


def assert_same(t, da, rtol=1e-6):
    assert t.dims == tuple(da.dims), (t.dims, da.dims)
    np.testing.assert_allclose(np.asarray(t.data), da.values, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize(
    "a, b",
    [
        (("x", "y"), ("y",)),
        (("y",), ("x", "y")),
        (("x", "y"), ("y", "x")),
        (("x",), ("z",)),
        (("x", "y"), ("z", "y", "w")),
        ((), ("x",)),
    ],
)
def test_broadcasting_follows_xarray(a, b):
    sizes = {"x": 2, "y": 3, "z": 4, "w": 2}
    ta, da = pair(a, sizes)
    tb, db = pair(b, sizes)
    assert_same(ta + tb, da + db)
    assert_same(ta * tb, da * db)
    assert_same(nm.maximum(ta, tb), np.maximum(da, db))
    assert_same(ta < tb, da < db)


def test_where_broadcasts_like_xarray():
    sizes = {"x": 2, "y": 3, "z": 4}
    tc, dc = pair(("y",), sizes)
    tx, dx = pair(("x", "y"), sizes)
    ty, dy = pair(("z",), sizes)
    assert_same(nm.where(tc > 0, tx, ty), xr.where(dc > 0, dx, dy))
    assert nm.where(tc > 0, tx, 0).dtype == np.float32


NP_UNARY = {
    "negative": np.negative,
    "abs": np.abs,
    "sign": np.sign,
    "square": np.square,
    "reciprocal": np.reciprocal,
    "exp": np.exp,
    "log": np.log,
    "log1p": np.log1p,
    "expm1": np.expm1,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x),
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "tanh": np.tanh,
    "erf": scipy.special.erf,
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "relu": lambda x: np.maximum(x, 0),
    "gelu": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))),
    "silu": lambda x: x / (1 + np.exp(-x)),
    "floor": np.floor,
    "ceil": np.ceil,
    "round": np.round,
    "logical_not": lambda x: np.logical_not(x > 1),
    "isnan": np.isnan,
    "isfinite": np.isfinite,
}
NP_BINARY = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "divide": np.divide,
    "floor_divide": np.floor_divide,
    "mod": np.mod,
    "power": np.power,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "arctan2": np.arctan2,
    "equal": np.equal,
    "not_equal": np.not_equal,
    "less": np.less,
    "less_equal": np.less_equal,
    "greater": np.greater,
    "greater_equal": np.greater_equal,
    "logical_and": lambda a, b: np.logical_and(a > 1, b > 1),
    "logical_or": lambda a, b: np.logical_or(a > 1, b > 1),
    "logical_xor": lambda a, b: np.logical_xor(a > 1, b > 1),
}


def test_every_elementwise_op_has_an_oracle():
    assert set(NP_UNARY) == set(UNARY_OPS) and set(NP_BINARY) == set(BINARY_OPS)


@pytest.mark.parametrize("name", UNARY_OPS)
def test_unary_eager_and_jit_match_numpy(name):
    data = rng.uniform(0.1, 2.0, size=(3, 4)).astype(np.float32)
    x = nm.tensor(data, "a b")
    op = getattr(nm, name)
    arg = x > 1 if name == "logical_not" else x
    want = NP_UNARY[name](data)
    np.testing.assert_allclose(op(arg).data, want, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(jax.jit(op)(arg).data, want, rtol=2e-5, atol=1e-6)
    assert op(arg).dims == ("a", "b")


@pytest.mark.parametrize("name", BINARY_OPS)
def test_binary_eager_and_jit_match_numpy(name):
    a = rng.uniform(0.5, 2.0, size=(3, 4)).astype(np.float32)
    b = rng.uniform(0.5, 2.0, size=(4,)).astype(np.float32)
    x, y = nm.tensor(a, "i j"), nm.tensor(b, "j")
    op = getattr(nm, name)
    args = (x > 1, y > 1) if name.startswith("logical") else (x, y)
    want = NP_BINARY[name](a, b)
    np.testing.assert_allclose(op(*args).data, want, rtol=2e-6)
    np.testing.assert_allclose(jax.jit(op)(*args).data, want, rtol=2e-5)


def test_int_unary_float_ops_give_float32():
    i = nm.tensor(np.array([1, 4, 9], np.int32), "a")
    assert nm.sqrt(i).dtype == np.float32
    np.testing.assert_allclose(nm.sqrt(i).data, [1, 2, 3])
    np.testing.assert_allclose(nm.reciprocal(i).data, [1, 0.25, 1 / 9], rtol=1e-6)
    assert (i / i).dtype == np.float32


def test_clip():
    x = nm.tensor(np.array([-2.0, 0.5, 3.0]), "a")
    np.testing.assert_array_equal(nm.clip(x, -1, 1).data, [-1, 0.5, 1])


def test_size_mismatch_names_the_dim_and_both_operands():
    with pytest.raises(ShapeError, match=r"dim 'y' has size 3 in operand 0 \(x: 2, y: 3\) but 4"):
        nm.zeros({"x": 2, "y": 3}) + nm.zeros({"y": 4})


@given(
    st.permutations(["p", "q", "r"]).map(lambda p: p[:2]),
    st.permutations(["p", "q", "r"]).map(lambda p: p[1:]),
    st.sampled_from(["add", "subtract", "multiply", "maximum"]),
)
def test_random_broadcasts_match_xarray(a, b, op):
    sizes = {"p": 2, "q": 3, "r": 4}
    ta, da = pair(tuple(a), sizes)
    tb, db = pair(tuple(b), sizes)
    xr_op = {
        "add": lambda u, v: u + v,
        "subtract": lambda u, v: u - v,
        "multiply": lambda u, v: u * v,
        "maximum": lambda u, v: np.maximum(u, v),
    }[op]
    assert_same(getattr(nm, op)(ta, tb), xr_op(da, db))


def test_bfloat16_promotes_like_jax():
    """bfloat16 (NumPy kind 'V') is a float: ints never widen it, float32 wins over it."""
    import jax.numpy as jnp

    from namedmesh.primitive import result_dtype

    bf16 = np.dtype(jnp.bfloat16)
    assert result_dtype(bf16, np.int32) == bf16
    assert result_dtype(bf16, np.float32) == np.float32
    assert result_dtype(bf16, bf16) == bf16
    x = nm.tensor(np.ones((2, 3), bf16), "a b")
    assert (x * nm.tensor(np.arange(3, dtype=np.int32), "b")).dtype == bf16
