"""`nm.grouped_ffn`, a mixture of experts' whole expert FFN as one op, equals a float64
NumPy statement of it row by row (every activation, gated or not, groups outside the
range giving zero rows, one expert holding most rows), in NumPy, jax and bfloat16; its
gradients are the dense one-hot statement's at any load (every choice on one expert
too); names its errors; and lowered on 8 devices, with the experts split where the rows
are (each row routed to its expert's device once) or not, and the hidden layer split,
gives NumPy's values and the gradients of a dense one-hot statement."""

import contextlib
import functools
import io
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, lower

R = np.random.default_rng(0)
E = 4
X = R.normal(size=(8, 3, 5)).astype(np.float32)  # (t, s, d): 24 tokens
WI = R.normal(size=(E, 5, 8)).astype(np.float32) * 0.5  # (experts, d, f)
WG = R.normal(size=(E, 8, 5)).astype(np.float32) * 0.5  # (experts, f, d): wi's dims reordered
WO = R.normal(size=(E, 8, 3)).astype(np.float32) * 0.5  # (experts, f, o)
# (t, s, k); -1 and E: zero rows; expert 1 holds most rows (several of the kernel's
# blocks: namedmesh/grouped_slots.py), expert 2 few
G = R.choice([-1, 0, 1, 2, 3, 4], size=(8, 3, 2), p=[0.05, 0.1, 0.6, 0.05, 0.15, 0.05])
G = G.astype(np.int32)
ACTS = {
    "relu": lambda a: np.maximum(a, 0),
    "gelu": lambda a: 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3))),
    "gelu_exact": lambda a: a * 0.5 * (1 + np.vectorize(math.erf)(a / math.sqrt(2))),
    "silu": lambda a: a / (1 + np.exp(-a)),
}


def oracle(x, g, act, gated):
    """Row by row in float64: act(x wi[e]) (* x wg[e]^T) wo[e], zero outside [0, E)."""
    out = np.zeros(g.shape + (WO.shape[-1],))
    for i in np.ndindex(g.shape):
        e = g[i]
        if 0 <= e < E:
            row = x[i[:-1]].astype(np.float64)
            h = ACTS[act](row @ WI[e]) * ((row @ WG[e].T) if gated else 1.0)
            out[i] = h @ WO[e]
    return out


DIMS = ("t s d", "experts d f", "experts f o", "t s k", "experts f d")


def named(x, wi, wo, g, wg=None, act="silu"):
    """nm.grouped_ffn of arrays, named as DIMS."""
    x, wi, wo, g, *wg = (nm.tensor(a, d) for a, d in zip((x, wi, wo, g, wg), DIMS, strict=True)
                         if a is not None)  # fmt: skip
    return nm.grouped_ffn(x, wi, wo, g, *wg, activation=act)


def test_equals_a_float64_statement_row_by_row():
    """Every activation, gated (wg given) or not, by NumPy's implementation and jax's
    kernel (one jit of the four)."""
    cases = [("relu", False), ("gelu", True), ("gelu_exact", False), ("silu", True)]
    wgs = [WG if gated else None for _, gated in cases]
    kernels = jax.jit(lambda x, wg: [named(x, WI, WO, G, wg if gated else None, act).data
                                     for act, gated in cases])  # fmt: skip
    for (act, gated), wg, jax_got in zip(cases, wgs, kernels(X, WG), strict=True):
        want = oracle(X, G, act, gated)
        got = named(X, WI, WO, G, wg, act)
        assert got.dims == ("t", "s", "k", "o") and got.dtype == np.float32
        np.testing.assert_allclose(got.data, want, rtol=2e-5, atol=2e-5, err_msg=act)
        np.testing.assert_allclose(jax_got, want, rtol=2e-5, atol=2e-5, err_msg=act)
        assert not got.data[(G < 0) | (G >= E)].any()


def test_bfloat16_is_the_grouped_matmuls_it_states():
    """In bfloat16 each product is summed in float32 and rounded, as the grouped matmuls
    and the activation it stands for compute it: equal to their composition, bit for bit,
    at an uneven load (G) and an even one (G_EVEN)."""

    def both(x, wi, wo, wg, g):
        got = named(x, wi, wo, g, wg)
        x, wi, wo, g, wg = (nm.tensor(a, d) for a, d in zip((x, wi, wo, g, wg), DIMS, strict=True))
        h = nm.silu(nm.grouped_matmul(x, wi, g)) * nm.grouped_matmul(x, wg, g)
        return got.data, nm.grouped_matmul(h, wo, g).data

    run = jax.jit(both)
    for g in (G, G_EVEN):
        got, want = run(*(jnp.asarray(a, jnp.bfloat16) for a in (X, WI, WO, WG)), g)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_names_its_errors():
    with pytest.raises(nm.ParameterError, match="grouped_ffn: activation must be one of"):
        named(X, WI, WO, G, act="tanh")
    with pytest.raises(nm.DtypeError, match=r"grouped_ffn: x \('t', 's', 'd'\) must be a float"):
        named(X.astype(np.int32), WI, WO, G)
    with pytest.raises(nm.ShapeError, match="wg .* must have the dims and sizes of wi"):
        named(X, WI, WO, G, WG[:, :4])
    with pytest.raises(nm.ShapeError, match="grouped_ffn: dim 'f' has size 8"):
        named(X, WI, WO[:, :7], G)


