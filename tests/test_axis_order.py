"""A dim split over several mesh axes listed out of the mesh's order ("b:cols,rows" on
Mesh({"rows": 2, "cols": 4})): halo exchanges (shift, conv, pool) and every rule that
computes a position from the device's index, against NumPy (issue 13, item 3)."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lowering.ops as ops
import namedmesh as nm
from lowering import Mesh, lower

N = 16
R = np.random.default_rng(3)
X = R.normal(size=N).astype(np.float32)
W = R.normal(size=N).astype(np.float32)
K = np.array([0.5, -2.0, 3.0], np.float32)

CASES = [  # (mesh sizes, rule): every split of "b" over 2 or 3 axes out of mesh order
    ({"rows": 2, "cols": 4}, "b:cols,rows"),
    ({"x": 2, "y": 2, "z": 2}, "b:z,x"),
    ({"x": 2, "y": 2, "z": 2}, "b:z,y,x"),
    ({"x": 2, "y": 2, "z": 2}, "b:y,z,x"),
]


def np_shift(x, off, wrap=False, fill=0.0):
    if wrap:
        return np.roll(x, off)
    i = np.arange(len(x)) - off
    return np.where((i >= 0) & (i < len(x)), x[np.clip(i, 0, len(x) - 1)], fill).astype(x.dtype)


def np_conv_same(x, k):
    padded = np.concatenate([[0], x, [0]]).astype(np.float32)
    return sum(padded[j : j + len(x)] * k[j] for j in range(3)).astype(np.float32)


def np_pool_same(x, kind):
    fill = -np.inf if kind == "max" else 0.0
    padded = np.concatenate([[fill], x, [fill]]).astype(np.float32)
    windows = np.stack([padded[j : j + len(x)] for j in range(3)])
    return windows.max(0) if kind == "max" else windows.mean(0)


def linear_ops(x):
    """Ops linear in x along "b" (their gradients follow from NumPy by linearity)."""
    k = nm.tensor(K, "kb")
    return [
        nm.shift(x, "b", 1),
        nm.shift(x, "b", -2, fill=0.0),
        nm.shift(x, "b", 3, wrap=True),
        nm.shift(x, "b", -1, wrap=True),
        nm.conv(x, k, {"b": "kb"}, padding="SAME"),
        nm.cumsum(x, "b"),
        nm.cumsum(x, "b", reverse=True),
    ]


def np_linear_ops(x):
    return [
        np_shift(x, 1),
        np_shift(x, -2),
        np_shift(x, 3, wrap=True),
        np_shift(x, -1, wrap=True),
        np_conv_same(x, K),
        np.cumsum(x),
        np.cumsum(x[::-1])[::-1],
    ]


def all_ops(x):
    idx = nm.tensor(np.array([15, 0, 7, 8, -1, 4], np.int32), "i")
    return [
        *linear_ops(x),
        nm.pool(x, {"b": 3}, stride=1, padding="SAME"),
        nm.pool(x, {"b": 3}, stride=1, padding="SAME", kind="mean"),
        nm.arange("b", N, start=3, step=2) + x * 0,
        nm.argmax(x, "b"),
        nm.top_k(x, "b", 8)[1],
        nm.gather(x, "b", idx),
        nm.one_hot(nm.tensor(np.array([3, 12, -1, 15], np.int32), "i"), "b", N) * x,
    ]


def np_all_ops(x):
    idx = np.array([15, 0, 7, 8, -1, 4])
    onehot = np.array([3, 12, -1, 15])[:, None] == np.arange(N)
    return [
        *np_linear_ops(x),
        np_pool_same(x, "max"),
        np_pool_same(x, "mean"),
        3 + 2 * np.arange(N, dtype=np.int32),
        np.argmax(x),
        np.argsort(-x, kind="stable")[:8],
        x[idx],
        onehot * x,
    ]


@pytest.mark.parametrize("sizes, rule", CASES)
def test_position_arithmetic_over_out_of_order_axes_matches_numpy(sizes, rule):
    got = lower(all_ops, Mesh(sizes), rule)(nm.tensor(X, "b"))
    for n, (g, w) in enumerate(zip(got, np_all_ops(X), strict=True)):
        np.testing.assert_allclose(np.asarray(g.data), w, rtol=1e-5, atol=1e-5, err_msg=str(n))


def test_shift_of_arange_as_the_issue_reports_it():
    fn = lambda t: nm.shift(t, "b", 1)
    x = nm.tensor(np.arange(16, dtype=np.float32), "b")
    got = lower(fn, Mesh({"rows": 2, "cols": 4}), "b:cols,rows")(x)
    np.testing.assert_array_equal(np.asarray(got.data), np_shift(np.arange(16.0), 1))


@pytest.mark.parametrize("sizes, rule", CASES[:2])
def test_gradients_through_halos_over_out_of_order_axes_match_numpy(sizes, rule):
    """d/dx sum_n w . op_n(x) for the linear ops: by linearity, component i is
    sum_n w . op_n(e_i), computed with NumPy on the basis vectors e_i."""
    loss = lambda x: sum(nm.sum(op * nm.tensor(W, "b")) for op in linear_ops(x))
    lowered = lower(loss, Mesh(sizes), rule)
    got = jax.grad(lambda x: lowered(x).data)(nm.tensor(X, "b"))
    eye = np.eye(N, dtype=np.float32)
    want = [sum(float(W @ y) for y in np_linear_ops(e)) for e in eye]
    np.testing.assert_allclose(np.asarray(got.data), want, rtol=1e-4, atol=1e-4)


def test_ppermute_takes_pairs_in_the_numbering_of_axis_index():
    """The JAX fact the helper rests on, held at its interface: over ("cols", "rows")
    position p sends to p + 1, numbered as axis_index and the PartitionSpec number."""
    mesh = Mesh({"rows": 2, "cols": 4})
    axes = ("cols", "rows")

    def body(x):
        return ops.ppermute(x, axes, [(j, j + 1) for j in range(7)], mesh.sizes)

    spec = P(axes)
    x = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(mesh.jax_mesh, spec))
    got = jax.jit(jax.shard_map(body, mesh=mesh.jax_mesh, in_specs=spec, out_specs=spec))(x)
    np.testing.assert_array_equal(np.asarray(got), [0, 0, 1, 2, 3, 4, 5, 6])
