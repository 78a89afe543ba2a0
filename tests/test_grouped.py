"""The grouped matmul's jax kernel (namedmesh/grouped.py `grouped_rows`: rows sorted by
group, each group's rows by blocks against its weight, a custom vjp) equals NumPy's
statement of the product (`nm.grouped_matmul` on NumPy data) and, for its gradients,
jax.grad of a dense one-hot product, whatever the groups' sizes: uneven, empty,
outside [0, groups) (zero rows), in float32 and bfloat16; and its training step holds no
per-block copies of the weight."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import namedmesh as nm
from namedmesh.grouped import block_sizes, grouped_rows

R = np.random.default_rng(0)
GROUPS = 4


def skewed(n: int) -> np.ndarray:
    """n groups: most rows in group 1, a few in 0 and 3, none in 2, some outside (-1, 4)."""
    return R.choice([-1, 0, 1, 3, 4], size=n, p=[0.05, 0.1, 0.7, 0.1, 0.05]).astype(np.int32)


def dense(x, w, g):
    """The one-hot reference: every row times every group's weight, masked."""
    return jnp.einsum("ne,nc,eco->no", jax.nn.one_hot(g, w.shape[0], dtype=x.dtype), x, w)


def loss(rows):
    return lambda x, w, g: jnp.sum(jnp.sin(rows(x, w, g).astype(jnp.float32)) * 3.0)


# 5 rows: one block of 8; 300: blocks of 128, 64, 32, 16 and 8 within one group
@pytest.mark.parametrize("n", [5, 300])
def test_values_and_gradients_equal_numpy_and_the_dense_one_hot_product(n):
    x = R.normal(size=(n, 12)).astype(np.float32)
    w = R.normal(size=(GROUPS, 12, 9)).astype(np.float32)
    g = skewed(n)
    want = nm.grouped_matmul(nm.tensor(x, "t d"), nm.tensor(w, "e d f"), nm.tensor(g, "t"), "e")
    got = jax.jit(grouped_rows)(x, w, g)
    np.testing.assert_allclose(got, want.data, rtol=1e-5, atol=1e-5)
    assert not np.asarray(got)[(g < 0) | (g >= GROUPS)].any()  # outside: zero rows
    grads = jax.jit(jax.grad(loss(grouped_rows), (0, 1)))(x, w, g)
    for a, b in zip(grads, jax.jit(jax.grad(loss(dense), (0, 1)))(x, w, g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert not np.asarray(grads[1])[2].any()  # the empty group's weight: no gradient


def test_bfloat16_sums_in_float32_and_keeps_its_dtype():
    """Each product of bfloat16 operands summed in float32 and rounded once (NumPy's
    statement); the gradients bfloat16, within bfloat16's rounding of the float32 ones."""
    n = 200
    x = R.normal(size=(n, 16)).astype(jnp.bfloat16)
    w = R.normal(size=(GROUPS, 16, 8)).astype(jnp.bfloat16)
    g = skewed(n)
    want = nm.grouped_matmul(nm.tensor(x, "t d"), nm.tensor(w, "e d f"), nm.tensor(g, "t"), "e")
    got = jax.jit(grouped_rows)(x, w, g)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), want.data.astype(np.float32))
    low = jax.jit(jax.grad(loss(grouped_rows), (0, 1)))(x, w, g)
    wide = jax.jit(jax.grad(loss(dense), (0, 1)))(x.astype(np.float32), w.astype(np.float32), g)
    for a, b in zip(low, wide, strict=True):
        assert a.dtype == jnp.bfloat16
        scale = float(jnp.abs(b).max())
        np.testing.assert_allclose(np.asarray(a, np.float32), b, atol=0.02 * scale)


def test_block_sizes_halve_from_at_most_128_rows_down_to_8():
    assert block_sizes(1024) == (128, 64, 32, 16, 8)
    assert block_sizes(40) == (32, 16, 8)
    assert block_sizes(3) == (8,)


def test_training_step_holds_no_per_block_weight_copies():
    """XLA's temporary bytes of the compiled value and gradient stay within twice the
    rows' and the weights' bytes (a block-by-block gather of the weight, the earlier
    kernel, held blocks x d x f: 4.5 times them here)."""
    n, d, f, e = 1024, 64, 256, 8
    g = jnp.asarray(R.integers(0, e, size=n).astype(np.int32))
    x, w = jnp.ones((n, d)), jnp.ones((e, d, f))
    step = jax.jit(jax.value_and_grad(lambda x, w: (grouped_rows(x, w, g) ** 2).sum(), (0, 1)))
    temp = step.lower(x, w).compile().memory_analysis().temp_size_in_bytes
    assert temp <= 2 * 4 * (n * (d + f) + e * d * f)


# the weight split over its groups: rows whole there (each device its groups' rows, a
# psum combines), or split there and over another axis too (rows sent to their groups'
# devices by all_to_all; the weight's gradient varies over both axes in the custom vjp
# and is summed over the other)
@pytest.mark.parametrize("layout", ["experts:e;t:d", "experts:e;t:e,d"])
def test_gradients_with_the_weight_split_over_its_groups_equal_the_dense_product(layout):
    from lowering import Mesh, lower

    x = R.normal(size=(64, 6)).astype(np.float32)
    w = R.normal(size=(GROUPS, 6, 5)).astype(np.float32)
    g = skewed(64)
    f = lower(lambda x, w, g: nm.grouped_matmul(x, w, g), Mesh({"e": 4, "d": 2}), layout)
    named = lambda x, w: f(nm.tensor(x, "t d"), nm.tensor(w, "experts d f"), nm.tensor(g, "t"))  # noqa: E731
    got = jax.grad(lambda x, w: jnp.sum(jnp.sin(named(x, w).data)), (0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(jnp.sin(dense(x, w, g))), (0, 1))(x, w)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
