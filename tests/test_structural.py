"""Structural ops against independent oracles (xarray where it has the op, else NumPy).

Every op is run four ways: eagerly on NumPy, under `jax.jit` with jax inputs (the jax
implementation), and through `nm.trace` with `nm.reference` (NumPy) and `nm.interpret`
(jax). The expected values never come from namedmesh.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xarray as xr
from hypothesis import given, settings
from hypothesis import strategies as st

import namedmesh as nm
from namedmesh import ShapeError

RNG = np.random.default_rng(0)


# --- helpers -------------------------------------------------------------------------
def T(data, dims) -> nm.Tensor:
    """A NumPy-backed Tensor."""
    return nm.tensor(np.asarray(data), dims)


def rand(dims: str, *shape, dtype=np.float32) -> nm.Tensor:
    if np.dtype(dtype).kind in "iu":
        return T(RNG.integers(-50, 50, size=shape).astype(dtype), dims)
    return T(RNG.standard_normal(shape).astype(dtype), dims)


def xa(t: nm.Tensor) -> xr.DataArray:
    """The oracle's copy of a Tensor (built here, not with namedmesh's own to_xarray)."""
    return xr.DataArray(np.array(t.data), dims=t.dims)


def _is_tensor(x) -> bool:
    return isinstance(x, nm.Tensor)


def _leaves(tree) -> list[nm.Tensor]:
    return jax.tree_util.tree_leaves(tree, is_leaf=_is_tensor)


def to_jax(t: nm.Tensor) -> nm.Tensor:
    return nm.Tensor(jnp.asarray(t.data), t.dims)


def run_paths(fn, *inputs) -> dict[str, list[nm.Tensor]]:
    """`fn(*inputs)` eagerly (NumPy), under jax.jit with jax inputs, and traced then run
    by nm.reference and nm.interpret; each as the flat list of result Tensors."""
    eager = _leaves(fn(*inputs))
    for t in eager:
        assert isinstance(t.data, np.ndarray), f"eager result is a {type(t.data)}"
    jitted = _leaves(jax.jit(fn)(*(to_jax(t) for t in inputs)))
    for t in jitted:
        assert isinstance(t.data, jax.Array) and not isinstance(t.data, np.ndarray)
    graph = nm.trace(fn, *inputs)
    return {
        "eager": eager,
        "jit": jitted,
        "reference": _leaves(nm.reference(graph)(*inputs)),
        "interpret": _leaves(nm.interpret(graph)(*inputs)),
    }


def check(fn, inputs, expected, dims=None, dtype=None, exact=True):
    """Each path's results equal `expected` (DataArrays, or one DataArray).

    `dims` (one tuple per result) are the exact result dims the docs promise; by default
    the expected DataArray's dims. Values are compared after aligning dim order.
    """
    expected = list(expected) if isinstance(expected, list | tuple) else [expected]
    if dims is None:
        dims = [e.dims for e in expected]
    elif dims and isinstance(dims[0], str):
        dims = [dims]
    for path, results in run_paths(fn, *inputs).items():
        assert len(results) == len(expected), path
        for r, e, d in zip(results, expected, dims, strict=True):
            assert r.dims == tuple(d), f"{path}: dims {r.dims}, expected {tuple(d)}"
            want = e.transpose(*r.dims).values
            got = np.asarray(r)
            assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
            if dtype is not None:
                assert r.dtype == np.dtype(dtype), f"{path}: dtype {r.dtype}"
            if exact:
                np.testing.assert_array_equal(got, want, err_msg=path)
            else:
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=path)


# --- rename / transpose ------------------------------------------------------------
def test_rename_mapping_and_kwargs():
    x = rand("a b c", 2, 3, 4)
    check(lambda t: nm.rename(t, {"a": "p", "c": "q"}), [x], xa(x).rename({"a": "p", "c": "q"}))
    check(lambda t: nm.rename(t, b="z"), [x], xa(x).rename({"b": "z"}))
    check(lambda t: t.rename(a="b", b="a"), [x], xa(x).rename({"a": "b", "b": "a"}))


def test_rename_keeps_data():
    x = rand("a b", 2, 3)
    y = nm.rename(x, a="z")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert y.sizes == {"z": 2, "b": 3}


@pytest.mark.parametrize(
    "order",
    [
        ("c", "a", "b"),
        ("b", "c", "a"),
        ("a", "b", "c"),
        ("c", "..."),
        ("...", "a"),
        ("b", "...", "a"),
        ("...",),
        ("a", "b", "c", "..."),
    ],
)
def test_transpose(order):
    x = rand("a b c", 2, 3, 4)
    want = xa(x).transpose(*(... if d == "..." else d for d in order))
    check(lambda t: nm.transpose(t, *order), [x], want)


def test_transpose_spellings():
    x = rand("a b c", 2, 3, 4)
    want = xa(x).transpose("c", "a", "b")
    check(lambda t: nm.transpose(t, "c a b"), [x], want)
    check(lambda t: nm.transpose(t, ("c", "a", "b")), [x], want)
    check(lambda t: nm.transpose(t, ["c", "..."]), [x], want)
    check(lambda t: nm.transpose(t, "c ..."), [x], want)
    check(lambda t: nm.transpose(t, "... a b"), [x], want)
    check(lambda t: t.transpose("c", "a", "b"), [x], want)


# --- reshape -------------------------------------------------------------------------
def test_reshape_split_one_dim():
    x = rand("b d s", 2, 12, 3)
    want = np.asarray(x).reshape(2, 3, 4, 3)
    check(
        lambda t: nm.reshape(t, {"h": 3, "k": 4}, from_="d"),
        [x],
        xr.DataArray(want, dims=("b", "h", "k", "s")),
        dims=("b", "h", "k", "s"),
    )
    # -1 is inferred
    check(
        lambda t: nm.reshape(t, {"h": -1, "k": 4}, from_="d"),
        [x],
        xr.DataArray(want, dims=("b", "h", "k", "s")),
        dims=("b", "h", "k", "s"),
    )
    want3 = np.asarray(x).reshape(2, 2, 3, 2, 3)
    check(
        lambda t: nm.reshape(t, {"p": 2, "q": -1, "r": 2}, from_=("d",)),
        [x],
        xr.DataArray(want3, dims=("b", "p", "q", "r", "s")),
        dims=("b", "p", "q", "r", "s"),
    )


def test_reshape_merge_adjacent():
    x = rand("b h k s", 2, 3, 4, 5)
    want = np.asarray(x).reshape(2, 12, 5)
    check(
        lambda t: nm.reshape(t, {"d": 12}, from_="h k"),
        [x],
        xr.DataArray(want, dims=("b", "d", "s")),
        dims=("b", "d", "s"),
    )
    check(
        lambda t: nm.reshape(t, {"d": -1}, from_="h k"),
        [x],
        xr.DataArray(want, dims=("b", "d", "s")),
        dims=("b", "d", "s"),
    )


def test_reshape_merge_non_adjacent_and_reordered():
    x = rand("a b c d", 2, 3, 4, 5)
    arr = np.asarray(x)
    # merge (a, c), a-major; the merged dim goes where `a` was
    want = arr.transpose(0, 2, 1, 3).reshape(8, 3, 5)
    check(
        lambda t: nm.reshape(t, {"m": 8}, from_="a c"),
        [x],
        xr.DataArray(want, dims=("m", "b", "d")),
        dims=("m", "b", "d"),
    )
    # merge (d, b), d-major; placed where the first of them (b) was
    want = arr.transpose(0, 3, 1, 2).reshape(2, 15, 4)
    check(
        lambda t: nm.reshape(t, {"m": -1}, from_="d b"),
        [x],
        xr.DataArray(want, dims=("a", "m", "c")),
        dims=("a", "m", "c"),
    )
    # cross-check the merge with xarray's stack (the new dim is a-major as well)
    stacked = xa(x).stack(m=("a", "c")).drop_vars(["m", "a", "c"])
    got = nm.reshape(x, {"m": 8}, from_="a c")
    np.testing.assert_array_equal(np.asarray(got), stacked.transpose(*got.dims).values)


def test_reshape_merge_then_split_round_trip():
    x = rand("a b c", 2, 3, 4)

    def fn(t):
        m = nm.reshape(t, {"m": 8}, from_="c a")
        return nm.reshape(m, {"c": 4, "a": 2}, from_="m")

    check(fn, [x], xa(x).transpose("c", "a", "b"), dims=("c", "a", "b"))


def test_reshape_to_and_from_size_one():
    x = rand("a b", 3, 4)
    want = np.asarray(x).reshape(3, 1, 4, 1)
    check(
        lambda t: nm.reshape(t, {"one": 1, "b": 4, "two": 1}, from_="b"),
        [x],
        xr.DataArray(want, dims=("a", "one", "b", "two")),
        dims=("a", "one", "b", "two"),
    )


# --- concat / split / stack -----------------------------------------------------------
def test_concat_aligns_dim_orders():
    x = rand("a b c", 2, 3, 4)
    y = rand("c a b", 4, 2, 5)
    z = rand("b a c", 1, 2, 4)
    want = xr.concat([xa(x), xa(y).transpose("a", "b", "c"), xa(z)], dim="b")
    check(lambda p, q, r: nm.concat([p, q, r], "b"), [x, y, z], want, dims=("a", "b", "c"))


def test_concat_single_and_first_dim():
    x = rand("a b", 2, 3)
    y = rand("b a", 3, 4)
    check(lambda t: nm.concat([t], "a"), [x], xa(x))
    check(
        lambda p, q: nm.concat([p, q], "a"),
        [x, y],
        xr.concat([xa(x), xa(y)], dim="a"),
        dims=("a", "b"),
    )


def test_concat_ints():
    x = rand("a b", 2, 3, dtype=np.int32)
    y = rand("a b", 2, 2, dtype=np.int32)
    check(lambda p, q: nm.concat([p, q], "b"), [x, y], xr.concat([xa(x), xa(y)], "b"), dtype="i4")


def test_split_equal_parts():
    x = rand("a d", 3, 6)
    want = [xa(x).isel(d=slice(i, i + 2)) for i in (0, 2, 4)]
    check(lambda t: nm.split(t, "d", 3), [x], want)
    want = [xa(x).isel(a=slice(i, i + 1)) for i in range(3)]
    check(lambda t: nm.split(t, "a", 3), [x], want)
    check(lambda t: nm.split(t, "d", 1), [x], [xa(x)])


def test_split_given_sizes():
    x = rand("a d b", 2, 7, 3)
    bounds = [(0, 1), (1, 1), (1, 5), (5, 7)]
    want = [xa(x).isel(d=slice(lo, hi)) for lo, hi in bounds]
    check(lambda t: nm.split(t, "d", [1, 0, 4, 2]), [x], want)
    check(lambda t: nm.split(t, "d", (7,)), [x], [xa(x)])


def test_split_then_concat_is_identity():
    x = rand("a d", 2, 9)
    check(lambda t: nm.concat(nm.split(t, "d", (2, 3, 4)), "d"), [x], xa(x))


def test_stack():
    x = rand("a b", 2, 3)
    y = rand("b a", 3, 2)
    z = rand("a b", 2, 3)
    want = xr.concat([xa(x), xa(y), xa(z)], dim="new")
    assert want.dims == ("new", "a", "b")
    check(lambda p, q, r: nm.stack([p, q, r], "new"), [x, y, z], want)
    check(lambda p: nm.stack([p], "s"), [x], xr.concat([xa(x)], dim="s"))


# --- slice ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "start, stop, step",
    [
        (None, None, 1),
        (1, 4, 1),
        (-3, None, 1),
        (None, -2, 1),
        (-4, -1, 2),
        (0, 7, 3),
        (1, None, 2),
        (5, 2, 1),  # empty
        (10, 20, 1),  # past the end: empty
        (-100, 100, 4),  # clamped both ends
    ],
)
def test_slice(start, stop, step):
    x = rand("a d", 2, 7)
    want = xa(x).isel(d=slice(start, stop, step))
    check(lambda t: nm.slice(t, "d", start, stop, step), [x], want)


def test_slice_keywords_and_first_dim():
    x = rand("a d", 5, 3)
    check(lambda t: nm.slice(t, "a", stop=2), [x], xa(x).isel(a=slice(None, 2)))
    check(lambda t: nm.slice(t, "a", step=2), [x], xa(x).isel(a=slice(None, None, 2)))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 8),
    start=st.none() | st.integers(-10, 10),
    stop=st.none() | st.integers(-10, 10),
    step=st.integers(1, 4),
)
def test_slice_matches_python_slicing(n, start, stop, step):
    x = T(np.arange(2 * n, dtype=np.int32).reshape(2, n), "a d")
    want = [[row[i] for i in range(n)][start:stop:step] for row in np.asarray(x).tolist()]
    got = nm.slice(x, "d", start, stop, step)
    assert got.dims == ("a", "d")
    assert np.asarray(got).tolist() == want
    g = nm.trace(lambda t: nm.slice(t, "d", start, stop, step), x)
    assert np.asarray(nm.reference(g)(x)).tolist() == want


# --- pad ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "widths, value",
    [
        ({"d": (1, 2)}, 0),
        ({"d": (0, 3), "a": (2, 0)}, -1.5),
        ({"a": 1}, 7),
        ({"a": 2, "d": (1, 0)}, 0.25),
        ({"d": 0}, 3),
        ({}, 0),
    ],
)
def test_pad(widths, value):
    x = rand("a d", 2, 3)
    xw = {d: (w, w) if isinstance(w, int) else w for d, w in widths.items()}
    want = xa(x).pad(xw, constant_values=value) if xw else xa(x)
    check(lambda t: nm.pad(t, widths, value), [x], want, dtype=np.float32)


def test_pad_int_tensor():
    x = rand("a d", 2, 3, dtype=np.int32)
    want = xa(x).pad({"d": (2, 1)}, constant_values=9)
    check(lambda t: nm.pad(t, {"d": (2, 1)}, value=9), [x], want, dtype=np.int32)


# --- shift / roll -----------------------------------------------------------------------
@pytest.mark.parametrize("offset", [0, 1, 2, -1, -3, 5, 6, -6, 9, -20])
def test_shift_fill(offset):
    x = rand("a d", 2, 5)
    want = xa(x).shift(d=offset, fill_value=-7.0)
    check(lambda t: nm.shift(t, "d", offset, fill=-7.0), [x], want, dtype=np.float32)


@pytest.mark.parametrize("offset", [0, 1, -2, 4, 5, 7, -11])
def test_shift_wrap(offset):
    x = rand("d a", 5, 2)
    want = xa(x).roll(d=offset)
    check(lambda t: nm.shift(t, "d", offset, wrap=True), [x], want)


def test_shift_default_fill_and_ints():
    x = rand("a d", 3, 4, dtype=np.int32)
    want = xa(x).shift(a=1, fill_value=0)
    check(lambda t: nm.shift(t, "a", 1), [x], want, dtype=np.int32)
    # by the docs: out[i] = x[i - offset]
    arr = np.asarray(x)
    got = np.asarray(nm.shift(x, "d", -1, fill=5))
    for i in range(4):
        expect = arr[:, i + 1] if i + 1 < 4 else np.full(3, 5)
        np.testing.assert_array_equal(got[:, i], expect)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 6), offset=st.integers(-9, 9), wrap=st.booleans())
def test_shift_matches_loop(n, offset, wrap):
    x = T(np.arange(n, dtype=np.int32) + 1, "d")
    got = nm.shift(x, "d", offset, wrap=wrap, fill=-1)
    vals = list(range(1, n + 1))
    if wrap:
        want = [vals[(i - offset) % n] for i in range(n)]
    else:
        want = [vals[i - offset] if 0 <= i - offset < n else -1 for i in range(n)]
    assert np.asarray(got).tolist() == want


# --- one_hot ---------------------------------------------------------------------------
def _one_hot_loop(idx: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(idx.shape + (n,), np.float32)
    for pos in np.ndindex(*idx.shape):
        for k in range(n):
            if idx[pos] == k:
                out[pos + (k,)] = 1
    return out


def test_one_hot_with_out_of_range_indices():
    idx = T(np.array([[0, 3, -1], [4, 2, 9]], np.int32), "b s")
    want = xr.DataArray(_one_hot_loop(np.asarray(idx), 4), dims=("b", "s", "v"))
    check(lambda i: nm.one_hot(i, "v", 4), [idx], want, dtype=np.float32)
    check(
        lambda i: nm.one_hot(i, "v", 4, dtype=np.int32),
        [idx],
        want.astype(np.int32),
        dtype=np.int32,
    )
    assert np.asarray(nm.one_hot(idx, "v", 4))[0, 2].tolist() == [0, 0, 0, 0]
    assert np.asarray(nm.one_hot(idx, "v", 4))[1, 0].tolist() == [0, 0, 0, 0]


def test_one_hot_scalar_index():
    idx = T(np.array(2, np.int32), ())
    check(lambda i: nm.one_hot(i, "v", 3), [idx], xr.DataArray([0.0, 0.0, 1.0], dims="v"))


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32])
def test_one_hot_small_index_dtypes_with_a_large_depth(dtype):
    """Indices of a narrow dtype and a depth past its range: still one 1 per index."""
    raw = np.array([1, 100, 127, -1 if np.dtype(dtype).kind == "i" else 255], dtype)
    idx = T(raw, "s")
    want = np.zeros((4, 300), np.float32)
    for s, i in enumerate(raw.tolist()):
        if 0 <= i < 300:
            want[s, i] = 1
    check(lambda i: nm.one_hot(i, "v", 300), [idx], xr.DataArray(want, dims=("s", "v")))


# --- where ---------------------------------------------------------------------------
def test_where_broadcasts_by_name():
    cond = T(RNG.random((3, 2)) > 0.5, "x y")
    a = rand("z x", 4, 3)
    b = rand("y", 2)
    want = xr.where(xa(cond), xa(a), xa(b))
    check(nm.where, [cond, a, b], want, dims=("x", "y", "z"))


def test_where_with_scalars():
    cond = T(np.array([True, False, True]), "x")
    a = rand("x y", 3, 2)
    want = xr.where(xa(cond), xa(a), 0.0)
    check(lambda c, t: nm.where(c, t, 0.0), [cond, a], want, dims=("x", "y"), dtype=np.float32)
    want = xr.where(xa(cond), -1.0, xa(a))
    check(lambda c, t: nm.where(c, -1.0, t), [cond, a], want, dims=("x", "y"), dtype=np.float32)


def test_where_from_a_comparison():
    a = rand("x y", 3, 4)
    want = xr.where(xa(a) > 0, xa(a), 0)
    check(lambda t: nm.where(t > 0, t, 0.0), [a], want)


# --- gather ----------------------------------------------------------------------------
def _clamp(idx: np.ndarray, n: int) -> np.ndarray:
    return np.array(
        [min(max(i + n if i < 0 else i, 0), n - 1) for i in idx.ravel()], idx.dtype
    ).reshape(idx.shape)


def test_gather_embedding_lookup():
    table = rand("vocab d", 5, 3)
    ids = T(RNG.integers(0, 5, size=(2, 4)).astype(np.int32), "batch seq")
    want = xa(table).isel(vocab=xr.DataArray(np.asarray(ids), dims=("batch", "seq")))
    check(lambda t, i: nm.gather(t, "vocab", i), [table, ids], want, dims=("batch", "seq", "d"))
    # loop oracle
    got = np.asarray(nm.gather(table, "vocab", ids))
    for b, s in itertools.product(range(2), range(4)):
        np.testing.assert_array_equal(got[b, s], np.asarray(table)[np.asarray(ids)[b, s]])


def test_gather_dim_in_the_middle_keeps_place():
    x = rand("d vocab e", 2, 5, 3)
    ids = T(np.array([[4, 0], [1, 1], [3, 2]], np.int32), "s t")
    want = xa(x).isel(vocab=xr.DataArray(np.asarray(ids), dims=("s", "t")))
    check(lambda t, i: nm.gather(t, "vocab", i), [x, ids], want, dims=("d", "s", "t", "e"))


def test_gather_pointwise_batched():
    x = rand("batch vocab", 3, 5)
    idx = T(np.array([4, 0, 2], np.int32), "batch")
    want = xa(x).isel(vocab=xa(idx))
    check(lambda t, i: nm.gather(t, "vocab", i), [x, idx], want, dims=("batch",))
    got = np.asarray(nm.gather(x, "vocab", idx))
    for b in range(3):
        assert got[b] == np.asarray(x)[b, np.asarray(idx)[b]]


def test_gather_pointwise_with_extra_dims():
    x = rand("vocab batch d", 5, 3, 2)
    idx = T(RNG.integers(0, 5, size=(2, 3)).astype(np.int32), "k batch")
    want = xa(x).isel(vocab=xa(idx))
    check(lambda t, i: nm.gather(t, "vocab", i), [x, idx], want, dims=("k", "batch", "d"))
    got = nm.gather(x, "vocab", idx)
    g, xi, ii = np.asarray(got), np.asarray(x), np.asarray(idx)
    for k, b, d in itertools.product(range(2), range(3), range(2)):
        assert g[k, b, d] == xi[ii[k, b], b, d]


def test_gather_negative_and_out_of_range_indices_clamp():
    table = rand("vocab d", 5, 2)
    raw = np.array([[-1, -5, -6, -100], [5, 99, 0, 3]], np.int32)
    ids = T(raw, "b s")
    clamped = _clamp(raw, 5)
    assert clamped.tolist() == [[4, 0, 0, 0], [4, 4, 0, 3]]
    want = xa(table).isel(vocab=xr.DataArray(clamped, dims=("b", "s")))
    check(lambda t, i: nm.gather(t, "vocab", i), [table, ids], want, dims=("b", "s", "d"))


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.uint16, np.uint32])
def test_gather_small_index_dtypes_with_a_large_table(dtype):
    """A table longer than the index dtype's range: no overflow, no wrapped clamp bound."""
    table = T(np.arange(300 * 2, dtype=np.float32).reshape(300, 2), "vocab d")
    signed = np.dtype(dtype).kind == "i"
    raw = np.array([0, 7, 127, -1 if signed else 255, -3 if signed else 200], dtype)
    ids = T(raw, "s")
    clamped = _clamp(raw.astype(np.int64), 300)
    want = xa(table).isel(vocab=xr.DataArray(clamped, dims="s"))
    check(lambda t, i: nm.gather(t, "vocab", i), [table, ids], want, dims=("s", "d"))


