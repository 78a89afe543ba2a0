"""gather, one_hot and where on index tensors of any integer dtype and with their dims in
any order relative to the table's, lowered, against NumPy (issue 13, items 4 and 5)."""

import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, lower

R = np.random.default_rng(5)
MESH = Mesh({"x": 2, "y": 4})
INT_DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32]


def np_gather_rows(table, idx):
    """table[v, ...] at idx (any int dtype): negative from the end, clamped, as nm.gather."""
    i = idx.astype(np.int64)
    i = np.clip(np.where(i < 0, i + len(table), i), 0, len(table) - 1)
    return table[i]


def test_gather_int8_indices_into_256_rows_split_over_4_devices():
    """As the issue reports it: the index arithmetic ran in int8 (-1 + 256 wrapped)."""
    table = np.arange(256 * 2, dtype=np.float32).reshape(256, 2)
    idx = np.array([-1, 5, 100, 127, -128, 64, 3, -56], np.int8)
    fn = lambda t, i: nm.gather(t, "v", i)
    got = lower(fn, Mesh({"x": 4}), "v:x")(nm.tensor(table, "v e"), nm.tensor(idx, "b"))
    np.testing.assert_array_equal(np.asarray(got.data), np_gather_rows(table, idx))


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_gather_one_hot_and_where_take_any_int_dtype(dtype):
    info = np.iinfo(dtype)  # indices over the dtype's range, as far as 256 rows reach
    table = R.normal(size=(256, 4)).astype(np.float32)
    idx = R.integers(max(info.min, -256), min(info.max, 255) + 1, size=(4, 2)).astype(dtype)
    cond = R.integers(0, 3, size=(4, 2)).astype(dtype)
    a = R.integers(0, 100, size=4).astype(dtype)

    def fn(t, i, c, a):
        return [
            nm.gather(t, "v", i),
            nm.one_hot(i, "v", 256),
            nm.where(c, a, nm.astype(c, dtype) * 3),
            nm.where(c > 1, a, 7),
        ]

    args = [nm.tensor(table, "v e"), nm.tensor(idx, "b f"), nm.tensor(cond, "b f")]
    args.append(nm.tensor(a, "b"))
    wide = idx.astype(np.int64)
    want = [
        np_gather_rows(table, idx),
        (wide[..., None] == np.arange(256)).astype(np.float32),
        np.where(cond != 0, a[:, None], cond * dtype(3)),
        np.where(cond > 1, a[:, None], dtype(7)),
    ]
    for rule in ["v:y,x", "b:x;v:y", "f:x;v:y"]:
        got = lower(fn, MESH, rule)(*args)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype, (rule, g.dtype, w.dtype)
            np.testing.assert_array_equal(np.asarray(g.data), w, err_msg=rule)


def test_gather_with_index_dims_in_another_order_than_the_tables():
    """As the issue reports it: table [v, e], indices [e, b] with |e| == |b|, v split; the
    mask of the looked-up rows was laid out by position, not by name."""
    table = R.normal(size=(8, 4)).astype(np.float32)
    idx = R.integers(0, 8, size=(4, 4)).astype(np.int32)
    fn = lambda t, i: nm.gather(t, "v", i)
    want = table[idx.T, np.arange(4)]  # out [b, e]: table[idx[e, b], e]
    for rule in ["v:x", "v:y", "v:y,x", "v:x;e:y", "v:x;b:y"]:
        got = lower(fn, MESH, rule)(nm.tensor(table, "v e"), nm.tensor(idx, "e b"))
        assert got.dims == ("b", "e")
        np.testing.assert_array_equal(np.asarray(got.data), want, err_msg=rule)


@pytest.mark.parametrize("idx_dims", ["f e b", "b f e", "e b f", "f b"])
def test_gather_with_several_shared_dims_in_any_order(idx_dims):
    table = R.normal(size=(16, 4, 2)).astype(np.float32)  # v e f
    sizes = {"b": 4, "e": 4, "f": 2}
    names = idx_dims.split()
    idx = R.integers(-16, 16, size=[sizes[d] for d in names]).astype(np.int8)
    fn = lambda t, i: nm.gather(t, "v", i)
    want = np.empty((4, 4, 2), np.float32)  # out[b, e, f] = table[idx at (b, e, f), e, f]
    for b, e, f in np.ndindex(want.shape):
        at = dict(b=b, e=e, f=f)
        want[b, e, f] = np_gather_rows(table, idx[tuple(at[d] for d in names)])[e, f]
    for rule in ["v:y", "v:x,y", "e:x;v:y", "f:x;v:y"]:
        got = lower(fn, MESH, rule)(nm.tensor(table, "v e f"), nm.tensor(idx, idx_dims))
        assert got.dims == ("b", "e", "f")
        np.testing.assert_array_equal(np.asarray(got.data), want, err_msg=rule)