def dense_loss(x, wi, wo, wg, g):
    """The one-hot statement (every row times every expert's weights, masked), for its
    gradients: sum(sin(out))."""
    onehot = jax.nn.one_hot(g, E, dtype=x.dtype)  # (t, s, k, experts); zero outside
    a = jnp.einsum("tsd,edf->tsef", x, wi)
    h = jax.nn.silu(a) * jnp.einsum("tsd,efd->tsef", x, wg)
    return jnp.sum(jnp.sin(jnp.einsum("tske,tsef,efo->tsko", onehot, h, wo)))


# G: an uneven load (expert 1 most rows); G_EVEN an even one (a fifth of the rows
# outside); test_gradients_at_any_load also puts every choice on expert 2 but a few
# outside the range
G_EVEN = (np.arange(G.size) % 5 - 1).reshape(G.shape).astype(np.int32)
dense_value_and_grads = jax.jit(jax.value_and_grad(dense_loss, (0, 1, 2, 3)))


@functools.cache
def dense_grads():
    return dense_value_and_grads(X, WI, WO, WG, G)[1]


def test_gradients_at_any_load():
    """On one device, the value and gradients of the dense one-hot statement's, 512 rows
    (one program): at an even load, with every choice on one expert, and at G's uneven
    load, each group's rows in blocks of 512 down to 16 rows by its count's binary
    digits (grouped_slots.loop_blocks; 48 rows would be blocks of 8 only)."""
    loss = lambda x, wi, wo, wg, g: jnp.sum(jnp.sin(named(x, wi, wo, g, wg).data))  # noqa: E731
    grad = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))
    x = R.normal(size=(64, 4, 5)).astype(np.float32) * 0.5
    shape = x.shape[:2] + (2,)
    even = (np.arange(math.prod(shape)) % 5 - 1).reshape(shape)
    one = np.where(R.random(shape) < 0.1, -1, 2)
    uneven = R.choice([-1, 0, 1, 2, 3, 4], size=shape, p=[0.05, 0.1, 0.6, 0.05, 0.15, 0.05])
    for g in (even, one, uneven):
        value, grads = grad(x, WI, WO, WG, g.astype(np.int32))
        want, wants = dense_value_and_grads(x, WI, WO, WG, g.astype(np.int32))
        np.testing.assert_allclose(value, want, rtol=1e-5)
        for name, a, b in zip(("x", "wi", "wo", "wg"), grads, wants, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_groups_blocks_cover_its_rows_once():
    """grouped_slots.over_group visits blocks covering a group's rows [first, first +
    count) exactly once each, reaching past them by less than a smallest block, with at
    most one block of each size but the largest, for every count up to 3 largest blocks
    (counted in NumPy from the blocks' own rows)."""
    from namedmesh.grouped_slots import loop_blocks, over_group

    blocks, first = loop_blocks(64, 4), 5
    assert blocks == (64, 32, 16, 8)

    @jax.jit
    def visits(count):
        def body(carry, row, size):
            hits, sizes = carry
            on = (jnp.arange(hits.shape[0]) >= row) & (jnp.arange(hits.shape[0]) < row + size)
            return hits + on, sizes.at[blocks.index(size)].add(1)

        init = (jnp.zeros(first + 3 * 64 + 8, jnp.int32), jnp.zeros(len(blocks), jnp.int32))
        return over_group(blocks, first, count, body, init)

    for count in (0, 1, 7, 8, 9, 59, 63, 64, 65, 127, 3 * 64):
        hits, sizes = map(np.asarray, visits(count))
        assert (hits[first : first + count] == 1).all() and (hits[:first] == 0).all(), count
        past = np.flatnonzero(hits[first + count :])
        assert (hits <= 1).all() and len(past) < blocks[-1] and (sizes[1:] <= 1).all(), count
        assert hits.sum() == -(-count // blocks[-1]) * blocks[-1], count


# experts split where the tokens are (routed: t over e; the hidden layer split over d,
# summed over d), or not (each device its experts' rows, summed over e); routed with the
# hidden whole: tests/test_moe.py
@pytest.mark.parametrize("layout", ["experts:e;f:d;t:e", "experts:e;t:d"])
def test_lowered_values_and_gradients(layout):
    ffn = lambda x, wi, wo, g, wg: nm.grouped_ffn(x, wi, wo, g, wg, activation="silu")  # noqa: E731
    f = lower(ffn, Mesh({"e": 4, "d": 2}), layout)
    run = lambda *a: f(*(nm.tensor(v, d) for v, d in zip(a, DIMS, strict=True))).data  # noqa: E731
    loss = lambda x, wi, wo, wg: jnp.sum(jnp.sin(run(x, wi, wo, G, wg)))  # noqa: E731
    value, grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))(X, WI, WO, WG)
    np.testing.assert_allclose(value, np.sin(oracle(X, G, "silu", True)).sum(), rtol=1e-5)
    for name, a, b in zip(("x", "wi", "wo", "wg"), grads, dense_grads(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("gated", [False, True])
def test_the_memory_estimate_counts_what_the_kernel_saves(gated):
    """The primitive's `backward_saves` (the memory estimate's count, in x's sizes) is
    what the kernel (namedmesh/grouped_slots.py) keeps for its backward pass: the float
    residuals jax reports it made (`print_saved_residuals`; the weights, inputs, apart).
    """
    from jax.ad_checkpoint import print_saved_residuals

    wg = WG if gated else None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda x: named(x, WI, WO, G, wg).data.sum(), X)
    kept = [line.split()[0] for line in out.getvalue().splitlines()
            if line.startswith("f32[") and "grouped_slots.py" in line]  # fmt: skip
    kept = sum(math.prod(map(int, s[4:-1].split(","))) for s in kept)
    ins = tuple(nm.tensor(a, d) for a, d in zip((X, WI, WO, G, wg), DIMS, strict=True)
                if a is not None)  # fmt: skip
    declared = nm.REGISTRY["grouped_ffn"].backward_saves(
        ins, {"dim": "experts", "activation": "silu"}
    )
    assert kept == pytest.approx(declared * X.size), out.getvalue()


def float64_vjp(x, wi, wo, wg, g, r):
    """NumPy float64: out = (silu(x wi[e]) * x wg[e]) wo[e] for each row's choices e (zero
    outside [0, groups)) and, for the cotangent r of out, the gradients of x and the
    three weights, each choice's product's by hand."""
    x, wi, wo, wg, r = (a.astype(np.float64) for a in (x, wi, wo, wg, r))
    out = np.zeros(g.shape + wo.shape[-1:])
    dx, dwi, dwo, dwg = (np.zeros_like(a) for a in (x, wi, wo, wg))
    for t, k in np.ndindex(g.shape):
        e = g[t, k]
        if not 0 <= e < wi.shape[0]:
            continue
        a, b = x[t] @ wi[e], x[t] @ wg[e]
        s = 1 / (1 + np.exp(-a))
        h = a * s * b
        out[t, k] = h @ wo[e]
        dh = wo[e] @ r[t, k]
        da, db = dh * b * s * (1 + a * (1 - s)), dh * a * s
        dx[t] += wi[e] @ da + wg[e] @ db
        dwi[e] += np.outer(x[t], da)
        dwg[e] += np.outer(x[t], db)
        dwo[e] += np.outer(h, r[t, k])
    return out, (dx, dwi, dwo, dwg)


def test_values_and_gradients_equal_float64_numpy_at_any_routing():
    """Values and the four gradients (a random cotangent) against float64 NumPy, 192
    rows in 4 experts (blocks of 128 rows down to 8): at random routings with an expert
    left empty and a few rows outside, with every row on one expert (its blocks of 128
    and 64), and with none inside (the backward's loop skipped), one program for all."""
    rng = np.random.default_rng(1)
    t, d, f, o = 96, 6, 12, 5
    x = rng.normal(size=(t, d)).astype(np.float32)
    wi, wg = (rng.normal(size=(E, d, f)).astype(np.float32) * 0.4 for _ in range(2))
    wo = rng.normal(size=(E, f, o)).astype(np.float32) * 0.4
    r = rng.normal(size=(t, 2, o)).astype(np.float32)

    def ffn(x, wi, wo, wg, g):
        dims = ("t d", "experts d f", "experts f o", "t k", "experts d f")
        named = (nm.tensor(a, n) for a, n in zip((x, wi, wo, g, wg), dims, strict=True))
        return nm.grouped_ffn(*named, activation="silu").data

    @jax.jit
    def both(x, wi, wo, wg, g):
        out, pull = jax.vjp(lambda *w: ffn(*w, g), x, wi, wo, wg)
        return out, pull(r)

    empty = rng.choice([-1, 0, 1, 3], size=(t, 2), p=[0.05, 0.45, 0.3, 0.2])
    skewed = rng.choice([0, 1, 2, 3, E], size=(t, 2), p=[0.02, 0.02, 0.9, 0.02, 0.04])
    for g in (empty, skewed, np.full((t, 2), 1), np.full((t, 2), -1)):
        got, grads = both(x, wi, wo, wg, g.astype(np.int32))
        want, wants = float64_vjp(x, wi, wo, wg, g, r)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        for name, a, b in zip(("x", "wi", "wo", "wg"), grads, wants, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)
