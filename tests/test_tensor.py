import jax
import jax.numpy as jnp
import numpy as np
import pytest

import namedmesh as nm
from namedmesh import ShapeError


def test_dims_as_string_or_tuple():
    a = nm.tensor(np.zeros((2, 3)), "batch d")
    b = nm.tensor(np.zeros((2, 3)), ("batch", "d"))
    assert a.dims == b.dims == ("batch", "d")
    assert a.sizes == {"batch": 2, "d": 3}
    assert a.shape == (2, 3)
    assert a.ndim == 2 and a.size == 6


def test_asarray_and_scalars():
    data = np.arange(6.0).reshape(2, 3)
    t = nm.tensor(data, "a b")
    np.testing.assert_array_equal(np.asarray(t), data)
    s = t.sum()
    assert s.dims == () and float(s) == 15.0 and s.item() == 15.0


def test_repr_shows_dims_sizes_and_values():
    t = nm.tensor(np.arange(6, dtype=np.float32).reshape(2, 3), "batch d")
    r = repr(t)
    assert "batch=2" in r and "d=3" in r and "f32" in r and "5." in r


@pytest.mark.parametrize(
    "data, dims, match",
    [
        (np.zeros((2, 3)), "a", "2 axes but 1 dims"),
        (np.zeros((2, 3)), "a a", "repeated dim name"),
        (np.zeros(2), ("",), "non-empty"),
    ],
)
def test_bad_construction(data, dims, match):
    with pytest.raises(ShapeError, match=match):
        nm.tensor(data, dims)


def test_size_of_unknown_dim_names_the_dims():
    t = nm.zeros({"a": 2, "b": 3})
    with pytest.raises(ShapeError, match=r"'c'.*\('a', 'b'\)"):
        t.size_of("c")


def test_constructors():
    z = nm.zeros({"a": 2, "b": 3})
    assert z.dtype == np.float32 and z.dims == ("a", "b") and not np.asarray(z).any()
    o = nm.ones({"a": 2}, dtype=np.int32)
    np.testing.assert_array_equal(o.data, np.ones(2, np.int32))
    f = nm.full({"x": 3}, 7)
    assert f.dtype == np.int32 and (f.data == 7).all()
    r = nm.arange("seq", 5)
    np.testing.assert_array_equal(r.data, np.arange(5))
    assert r.dims == ("seq",) and r.dtype == np.int32
    r2 = nm.arange("seq", 4, start=1.0, step=0.5)
    np.testing.assert_allclose(r2.data, [1.0, 1.5, 2.0, 2.5])
    like = nm.full_like(z, 2.5)
    assert like.sizes == z.sizes and (like.data == 2.5).all()
    assert nm.zeros_like(o).dtype == np.int32 and nm.ones_like(z).data.sum() == 6
    with pytest.raises(ShapeError, match="'a'"):
        nm.zeros({"a": -1})


def test_pytree_roundtrip_keeps_dims():
    t = nm.tensor(np.ones((2, 3), np.float32), "a b")
    leaves, tree = jax.tree_util.tree_flatten({"w": t})
    assert len(leaves) == 1 and leaves[0] is t.data
    back = jax.tree_util.tree_unflatten(tree, [x * 2 for x in leaves])["w"]
    assert back.dims == ("a", "b")
    np.testing.assert_array_equal(back.data, 2 * np.ones((2, 3)))


def test_jit_runs_the_jax_implementation():
    x = nm.tensor(np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32), "a b")
    w = nm.tensor(np.random.default_rng(1).normal(size=(4, 5)).astype(np.float32), "b c")
    f = jax.jit(lambda x, w: nm.tanh(nm.einsum(x, w)).sum("a"))
    out = f(x, w)
    assert isinstance(out.data, jax.Array) and out.dims == ("c",)
    np.testing.assert_allclose(out.data, np.tanh(x.data @ w.data).sum(0), rtol=1e-5)


def test_grad_through_named_ops_matches_hand_derivative():
    x = nm.tensor(np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32), "a b")
    w = nm.tensor(np.random.default_rng(1).normal(size=(4,)).astype(np.float32), "b")

    def loss(w):
        return (nm.einsum(x, w) ** 2).sum().data

    g = jax.grad(loss)(w)
    assert isinstance(g, nm.Tensor) and g.dims == ("b",)
    expected = 2 * x.data.T @ (x.data @ w.data)  # d/dw sum((xw)^2)
    np.testing.assert_allclose(g.data, expected, rtol=1e-5)


def test_jax_array_data_stays_jax():
    t = nm.tensor(jnp.ones((2, 2)), "a b")
    assert isinstance((t + 1).data, jax.Array)


def test_operators_match_numpy():
    a = np.random.default_rng(0).uniform(1, 2, size=(3,)).astype(np.float32)
    b = np.random.default_rng(1).uniform(1, 2, size=(3,)).astype(np.float32)
    x, y = nm.tensor(a, "i"), nm.tensor(b, "i")
    for got, want in [
        (x + y, a + b),
        (x - y, a - b),
        (x * y, a * b),
        (x / y, a / b),
        (x**y, a**b),
        (x // y, a // b),
        (x % y, a % b),
        (-x, -a),
        (abs(-x), a),
        (2 - x, 2 - a),
        (2 / x, 2 / a),
        (x < y, a < b),
        (x >= y, a >= b),
        (x == x, a == a),
        (x != y, a != b),
    ]:
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    m, n = x > 1.5, y > 1.5
    np.testing.assert_array_equal((m & n).data, (a > 1.5) & (b > 1.5))
    np.testing.assert_array_equal((m | n).data, (a > 1.5) | (b > 1.5))
    np.testing.assert_array_equal((m ^ n).data, (a > 1.5) ^ (b > 1.5))
    np.testing.assert_array_equal((~m).data, ~(a > 1.5))


def test_scalar_dtype_follows_the_tensor():
    x = nm.ones({"a": 2})
    assert (x * 2.0).dtype == np.float32
    assert (x + 1).dtype == np.float32
    i = nm.ones({"a": 2}, dtype=np.int32)
    assert (i + 1).dtype == np.int32
    assert (i * 0.5).dtype == np.float32
    assert (np.float32(2) * x).dtype == np.float32


def test_numpy_array_operand_without_dims_is_refused():
    with pytest.raises(TypeError, match="nm.tensor"):
        nm.ones({"a": 2}) + np.ones(2)


def test_astype():
    x = nm.tensor(np.array([1.7, -2.2]), "a")
    assert x.astype(np.int32).dtype == np.int32
    np.testing.assert_array_equal(x.astype(np.int32).data, [1, -2])


def test_jax_scalars_broadcast_like_python_scalars():
    x = nm.ones({"a": 2})
    np.testing.assert_array_equal((x * jnp.float32(2)).data, [2, 2])
    np.testing.assert_array_equal(jax.jit(lambda t, s: t * s)(x, 3.0).data, [3, 3])
