import jax
import jax.extend.random as jrandom
import jax.numpy as jnp
import numpy as np
import pytest

import namedmesh as nm
from namedmesh import ShapeError
from namedmesh.random import random_values, threefry2x32

# Known-answer vectors of Threefry-2x32, 20 rounds (Random123's kat_vectors).
KAT = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]


@pytest.mark.parametrize("key, ctr, want", KAT)
def test_threefry_known_answers(key, ctr, want):
    for xp in (np, jnp):
        with np.errstate(over="ignore"):
            got = threefry2x32(key[0], key[1], ctr[0], ctr[1], xp)
        assert tuple(int(g) for g in got) == want


def test_threefry_matches_jax_on_random_inputs():
    r = np.random.default_rng(0)
    key = r.integers(0, 2**32, size=2, dtype=np.uint32)
    ctr = r.integers(0, 2**32, size=(2, 64), dtype=np.uint32)
    with np.errstate(over="ignore"):
        ours = threefry2x32(key[0], key[1], ctr[0], ctr[1])
    theirs = jrandom.threefry_2x32(jnp.asarray(key), jnp.asarray(ctr.reshape(-1)))
    np.testing.assert_array_equal(np.concatenate(ours), np.asarray(theirs))


SIZES = {"a": 6, "b": 10}


@pytest.mark.parametrize("draw", ["normal", "uniform", "bernoulli", "integers"])
def test_blocks_equal_slices_of_the_whole(draw):
    """A shard generated alone equals the same slice of the full tensor: layout independence."""
    args = {"normal": (), "uniform": (0.0, 1.0), "bernoulli": (0.3,), "integers": (0, 7)}[draw]
    dtype = {"bernoulli": bool, "integers": np.int32}.get(draw, np.float32)
    key = nm.random.key(3).data
    whole = random_values(key, (6, 10), draw, dtype, args)
    for xp in (np, jnp):
        for (r0, r1), (c0, c1) in [((0, 3), (0, 10)), ((3, 6), (5, 10)), ((2, 4), (4, 9))]:
            block = random_values(
                key, (6, 10), draw, dtype, args, xp=xp, offsets=(r0, c0), shape=(r1 - r0, c1 - c0)
            )
            np.testing.assert_allclose(np.asarray(block), whole[r0:r1, c0:c1], rtol=1e-6)


def test_same_key_same_values_other_key_other_values():
    a = nm.random.normal(nm.random.key(0), SIZES)
    b = nm.random.normal(nm.random.key(0), SIZES)
    c = nm.random.normal(nm.random.key(1), SIZES)
    np.testing.assert_array_equal(a.data, b.data)
    assert not np.allclose(a.data, c.data)
    assert a.dims == ("a", "b") and a.dtype == np.float32


def test_values_depend_on_sizes_not_dim_names():
    a = nm.random.uniform(5, {"x": 4, "y": 3})
    b = nm.random.uniform(5, {"p": 4, "q": 3})
    np.testing.assert_array_equal(a.data, b.data)


def test_eager_numpy_equals_jit():
    key = nm.random.key(7)
    eager = nm.random.normal(key, SIZES)
    jitted = jax.jit(lambda k: nm.random.normal(k, SIZES))(key)
    np.testing.assert_allclose(eager.data, jitted.data, rtol=1e-5, atol=1e-6)
    eu = nm.random.uniform(key, SIZES)
    ju = jax.jit(lambda k: nm.random.uniform(k, SIZES))(key)
    np.testing.assert_array_equal(eu.data, ju.data)


def test_fold_in_and_split_give_distinct_keys():
    k = nm.random.key(0)
    keys = [nm.random.fold_in(k, i).data for i in range(3)] + [
        s.data for s in nm.random.split(k, 3)
    ]
    assert len({tuple(x) for x in keys}) == 6
    np.testing.assert_array_equal(nm.random.fold_in(k, 1).data, nm.random.fold_in(k, 1).data)
    jitted = jax.jit(lambda k: nm.random.fold_in(k, 1))(k)
    np.testing.assert_array_equal(jitted.data, nm.random.fold_in(k, 1).data)


def test_distributions_have_the_right_statistics():
    n = {"i": 200_000}
    z = nm.random.normal(1, n).data
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    assert abs(np.mean(np.abs(z) < 1) - 0.6827) < 0.005
    u = nm.random.uniform(2, n, minval=-1.0, maxval=3.0).data
    assert u.min() >= -1 and u.max() < 3 and abs(u.mean() - 1) < 0.01
    b = nm.random.bernoulli(3, n, p=0.25).data
    assert b.dtype == bool and abs(b.mean() - 0.25) < 0.005
    i = nm.random.integers(4, n, 2, 7).data
    assert i.min() == 2 and i.max() == 6
    assert np.all(np.abs(np.bincount(i - 2) / i.size - 0.2) < 0.005)


def test_dropout_mask_rate_and_scale():
    x = nm.ones({"i": 100_000})
    y = nm.dropout(x, 0.3, nm.random.key(0)).data
    kept = y != 0
    assert abs(kept.mean() - 0.7) < 0.005
    np.testing.assert_allclose(y[kept], 1 / 0.7, rtol=1e-6)
    assert nm.dropout(x, 0.0, 0) is x
    jitted = jax.jit(lambda x, k: nm.dropout(x, 0.3, k))(x, nm.random.key(0))
    np.testing.assert_allclose(jitted.data, y, rtol=1e-6)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: nm.random.normal(nm.zeros({"a": 2}), {"b": 2}), "key"),
        (lambda: nm.random.bernoulli(0, {"a": 2}, p=1.5), "p=1.5"),
        (lambda: nm.dropout(nm.ones({"a": 2}), 1.0, 0), "rate=1.0"),
        (lambda: nm.random.integers(0, {"a": 2}, 3, 3), "high=3"),
        (lambda: nm.random.uniform(0, {"a": -2}), "'a'"),
    ],
)
def test_random_errors(call, match):
    with pytest.raises(ShapeError, match=match):
        call()
