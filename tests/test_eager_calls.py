"""Eager ops remembered per signature (namedmesh/eager.py) answer a repeat exactly as the
first call did and as NumPy computes it: values, dims, dtypes, errors and warnings; a
scalar's value, a float's sign, a trace and jax data are never mixed up with a
remembered call."""

import threading
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

import namedmesh as nm
from namedmesh.checks import DimNameWarning
from namedmesh.errors import ShapeError

R = np.random.default_rng(0)
A = R.standard_normal((3, 4)).astype(np.float32)
B = R.standard_normal((3, 4)).astype(np.float32)
I8 = R.integers(-20, 20, (3, 4)).astype(np.int8)

# (what, namedmesh call of x, y (A, B as "i j") and k (I8 as "i j"), NumPy's answer and dims)
CASES = [
    ("x + y", lambda x, y, k: x + y, A + B, "i j"),
    ("x * 2.0", lambda x, y, k: x * 2.0, A * np.float32(2.0), "i j"),
    ("x * 3.0", lambda x, y, k: x * 3.0, A * np.float32(3.0), "i j"),
    ("2.0 - x", lambda x, y, k: 2.0 - x, np.float32(2.0) - A, "i j"),
    ("k + 1", lambda x, y, k: k + 1, I8 + np.int8(1), "i j"),
    ("k + 1.5", lambda x, y, k: k + 1.5, I8.astype(np.float32) + 1.5, "i j"),
    ("x + y^T", lambda x, y, k: x + y.transpose("j", "i"), A + B, "i j"),
    ("exp(k)", lambda x, y, k: nm.exp(k), np.exp(I8.astype(np.float32)), "i j"),
    ("k.sum(j)", lambda x, y, k: k.sum("j"), I8.sum(1).astype(np.int32), "i"),
    ("k.sum()", lambda x, y, k: k.sum(), np.int32(I8.sum()), ""),
    ("x.mean(i)", lambda x, y, k: x.mean("i"), A.mean(0), "j"),
    ("max(x, j)", lambda x, y, k: nm.max(x, "j"), A.max(1), "i"),
    ("softmax", lambda x, y, k: nm.softmax(x, "j"), scipy.special.softmax(A, 1), "i j"),
    ("transpose", lambda x, y, k: x.transpose("j", "i"), A.T, "j i"),
    ("reshape", lambda x, y, k: nm.reshape(x, {"n": 12}, from_="j i"), A.T.reshape(12), "n"),
    ("isel", lambda x, y, k: x.isel(i=-1), A[-1], "j"),
    ("slice", lambda x, y, k: x.isel(j=slice(1, 3)), A[:, 1:3], "i j"),
    ("concat", lambda x, y, k: nm.concat([x, y], "i"), np.concatenate([A, B]), "i j"),
    ("einsum", lambda x, y, k: nm.einsum(x, y, out="j"), (A * B).sum(0), "j"),
    ("where", lambda x, y, k: nm.where(x > 0, x, 0.0), np.where(A > 0, A, 0), "i j"),
    ("astype", lambda x, y, k: x.astype(np.int32), A.astype(np.int32), "i j"),
]


@pytest.mark.parametrize("what, call, want, dims", CASES, ids=[c[0] for c in CASES])
def test_a_repeat_answers_as_numpy(what, call, want, dims):
    x, y, k = nm.tensor(A, "i j"), nm.tensor(B, "i j"), nm.tensor(I8, "i j")
    for _ in range(3):  # the first call is recorded; the others replay it
        got = call(x, y, k)
        assert got.dims == tuple(dims.split()) and type(got.data) is np.ndarray
        assert got.data.dtype == np.asarray(want).dtype, what
        np.testing.assert_allclose(got.data, want, rtol=1e-6, atol=1e-6)


def test_equal_scalars_that_act_apart_are_not_mixed_up():
    x = nm.tensor(np.ones(2, np.float32), "i")
    for v in (0.0, -0.0, 0.0, -0.0):
        assert np.signbit((x * v).data[0]) == np.signbit(v)
    ints = nm.tensor(np.array([3, 4], np.int32), "i")
    for _ in range(2):  # 1, 1.0 and True are equal keys in a dict, not here
        assert (ints + 1).dtype == np.int32 and (ints + 1.0).dtype == np.float32
        assert (ints * True).dtype == np.int32


def test_one_tensor_given_twice_is_not_replayed_for_two():
    x, y = nm.tensor(A, "i j"), nm.tensor(B, "i j")
    for _ in range(2):  # the same signature as x - y, recorded with one Tensor twice
        np.testing.assert_array_equal((x - x).data, np.zeros_like(A))
        np.testing.assert_allclose((x - y).data, A - B)
        np.testing.assert_allclose(nm.concat([y, y], "i").data, np.concatenate([B, B]))
        np.testing.assert_allclose(nm.concat([x, y], "i").data, np.concatenate([A, B]))


def test_a_result_does_not_share_a_constant_of_the_call():
    x = nm.tensor(np.ones(3, np.float32), "i")
    first = nm.where(x > 0, 5.0, x)
    first.data[:] = -1  # the caller owns its result
    np.testing.assert_array_equal(nm.where(x > 0, 5.0, x).data, [5.0, 5.0, 5.0])


def test_errors_and_warnings_come_on_every_call():
    x, z = nm.tensor(np.ones((2, 3)), "i j"), nm.tensor(np.ones((3, 3)), "i j")
    for _ in range(2):
        with pytest.raises(ShapeError, match="'i' has size 2 .* but 3"):
            x + z
    batch, bacth = nm.tensor(np.ones(2), "batch"), nm.tensor(np.ones(2), "bacth")
    for _ in range(2):
        with pytest.warns(DimNameWarning, match="did you mean"):
            batch + bacth


def test_an_op_returning_its_input_returns_it_again():
    x = nm.tensor(A, "i j")
    assert all(x.transpose("i", "j") is x for _ in range(3))
    assert all(nm.squeeze(x) is x for _ in range(3))


def test_a_trace_and_jax_data_are_not_answered_from_memory():
    x = nm.tensor(A, "i j")
    (x * 2.0).sum("j")  # remembered eagerly
    graph = nm.trace(lambda t: (t * 2.0).sum("j"), x)
    assert [e.primitive.name for e in graph.eqns] == ["multiply", "sum"]
    got = (nm.tensor(jnp.asarray(A), "i j") * 2.0).sum("j")
    assert not isinstance(got.data, np.ndarray)
    np.testing.assert_allclose(np.asarray(got.data), (A * 2).sum(1), rtol=1e-6)


def test_threads_recording_at_once_get_their_own_answers():
    """Calls recorded in several threads at once replay only their own thread's binds."""
    errors = []

    def work(n):
        try:
            arr = np.full((n, 2), float(n), np.float32)
            t = nm.tensor(arr, "i j")
            for _ in range(50):
                got = nm.softmax(t * float(n) + 1.0, "i").isel(j=0)
                np.testing.assert_allclose(got.data, np.full(n, 1.0 / n), rtol=1e-6)
        except Exception as e:  # reported below, from the main thread
            errors.append(e)

    with warnings.catch_warnings():
        threads = [threading.Thread(target=work, args=(n,)) for n in range(1, 7)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
