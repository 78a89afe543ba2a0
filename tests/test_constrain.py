"""nm.constrain: the identity on one device; under lowering it pins a value's layout."""

import jax
import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, lower

R = np.random.default_rng(0)
X = nm.tensor(R.normal(size=(8, 16)).astype(np.float32), "batch seq")
MESH = Mesh({"rows": 2, "cols": 4})


def test_eager_identity():
    y = nm.constrain(X, "seq:cols")
    assert y.dims == X.dims and np.array_equal(y.data, X.data)
    assert np.array_equal(nm.constrain(X, {"batch": ("rows", "cols")}).data, X.data)


def pinned(x):
    y = nm.constrain(nm.tanh(x), "seq:rows,cols")
    return nm.constrain(y * 2, {"batch": "cols"})


def test_constrained_values_take_the_pinned_layout():
    lowered = lower(pinned, MESH, "batch:rows;seq:cols")
    np.testing.assert_allclose(np.asarray(lowered(X).data), 2 * np.tanh(X.data), rtol=1e-6)
    steps = [s for s in lowered.plan(X) if s.name == "constrain"]
    assert [s.outputs[0][1] for s in steps] == [((), ("rows", "cols")), (("cols",), ())]


def test_gradient_through_constraints():
    lowered = lower(lambda x: (pinned(x) ** 2).sum(), MESH, "batch:rows;seq:cols")
    got = jax.grad(lambda x: lowered(x).data)(X)
    want = jax.grad(lambda x: (pinned(x) ** 2).sum().data)(X)
    np.testing.assert_allclose(np.asarray(got.data), np.asarray(want.data), rtol=1e-5)


@pytest.mark.parametrize(
    "layout, match",
    [
        ("heads:rows", r"names dim\(s\) \['heads'\] that the value \('batch', 'seq'\) lacks"),
        ("seq:nope", "mesh axis"),
        ("batch:rows;seq:rows", "would split both"),
    ],
)
def test_bad_constraints_are_layout_errors_before_compiling(layout, match):
    with pytest.raises(nm.LayoutError, match=match):
        lower(lambda x: nm.constrain(x, layout), MESH, "").plan(X)


def test_indivisible_constraint_names_the_dim():
    odd = nm.tensor(np.zeros((6, 16), np.float32), "batch seq")
    with pytest.raises(nm.LayoutError, match="'batch' of size 6"):
        lower(lambda x: nm.constrain(x, "batch:cols"), MESH, "").plan(odd)


def test_layout_must_be_rules():
    with pytest.raises(nm.ShapeError, match="layout must be"):
        nm.constrain(X, 3)
