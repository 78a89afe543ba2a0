import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import namedmesh as nm
from namedmesh import ShapeError

rng = np.random.default_rng(0)


def t(dims, sizes, dtype=np.float64):
    dims = dims.split()
    return nm.tensor(rng.normal(size=[sizes[d] for d in dims]).astype(dtype), dims)


S = {"a": 2, "b": 3, "c": 4, "d": 5, "e": 3}


@pytest.mark.parametrize(
    "ins, out, spec",
    [
        (["a b", "b c"], None, "ab,bc->ac"),  # matmul
        (["a b", "b c"], "c a", "ab,bc->ca"),  # out fixes order
        (["b", "b"], None, "b,b->"),  # dot
        (["a", "c"], None, "a,c->ac"),  # outer product
        (["a b c", "a c d"], "a b d", "abc,acd->abd"),  # batched matmul
        (["a b"], "a", "ab->a"),  # sum over a dim
        (["a b"], "b a", "ab->ba"),  # transpose
        (["a b c", "c"], "b", "abc,c->b"),  # summed dim only in one operand
        (["a b", "b c", "c d"], None, "ab,bc,cd->ad"),
        (["a b", "b c", "c d", "d e"], "e a", "ab,bc,cd,de->ea"),
        (["a b", "a c", "a d"], "a b c d", "ab,ac,ad->abcd"),
    ],
)
def test_einsum_matches_numpy(ins, out, spec):
    ops = [t(d, S) for d in ins]
    got = nm.einsum(*ops, out=out)
    want = np.einsum(spec, *(o.data for o in ops))
    assert "".join(got.dims) == spec.split("->")[1]
    np.testing.assert_allclose(got.data, want, rtol=1e-10, atol=1e-12)


def test_out_none_keeps_dims_in_exactly_one_operand_in_first_occurrence_order():
    x, y = t("b a", S), t("c b", S)
    assert nm.einsum(x, y).dims == ("a", "c")
    x, y, z = t("a b", S), t("b c", S), t("c a", S)
    assert nm.einsum(x, y, z).dims == ()  # every dim appears twice: full contraction


def test_embedding_lookup_by_one_hot_is_an_einsum():
    table = t("vocab d", {"vocab": 6, "d": 4})
    ids = nm.tensor(np.array([[1, 5], [0, 1]]), "batch seq")
    emb = nm.einsum(nm.one_hot(ids, "vocab", 6, dtype=np.float64), table)
    assert emb.dims == ("batch", "seq", "d")
    np.testing.assert_allclose(emb.data, table.data[ids.data])


def test_nary_is_traced_as_pairwise_einsums_in_opt_einsum_order():
    import opt_einsum

    sizes = {"i": 64, "j": 2, "k": 64, "l": 2}
    ops = [t("i j", sizes), t("j k", sizes), t("k l", sizes)]
    g = nm.trace(lambda *xs: nm.einsum(*xs, out="i l"), *ops)
    assert [e.primitive.name for e in g.eqns] == ["einsum", "einsum"]
    assert all(len(e.inputs) == 2 for e in g.eqns)
    _, info = opt_einsum.contract_path("ij,jk,kl->il", *(o.data for o in ops))
    first = info.contraction_list[0][0]
    first_dims = {d for i in first for d in ops[i].dims}
    assert {d for v in g.eqns[0].inputs for d in v.dims} == first_dims
    np.testing.assert_allclose(
        nm.reference(g)(*ops).data, np.einsum("ij,jk,kl->il", *(o.data for o in ops))
    )


def test_dot_keeps_shared_dims_as_batch():
    x, y = t("a b c", S), t("a c d", S)
    got = nm.dot(x, y, over="c")
    assert got.dims == ("a", "b", "d")
    np.testing.assert_allclose(got.data, np.einsum("abc,acd->abd", x.data, y.data))


def test_dtype_promotion():
    x, y = t("a b", S, np.float32), nm.tensor(np.ones((3, 4), np.int32), "b c")
    assert nm.einsum(x, y).dtype == np.float32


