"""nm.update_slice against a NumPy loop: eagerly, under jax.jit, lowered on a 2x4 mesh
whatever the layout splits, its gradient, and typed errors naming what is wrong."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, lower
from namedmesh import DtypeError, ShapeError

R = np.random.default_rng(0)
X = R.standard_normal((4, 6, 2)).astype(np.float32)  # (b, m, h)
V = R.standard_normal((4, 2, 2)).astype(np.float32)  # a window of 2 along m
STARTS = np.array([0, 5, 2, 3], np.int32)  # 5: clamped to 4, so the window fits


def oracle(x, start, v):
    out = x.copy()
    for i in range(len(x)):
        at = min(max(int(np.broadcast_to(start, len(x))[i]), 0), x.shape[1] - v.shape[1])
        out[i, at : at + v.shape[1]] = v[i]
    return out


def put(x, start, v):
    dims = ("b",) if np.ndim(start) else ()
    return nm.update_slice(
        nm.tensor(x, "b m h"), "m", nm.tensor(start, dims), nm.tensor(v, "b m h")
    )


@pytest.mark.parametrize("start", [STARTS, np.int32(3)])
def test_eager_and_jit_write_the_window(start):
    want = oracle(X, start, V)
    np.testing.assert_array_equal(put(X, start, V).data, want)
    jitted = jax.jit(put)(jnp.asarray(X), jnp.asarray(start), jnp.asarray(V))
    np.testing.assert_array_equal(np.asarray(jitted.data), want)
    # value and starts given in other dim orders
    v = nm.tensor(V.transpose(2, 0, 1), "h b m")
    got = nm.update_slice(nm.tensor(X, "b m h"), "m", nm.tensor(start, ("b",) * np.ndim(start)), v)
    np.testing.assert_array_equal(got.data, want)


def test_starts_over_two_dims_write_each_pair():
    start = R.integers(0, 6, (2, 4)).astype(np.int32)  # over (h, b)
    v = R.standard_normal((4, 1, 2)).astype(np.float32)
    want = X.copy()
    for h in range(2):
        for b in range(4):
            want[b, start[h, b], h] = v[b, 0, h]
    got = nm.update_slice(
        nm.tensor(X, "b m h"), "m", nm.tensor(start, "h b"), nm.tensor(v, "b m h")
    )
    np.testing.assert_array_equal(got.data, want)
    jitted = jax.jit(lambda x, s, v: nm.update_slice(x, "m", s, v))(
        nm.tensor(jnp.asarray(X), "b m h"), nm.tensor(jnp.asarray(start), "h b"),
        nm.tensor(jnp.asarray(v), "b m h"),
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(jitted.data), want)


@pytest.mark.parametrize("rules", ["b:data;h:model", "b:model;m:data", "h:data;m:model", ""])
def test_lowered_writes_per_shard(rules):
    f = lower(lambda x, s, v: nm.update_slice(x, "m", s, v), Mesh({"data": 2, "model": 2}), rules)
    got = f(nm.tensor(X, "b m h"), nm.tensor(STARTS, "b"), nm.tensor(V, "b m h"))
    np.testing.assert_array_equal(np.asarray(got.data), oracle(X, STARTS, V))


def test_gradients_flow_to_the_tensor_outside_the_window_and_to_the_value():
    w = R.standard_normal(X.shape).astype(np.float32)
    loss = lambda x, v: (put(x, STARTS, v) * nm.tensor(w, "b m h")).sum().data
    gx, gv = jax.grad(loss, argnums=(0, 1))(jnp.asarray(X), jnp.asarray(V))
    written = oracle(np.zeros_like(X), STARTS, np.ones_like(V)).astype(bool)
    np.testing.assert_array_equal(np.asarray(gx), np.where(written, 0, w))
    windows = [w[i, a : a + 2] for i, a in enumerate(np.minimum(STARTS, 4))]
    np.testing.assert_array_equal(np.asarray(gv), np.stack(windows))


def test_bad_input_names_the_fault():
    x, v = nm.tensor(X, "b m h"), nm.tensor(V, "b m h")
    with pytest.raises(ShapeError, match="start must be integers"):
        nm.update_slice(x, "m", nm.tensor(np.float32(1), ()), v)
    with pytest.raises(ShapeError, match=r"start's dim\(s\) \['m'\]"):
        nm.update_slice(x, "m", nm.tensor(np.zeros(6, np.int32), "m"), v)
    zero = nm.tensor(np.int32(0), ())
    with pytest.raises(ShapeError, match="'m' must be at most 6"):
        nm.update_slice(x, "m", zero, nm.tensor(np.zeros((4, 7, 2), np.float32), "b m h"))
    with pytest.raises(ShapeError, match="must have the tensor's dims"):
        nm.update_slice(x, "m", zero, nm.tensor(V[..., 0], "b m"))
    with pytest.raises(DtypeError, match="value is float64 but the tensor is float32"):
        nm.update_slice(x, "m", zero, nm.tensor(V.astype(np.float64), "b m h"))
    with pytest.raises(ShapeError, match="'q'"):
        nm.update_slice(x, "q", zero, v)
