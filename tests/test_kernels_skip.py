"""Blockwise attention under a causal mask or a sliding window visits only the key
blocks the mask does not hide whole (models.layers.blockwise.visible_blocks): its values and
gradients against NumPy and plain jax.numpy (grouped heads, soft-caps, biases, lengths
the block does not divide), which blocks it visits against the mask itself, and the
compiled program's loops against the triangle's count of block pairs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import namedmesh as nm
from models.layers.blockwise import visible_blocks
from models.layers.kernels import KERNELS, Options

R = np.random.default_rng(5)
NEG = np.float32(-1e9)
QD = ("batch", "length", "kv_heads", "q_per_kv", "d_kv")
KD = ("batch", "memory", "kv_heads", "d_kv")
SIZES = {"batch": 2, "kv_heads": 2, "q_per_kv": 2, "d_kv": 4}


def allowed(n: int, causal: bool, window: int) -> np.ndarray:
    """(length, memory) bools: which keys each query sees."""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    ok = np.ones((n, n), bool)
    if causal:
        ok &= j <= i
    if window:
        ok &= j > i - window
    return ok


def mask_fn(causal: bool, window: int):
    """The mask as transformer.self_attention_bias builds it from positions."""

    def fn(queries, slots):
        out = nm.where(slots <= queries, 0.0, NEG) if causal else None
        if window:
            w = nm.where(slots > queries - window, 0.0, NEG)
            out = w if out is None else out + w
        return out

    return fn


def reference(q, k, v, bias, ok, scale, cap, xp):
    """Attention on positional arrays q (b l g p d), k/v (b m g d), bias (b g l m):
    NumPy or jax.numpy (`xp`), written apart from the kernels."""
    s = xp.einsum("blgpd,bmgd->bgplm", q, k) * scale
    if cap:
        s = cap * xp.tanh(s / cap)
    s = s + bias[:, :, None] + xp.where(ok, 0.0, NEG)
    w = xp.exp(s - s.max(-1, keepdims=True))
    return xp.einsum("bgplm,bmgd->blgpd", w / w.sum(-1, keepdims=True), v)


CASES = {  # name: (length, block, causal, window, softcap, bias dims)
    "causal, grouped heads, padding bias": (8, 2, True, 0, 0.0, ("batch", "memory")),
    "causal + window, block not dividing, t5 bias, cap": (
        8, 3, True, 3, 2.0, ("kv_heads", "length", "memory"),
    ),
    "causal, 7 positions in blocks of 4, per-query bias": (7, 4, True, 0, 0.0, ("length",)),
    "window alone (both sides of the query)": (8, 2, False, 3, 0.0, None),
    "one block": (5, 8, True, 0, 0.0, None),
    "19 positions: 10 key blocks, 5 query blocks of 4 + window": (19, 2, True, 5, 0.0, None),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_skipping_blockwise_equals_numpy_values_and_jnp_gradients(case):
    n, block, causal, window, cap, bias_dims = CASES[case]
    sizes = {**SIZES, "length": n, "memory": n}
    q, k, v = (R.normal(size=[sizes[d] for d in dims]).astype(np.float32) for dims in (QD, KD, KD))
    order = ("batch", "kv_heads", "length", "memory")
    bias = np.zeros([sizes[d] for d in order], np.float32)
    b_t = None
    if bias_dims:
        b = R.normal(size=[sizes[d] for d in bias_dims]).astype(np.float32)
        b_t = nm.tensor(b, bias_dims)
        shape = [sizes[d] if d in bias_dims else 1 for d in order]
        bias = bias + b.transpose([bias_dims.index(d) for d in order if d in bias_dims]).reshape(
            shape
        )
    ok, scale = allowed(n, causal, window), 0.5
    opts = Options(b_t, mask_fn(causal, window), scale, cap, block, causal=causal, window=window)

    def kernel(q, k, v):
        t = nm.tensor
        return KERNELS["blockwise"].fn(t(q, QD), t(k, KD), t(v, KD), opts).transpose(*QD).data

    want = reference(q, k, v, bias, ok, scale, cap, np)
    w = R.normal(size=want.shape).astype(np.float32)  # a cotangent that is not all ones

    def value_and_grads(f):  # one compiled program: the values and w's pullback
        out, back = jax.vjp(f, q, k, v)
        return out, back(w)

    got, grads = jax.jit(lambda: value_and_grads(kernel))()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    ref = lambda q, k, v: reference(q, k, v, jnp.asarray(bias), ok, scale, cap, jnp)
    for got, exp in zip(grads, value_and_grads(ref)[1], strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(exp), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal, window", [(True, 0), (True, 5), (True, 8), (False, 6)])
@pytest.mark.parametrize("rows, block", [(2, 2), (3, 3), (4, 4), (4, 2), (6, 3), (12, 4)])
def test_visible_blocks_are_those_the_mask_does_not_hide_whole(causal, window, rows, block):
    n, nb = 12, 12 // block
    ok = allowed(n, causal, window)
    for i in range(n // rows):
        seen = visible_blocks(i, rows, block, nb, causal, window)
        for j in range(nb):
            tile = ok[i * rows : (i + 1) * rows, j * block : (j + 1) * block]
            assert (j in seen) == bool(tile.any()), (i, j, list(seen))


def test_causal_program_visits_the_triangle_of_block_pairs():
    """XLA's compiled program: each query block's scan is a while loop whose trip count
    is its number of key blocks (a loop of one step is inlined), so the trip counts sum
    to the n(n+1)/2 pairs of the lower triangle, not the n * n of the square, which the
    unmasked program's one loop over all queries covers in n steps of n query blocks."""
    n, block = 64, 8
    x = jnp.asarray(R.normal(size=(n, 2, 16)), jnp.float32)

    def trips(causal):
        def f(q, k, v):
            t = lambda a, dim: nm.tensor(a, (dim, "heads", "d_kv"))
            opts = Options(bias_fn=mask_fn(causal, 0), block=block, causal=causal)
            return KERNELS["blockwise"].fn(t(q, "length"), t(k, "memory"), t(v, "memory"), opts)

        text = jax.jit(lambda *a: f(*a).data).lower(x, x, x).compile().as_text()
        return [int(c) for c in re.findall(r'known_trip_count":\{"n":"(\d+)"', text)]

    nb = n // block
    causal = trips(True)
    assert len(causal) >= nb - 1 and sum(causal) + (len(causal) < nb) == nb * (nb + 1) // 2
    assert trips(False) == [nb]  # the square: nb steps, each over all nb query blocks
