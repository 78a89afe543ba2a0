"""The reduced cases of the defects the edge programs found (property_tests/test_edge_props.py:
empty dims, constants made from no input), each against an oracle computed apart from
namedmesh (NumPy), or the typed error naming the tensor at fault."""

import functools

import jax
import numpy as np
import pytest

import namedmesh as nm
from lowering import Layout, Mesh
from namedmesh.testing import lowered

MESH = Mesh({"m0": 4})


@functools.cache
def shifted_constant(offset: int, wrap: bool):
    return lambda x: nm.shift(nm.full({"d": 8}, 1.0), "d", offset, wrap=wrap, fill=0.5) + x


@pytest.mark.parametrize("offset, wrap", [(1, True), (-2, True), (1, False)])
def test_a_constant_shifted_along_a_split_dim(offset, wrap):
    """A block made alike on every device (nm.full over a split dim), shifted by ppermute:
    the plan typed the halo invariant, jax varying (a PlanMismatch; unchecked, with wrap,
    a raw ValueError of a pcast)."""
    x = np.arange(8, dtype=np.float32)
    ones = np.ones(8, np.float32)
    if wrap:
        want = np.roll(ones, offset) + x
    else:
        want = np.concatenate([np.full(offset, 0.5, np.float32), ones[:-offset]]) + x
    got = lowered(shifted_constant(offset, wrap), MESH, Layout("d:m0"))(nm.tensor(x, "d"))
    np.testing.assert_array_equal(np.asarray(got.data), want)


def empty_logsumexp(x):
    return nm.logsumexp(x, ("p", "q"))


def test_logsumexp_over_several_empty_dims_is_minus_infinity():
    """scipy's logsumexp indexed the shape by the tuple of axes: a raw IndexError."""
    a = np.ones((0, 4), np.float32)
    with np.errstate(divide="ignore"):
        want = np.log(np.sum(np.exp(a), axis=(0, 1)))  # log(0)
    x = nm.tensor(a, "p q")
    assert nm.logsumexp(x, ("p", "q")).data == want
    assert jax.jit(lambda d: empty_logsumexp(nm.tensor(d, "p q")).data)(a) == want
    assert lowered(empty_logsumexp, MESH, Layout("q:m0"))(x).data == want


def test_gather_from_an_empty_dim_names_it():
    """NumPy's take and jax's raised a bare IndexError."""
    x = nm.tensor(np.ones((0, 3), np.float32), "p q")
    with pytest.raises(nm.ShapeError, match=r"gather: dim 'p' of \(p: 0, q: 3\) has size 0"):
        nm.gather(x, "p", nm.tensor(np.array([0, 1], np.int32), "i"))
    empty = nm.gather(x, "p", nm.tensor(np.zeros(0, np.int32), "i"))  # no index: no element
    assert empty.sizes == {"i": 0, "q": 3}


def test_attention_over_no_keys_names_them():
    """A softmax over no keys: NumPy's max of nothing raised a bare ValueError (and the
    reshape of an empty key tensor inferred its heads from -1: another)."""
    q = nm.tensor(np.ones((2, 3), np.float32), "length d_kv")
    k = nm.tensor(np.ones((0, 3), np.float32), "memory d_kv")
    with pytest.raises(nm.ShapeError, match=r"keys \(memory: 0, d_kv: 3\) have no position"):
        nm.dot_product_attention(q, k, k)


def empty_ops(x):
    """Ops whose jax implementation makes an empty result afresh (jnp.where's), typed
    invariant where the plan has it varying: a PlanMismatch."""
    ints = nm.astype(x, np.int32)
    return [ints // 2, nm.top_k(x, "q", 2, new_dim="k")[1]]


def test_empty_results_of_ops_along_split_dims_keep_their_type():
    a = np.ones((0, 8), np.float32)
    want = [np.floor_divide(a.astype(np.int32), 2), np.zeros((0, 2), np.int32)]
    for layout in ("q:m0", "p:m0"):
        got = lowered(empty_ops, MESH, Layout(layout))(nm.tensor(a, "p q"))
        for g, w in zip(got, want, strict=True):
            assert g.data.shape == w.shape and g.dtype == w.dtype


def test_attention_of_an_empty_head_dim_is_empty():
    """No query: the group of q's heads per k's (0 // 0) was a raw ZeroDivisionError."""
    q = nm.tensor(np.ones((0, 2, 3), np.float32), "h length d_kv")
    k = nm.tensor(np.ones((0, 4, 3), np.float32), "h memory d_kv")
    want = np.einsum("hld,hmd->hld", q.data, k.data)  # NumPy's empty result of q's shape
    assert nm.dot_product_attention(q, k, k).data.shape == want.shape

    def attend(a, b):
        keys = nm.tensor(b, k.dims)
        return nm.dot_product_attention(nm.tensor(a, q.dims), keys, keys).data

    assert jax.jit(attend)(q.data, k.data).shape == want.shape


def two_empty(a, b):
    return nm.einsum(a, b, out="")


@pytest.mark.xfail(strict=True, raises=jax.errors.JaxRuntimeError,
                   reason="jax 0.10's Shardy: a shard_map whose used inputs are all empty, "
                   "two or more, does not compile (GlobalToLocalShape)")  # fmt: skip
def test_a_program_of_two_empty_inputs_lowers():
    """Found by the edge programs; a jax bug (jax.jit(jax.shard_map(lambda a, b:
    (a * b).sum(), ...)) of two empty arrays fails alike): when it passes, remove this
    mark and test_edge_props.jax_shardy_bug."""
    a = np.ones(0, np.float32)
    got = lowered(two_empty, Mesh({"m0": 2}), Layout(""))(nm.tensor(a, "p"), nm.tensor(a, "p"))
    assert got.data == np.einsum("p,p->", a, a)
