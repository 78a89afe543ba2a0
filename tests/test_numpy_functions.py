"""NumPy's functions on Tensors (namedmesh/numpy_dispatch.py) give NumPy's values on the same
data, in each spelling NumPy takes: axis by dim name, keywords (np.clip's a_min/a_max and
NumPy 2's min/max, keepdims=False, np.round's decimals), for bool, int8, uint8 and
float32 with NaN and signed zeros. Values are held to NumPy's (the dtype may differ: an
int8 sum is NumPy's int64, namedmesh's int32, as jax's)."""

import numpy as np
import pytest

import namedmesh as nm

DATA = {
    "bool": np.array([[True, True, False], [True, False, False]]),
    "int8": np.array([[100, 100, 27], [-128, -1, 5]], np.int8),
    "uint8": np.array([[200, 100, 1], [255, 0, 3]], np.uint8),
    "float32": np.array([[1.5, np.nan, -2.0], [0.0, 3.25, -0.0]], np.float32),
}
# (label, the call on a Tensor, the call on its array): axis "c" is NumPy's axis 1
CALLS = [
    ("sum", lambda t: np.sum(t, axis="c"), lambda a: np.sum(a, axis=1)),
    ("sum all", np.sum, np.sum),
    ("sum keepdims=False", lambda t: np.sum(t, axis="c", keepdims=False),
     lambda a: np.sum(a, axis=1, keepdims=False)),
    ("prod", lambda t: np.prod(t, axis="c"), lambda a: np.prod(a, axis=1)),
    ("max", lambda t: np.max(t, axis="c"), lambda a: np.max(a, axis=1)),
    ("amin over both", lambda t: np.amin(t, axis=("a", "c")), lambda a: np.amin(a, axis=(0, 1))),
    ("argmax", lambda t: np.argmax(t, axis="c"), lambda a: np.argmax(a, axis=1)),
    ("cumsum", lambda t: np.cumsum(t, axis="c"), lambda a: np.cumsum(a, axis=1)),
    ("any", lambda t: np.any(t, axis="c"), lambda a: np.any(a, axis=1)),
    ("clip", lambda t: np.clip(t, 0, 50), lambda a: np.clip(a, 0, 50)),
    ("clip a_min a_max", lambda t: np.clip(t, a_min=0, a_max=50),
     lambda a: np.clip(a, a_min=0, a_max=50)),
    ("clip min max", lambda t: np.clip(t, min=1, max=50), lambda a: np.clip(a, min=1, max=50)),
    ("clip max only", lambda t: np.clip(t, max=50), lambda a: np.clip(a, max=50)),
    ("where", lambda t: np.where(t > 0, t, 7), lambda a: np.where(a > 0, a, 7)),
    ("round", np.round, np.round),
    ("abs", np.abs, np.abs),
    ("minimum", lambda t: np.minimum(t, 1), lambda a: np.minimum(a, 1)),
    ("zeros_like", np.zeros_like, np.zeros_like),
    ("ones_like float32", lambda t: np.ones_like(t, dtype=np.float32),
     lambda a: np.ones_like(a, dtype=np.float32)),
    ("full_like", lambda t: np.full_like(t, 7), lambda a: np.full_like(a, 7)),
]  # fmt: skip


@pytest.mark.parametrize("dtype", DATA)
@pytest.mark.parametrize("label, on_tensor, on_array", CALLS, ids=[c[0] for c in CALLS])
def test_numpy_functions_give_numpys_values(dtype, label, on_tensor, on_array):
    a = DATA[dtype]
    t = nm.tensor(a, "a c")
    with np.errstate(all="ignore"):
        want = np.asarray(on_array(a))
    got = on_tensor(t)
    assert isinstance(got, nm.Tensor)
    np.testing.assert_array_equal(np.asarray(got).astype(np.float64), want.astype(np.float64))


def test_clip_bound_given_twice_and_like_without_named_keywords_are_refused_by_name():
    t = nm.tensor(DATA["float32"], "a c")
    with pytest.raises(nm.NumPyDispatchError, match="'a_min' given twice"):
        np.clip(t, 0, 1, min=0)
    with pytest.raises(nm.NumPyDispatchError, match=r"nm.zeros_like takes no \['shape'\]"):
        np.zeros_like(t, shape=(3,))
    assert np.zeros_like(t).dtype == t.dtype and np.ones_like(t).dims == t.dims