def test_size_mismatch_names_dim_and_sizes():
    x = nm.zeros({"a": 2, "b": 3})
    y = nm.zeros({"b": 4, "c": 5})
    with pytest.raises(ShapeError, match=r"dim 'b' has size 3 .* but 4"):
        nm.einsum(x, y)


def test_out_dim_in_no_operand():
    with pytest.raises(ShapeError, match=r"\['z'\] are in no operand"):
        nm.einsum(nm.zeros({"a": 2}), out="a z")


def test_repeated_out_dim():
    with pytest.raises(ShapeError, match=r"repeated dim name.*'a'"):
        nm.einsum(nm.zeros({"a": 2}), out="a a")


def test_non_tensor_operand():
    with pytest.raises(TypeError, match="operand 1"):
        nm.einsum(nm.zeros({"a": 2}), np.zeros(2))


NAMES = list("pqrstu")


@st.composite
def einsum_cases(draw):
    sizes = {n: draw(st.integers(1, 4)) for n in NAMES}
    n_ops = draw(st.integers(1, 4))
    ops = [draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=4)) for _ in range(n_ops)]
    present = list(dict.fromkeys(d for o in ops for d in o))
    out = None
    if draw(st.booleans()):
        out = draw(st.permutations(present).map(lambda p: p[: draw(st.integers(0, len(p)))]))
    seed = draw(st.integers(0, 2**31 - 1))
    return sizes, ops, out, seed


@given(einsum_cases())
def test_random_einsums_match_numpy(case):
    sizes, ops, out, seed = case
    r = np.random.default_rng(seed)
    arrays = [r.normal(size=[sizes[d] for d in o]) for o in ops]
    tensors = [nm.tensor(a, o) for a, o in zip(arrays, ops, strict=True)]
    got = nm.einsum(*tensors, out=out)
    letters = {d: chr(97 + i) for i, d in enumerate(NAMES)}
    if out is None:
        counts = [d for o in ops for d in o]
        out_dims = [d for d in dict.fromkeys(counts) if counts.count(d) == 1]
    else:
        out_dims = list(out)
    spec = ",".join("".join(letters[d] for d in o) for o in ops)
    spec += "->" + "".join(letters[d] for d in out_dims)
    assert got.dims == tuple(out_dims)
    np.testing.assert_allclose(got.data, np.einsum(spec, *arrays), rtol=1e-9, atol=1e-9)


def test_eager_ops_remembered_per_signature_stay_exact():
    """Eager NumPy ops remember their shape rule's answer and kernel per (params, dims,
    shapes, dtypes): a repeat with other shapes, dtypes, dim orders or params, or a bad
    size, is answered afresh, as numpy computes it."""
    r = np.random.default_rng(0)
    for shape, dt in [((3, 4, 5), np.float32), ((2, 4, 6), np.float32), ((3, 4, 5), np.float64)]:
        a, b = r.standard_normal(shape[:2]).astype(dt), r.standard_normal(shape[1:]).astype(dt)
        for _ in range(2):
            got = nm.einsum(nm.tensor(a, "i j"), nm.tensor(b, "j k"))
            assert got.dims == ("i", "k") and got.data.dtype == dt
            np.testing.assert_allclose(got.data, a @ b, rtol=1e-6)
        got = nm.einsum(nm.tensor(a, "i j"), nm.tensor(b, "j k"), out="k i")
        np.testing.assert_allclose(got.data, (a @ b).T, rtol=1e-6)
        got = nm.einsum(nm.tensor(a.T, "j i"), nm.tensor(b, "j k"))  # a transpose in the plan
        np.testing.assert_allclose(got.data, a @ b, rtol=1e-6)
    for _ in range(2):  # the size check is not skipped on a repeat
        with pytest.raises(ShapeError, match="'j' has size 4 .* but 3"):
            nm.einsum(nm.tensor(np.ones((2, 4)), "i j"), nm.tensor(np.ones((3, 2)), "j k"))
    x = nm.tensor(np.ones(2, np.float32), "i")
    for v in (0.0, -0.0):  # equal params that act differently are not mixed up
        assert np.signbit(nm.pad(x, {"i": 1}, value=v).data[0]) == np.signbit(v)