def test_gather_scalar_index():
    x = rand("a vocab", 2, 4)
    idx = T(np.array(-2, np.int32), ())
    check(lambda t, i: nm.gather(t, "vocab", i), [x, idx], xa(x).isel(vocab=2), dims=("a",))


def test_gather_gradient_is_scatter_add():
    table = rand("vocab d", 4, 2)
    ids = T(np.array([1, 1, 3], np.int32), "s")
    grad = jax.grad(lambda t: nm.gather(t, "vocab", ids).sum().data)(to_jax(table))
    want = np.zeros((4, 2), np.float32)
    for i in (1, 1, 3):
        want[i] += 1
    np.testing.assert_array_equal(np.asarray(grad), want)


# --- stop_gradient -----------------------------------------------------------------------
def test_stop_gradient_is_identity():
    x = rand("a b", 2, 3)
    check(nm.stop_gradient, [x], xa(x))


def test_stop_gradient_blocks_gradient():
    x = to_jax(rand("a b", 2, 3))
    g = jax.grad(lambda t: nm.stop_gradient(t * t).sum().data)(x)
    assert g.dims == ("a", "b")
    np.testing.assert_array_equal(np.asarray(g), np.zeros((2, 3)))
    # d/dx sum(x * sg(x)) = sg(x): the gradient flows only through the first factor
    g = jax.grad(lambda t: (t * nm.stop_gradient(t)).sum().data)(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(x.data), rtol=1e-6)
    # also through a traced graph run on jax
    graph = nm.trace(lambda t: (t * nm.stop_gradient(t)).sum(), x)
    g = jax.grad(lambda t: nm.interpret(graph)(t).data)(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(x.data), rtol=1e-6)


