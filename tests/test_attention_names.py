"""nm.dot_product_attention's dims are the caller's names (issue 42 item 4): a program
over ("query", "key", "feature") equals the same program over the zoo's default
("length", "memory", "d_kv"), in value and gradient, on one device and lowered on a
layout that splits batch and heads (and one that splits the positions, relaid out
whole for the kernel); a name missing from q, k or v is refused naming the tensor, the
dim and the parameter."""

import jax
import numpy as np
import pytest

import namedmesh as nm
from lowering import Layout, Mesh, lower

R = np.random.default_rng(42)
DEFAULT = {"length": "length", "memory": "memory", "features": "d_kv"}
OTHER = {"length": "query", "memory": "key", "features": "feature"}
# q (batch, pos, heads, group, feat): two query heads per key head; k, v lack group;
# the bias over heads and the key positions
Q = R.normal(size=(2, 8, 4, 2, 4)).astype(np.float32)
K, V = (R.normal(size=(2, 4, 8, 4)).astype(np.float32) for _ in range(2))
B = R.normal(size=(4, 8)).astype(np.float32)
W = R.normal(size=Q.shape).astype(np.float32)  # the output's cotangent


def attention(names, kernel="auto"):
    """sum(attention * W) of Tensors q, k, v, b over dims named by `names`: a loss."""
    length, features = names["length"], names["features"]

    def loss(q, k, v, b):
        out = nm.dot_product_attention(
            q, k, v, b, scale=0.5, causal=True, window=5, kernel=kernel, **names
        )
        assert out.dims == ("batch", length, "heads", "group", features)
        return (out * nm.tensor(W, out.dims)).sum()

    return loss


def tensors(names, *arrays):
    """q, k, v, bias over the dims `names` names."""
    length, memory, features = names["length"], names["memory"], names["features"]
    dims = [("batch", length, "heads", "group", features), ("batch", "heads", memory, features),
            ("batch", "heads", memory, features), ("heads", memory)]  # fmt: skip
    return [nm.tensor(x, d) for x, d in zip(arrays, dims, strict=True)]


def value_and_grads(loss, names):
    """jit(value and gradients) of `loss` (of Tensors) as a function of the arrays."""
    of_arrays = lambda *xs: loss(*tensors(names, *xs)).data
    return jax.jit(jax.value_and_grad(of_arrays, argnums=(0, 1, 2, 3)))(Q, K, V, B)


def numpy_oracle():
    """float64 NumPy: grouped heads repeated, causal + window 5, the bias added."""
    q, k, v, b = (np.asarray(x, np.float64) for x in (Q, K, V, B))
    s = np.einsum("blhgd,bhmd->bhglm", q, k) * 0.5 + b[None, :, None, None, :]
    i, j = np.arange(8)[:, None], np.arange(8)[None, :]
    s = np.where((j <= i) & (j > i - 5), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (np.einsum("bhglm,bhmd->blhgd", p / p.sum(-1, keepdims=True), v) * W).sum()


@pytest.fixture(scope="module")
def default():
    """Value and gradients of the default-named program on one device, the value held
    to the NumPy oracle: what every other naming must give."""
    value, grads = value_and_grads(attention(DEFAULT), DEFAULT)
    np.testing.assert_allclose(float(value), numpy_oracle(), rtol=1e-5)
    return value, grads


def assert_same(got, want):
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for g, e in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel", ["xla", "flash"])
def test_other_names_equal_the_default_on_one_device(kernel, default):
    assert_same(value_and_grads(attention(OTHER, kernel), OTHER), default)


def test_other_names_in_numpy_equal_the_oracle():
    got = attention(OTHER)(*tensors(OTHER, Q, K, V, B))  # eager NumPy: the reference impl
    np.testing.assert_allclose(float(got.data), numpy_oracle(), rtol=1e-5)


@pytest.mark.parametrize("rules", ["batch:m0;heads:m1", "query:m0;key:m1;feature:m0,m1"])
def test_other_names_lowered_on_a_sharded_layout_equal_the_default(rules, default):
    """Batch and heads split; or the three named dims split (each relaid out whole for
    the kernel, by their names in the primitive's params)."""
    f = lower(attention(OTHER), Mesh({"m0": 2, "m1": 2}), Layout(rules))
    assert_same(value_and_grads(f, OTHER), default)


@pytest.mark.parametrize(
    "which, dims, missing, param",
    [
        ("q", ("batch", "pos", "heads", "group", "feature"), "query", "length"),
        ("k", ("batch", "heads", "key", "feat"), "feature", "features"),
        ("v", ("batch", "heads", "memory", "feature"), "key", "memory"),
    ],
)
def test_a_name_missing_from_q_k_or_v_is_refused_naming_tensor_dim_and_parameter(
    which, dims, missing, param
):
    q, k, v, _ = tensors(OTHER, Q, K, V, B)
    args = {"q": q, "k": k, "v": v}
    args[which] = nm.tensor(args[which].data, dims)
    with pytest.raises(nm.ShapeError) as e:
        nm.dot_product_attention(args["q"], args["k"], args["v"], **OTHER)
    msg = str(e.value)
    assert f"{which} {dims}" in msg and repr(missing) in msg and f"{param}=" in msg, msg


def test_names_that_are_not_three_distinct_dim_names_are_refused():
    q, k, v, _ = tensors(DEFAULT, Q, K, V, B)
    with pytest.raises(nm.ParameterError, match="length= and memory= both name dim 'pos'"):
        nm.dot_product_attention(q, k, v, length="pos", memory="pos")
    with pytest.raises(nm.ArgumentError, match="features= must be a dim name.*got 3"):
        nm.dot_product_attention(q, k, v, features=3)


def test_float64_is_computed_in_float64():
    """Under jax_enable_x64, float64 q, k, v give the float64 oracle to 1e-12, eagerly,
    under jit and lowered (jax.nn.dot_product_attention's softmax is float32: 1e-7)."""
    with jax.enable_x64(True):
        xs = [x.astype(np.float64) for x in (Q, K, V, B)]
        loss = attention(OTHER)
        eager = loss(*tensors(OTHER, *[jax.numpy.asarray(x) for x in xs])).data
        jitted = jax.jit(lambda *a: loss(*tensors(OTHER, *a)).data)(*xs)
        f = lower(loss, Mesh({"m0": 2}), Layout("heads:m0"))
        lowered = f(*tensors(OTHER, *xs)).data
        for got in (eager, jitted, lowered):
            assert got.dtype == np.float64
            np.testing.assert_allclose(float(got), numpy_oracle(), rtol=1e-12)