# --- errors ------------------------------------------------------------------------------
X = T(np.zeros((2, 3), np.float32), "a b")
IDX = T(np.zeros((4,), np.int32), "s")


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda: nm.rename(X, {"zz": "q"}), "zz"),
        (lambda: nm.rename(X, a="b"), r"repeated.*'b'"),
        (lambda: nm.transpose(X, "a", "zz"), "zz"),
        (lambda: nm.transpose(X, "a"), r"\('a',\).*\('a', 'b'\)"),
        (lambda: nm.transpose(X, "a", "a"), "'a'"),
        (lambda: nm.transpose(X, "...", "a", "..."), r"\.\.\."),
        (lambda: nm.reshape(X, {"p": 2}, from_="zz"), "zz"),
        (lambda: nm.reshape(X, {"p": 2, "q": 2}, from_="b"), r"3 elements of \(b: 3\)"),
        (lambda: nm.reshape(X, {"p": -1, "q": 2}, from_="b"), r"3 elements of \(b: 3\)"),
        (lambda: nm.reshape(X, {"p": -1, "q": -1}, from_="b"), r"'p': -1.*\(b: 3\)"),
        (lambda: nm.reshape(X, {"m": 5}, from_="a b"), r"6 elements of \(a: 2, b: 3\)"),
        (lambda: nm.reshape(X, {"a": 3}, from_="b"), r"\['a'\] already"),
        (lambda: nm.concat([X, T(np.zeros((2, 3)), "a c")], "a"), r"different dims.*'c'"),
        (lambda: nm.concat([X, T(np.zeros((3, 3)), "a b")], "b"), r"'a' has size 2.*but 3"),
        (lambda: nm.concat([X, T(np.zeros((2,)), "a")], "a"), "different dims"),
        (lambda: nm.concat([X], "zz"), "zz"),
        (lambda: nm.concat([], "a"), "at least one"),
        (lambda: nm.stack([X, T(np.zeros((2, 4)), "a b")], "s"), r"b: 3.*b: 4"),
        (lambda: nm.stack([X], "a"), "'a' is already"),
        (lambda: nm.stack([X, T(np.zeros((2, 3)), "a c")], "s"), "different dims"),
        (lambda: nm.split(X, "b", 2), r"2 equal parts.*'b' of size 3"),
        (lambda: nm.split(X, "b", 0), r"'b' of size 3"),
        (lambda: nm.split(X, "b", (1, 1)), r"\(1, 1\).*size 3 of dim 'b'"),
        (lambda: nm.split(X, "b", (4, -1)), r"size 3 of dim 'b'"),
        (lambda: nm.split(X, "zz", 1), "zz"),
        (lambda: nm.slice(X, "b", 0, 2, 0), r"step.*0.*'b'"),
        (lambda: nm.slice(X, "b", 2, 0, -1), r"step.*-1.*'b'"),
        (lambda: nm.slice(X, "zz", 0, 1), "zz"),
        (lambda: nm.pad(X, {"b": (-1, 0)}), r"negative.*'b'"),
        (lambda: nm.pad(X, {"a": -2}), r"negative.*'a'"),
        (lambda: nm.pad(X, {"zz": 1}), "zz"),
        (lambda: nm.shift(X, "zz", 1), "zz"),
        (lambda: nm.one_hot(T(np.zeros(3, np.float32), "s"), "v", 4), r"integers.*float32"),
        (lambda: nm.one_hot(IDX, "s", 4), "'s' is already"),
        (lambda: nm.gather(X, "b", T(np.zeros(4, np.float32), "s")), r"integers.*float32"),
        (lambda: nm.gather(X, "zz", IDX), "zz"),
        (lambda: nm.gather(X, "b", T(np.zeros(2, np.int32), "b")), "gathered dim 'b'"),
        (lambda: nm.gather(X, "b", T(np.zeros(5, np.int32), "a")), r"'a' has size 2.*but 5"),
        (lambda: nm.where(X > 0, X, T(np.zeros(4, np.float32), "b")), r"'b' has size 3.*4"),
    ],
)
def test_errors(fn, match):
    with pytest.raises(ShapeError, match=match):
        fn()


def test_one_hot_negative_depth_is_an_error():
    with pytest.raises(ShapeError, match=r"one_hot.*'v'.*-1"):
        nm.one_hot(IDX, "v", -1)


def test_pad_width_that_is_not_a_pair_is_an_error():
    with pytest.raises(ShapeError, match=r"pad.*'b'.*\(1, 2, 3\)"):
        nm.pad(X, {"b": (1, 2, 3)})


def test_errors_raise_at_trace_time():
    y = T(np.zeros((3, 3), np.float32), "a b")
    with pytest.raises(ShapeError, match="'a' has size 2"):
        nm.trace(lambda p, q: nm.concat([p, q], "b"), X, y)
    with pytest.raises(ShapeError, match="'b'"):
        nm.trace(lambda p: nm.split(p, "b", 2), X)
    with pytest.raises(ShapeError, match="integers"):
        nm.trace(lambda p, i: nm.gather(p, "b", i), X, T(np.zeros(2, np.float32), "s"))


def test_errors_under_jit():
    with pytest.raises(ShapeError, match=r"negative.*'b'"):
        jax.jit(lambda t: nm.pad(t, {"b": (0, -1)}))(to_jax(X))
    with pytest.raises(ShapeError, match="'a' has size 2"):
        jax.jit(lambda p, q: nm.concat([p, q], "b"))(
            to_jax(X), to_jax(T(np.zeros((3, 1), np.float32), "a b"))
        )
