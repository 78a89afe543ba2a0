"""namedmesh.testing's public API: one case, many cases, and the failure report."""

import numpy as np
import pytest

import namedmesh as nm
from lowering import Layout, Mesh
from lowering.plan import RuleContext
from namedmesh.testing import assert_same_as_reference, check_layouts, compare, tolerance

R = np.random.default_rng(0)
X = nm.tensor(R.normal(size=(4, 16)).astype(np.float32), "batch d_model")
W1 = nm.tensor(R.normal(size=(16, 32)).astype(np.float32), "d_model d_ff")
W2 = nm.tensor(R.normal(size=(32, 16)).astype(np.float32), "d_ff d_model")


def mlp(x, w1, w2):
    return nm.einsum(nm.relu(nm.einsum(x, w1)), w2, out="batch d_model")


def test_one_case_passes():
    assert_same_as_reference(mlp, Mesh({"rows": 2, "cols": 4}), "batch:rows;d_ff:cols", X, W1, W2)


def test_many_drawn_cases_pass_and_are_counted():
    assert check_layouts(mlp, X, W1, W2, max_examples=20) >= 5


def test_given_meshes_and_layouts():
    meshes = [Mesh({"x": 2}), Mesh({"x": 8})]
    assert (
        check_layouts(
            mlp, X, W1, W2, meshes=meshes, layouts=["d_ff:x", "d_model:x"], max_examples=8
        )
        >= 1
    )


@pytest.fixture
def psum_forgets_an_axis(monkeypatch):
    psum = RuleContext.psum
    monkeypatch.setattr(RuleContext, "psum", lambda ctx, x, axes: psum(ctx, x, tuple(axes)[1:]))


def test_a_mismatch_reports_the_smallest_case_and_a_snippet_that_reproduces_it(
    psum_forgets_an_axis,
):
    with pytest.raises(AssertionError) as info:
        check_layouts(mlp, X, W1, W2, max_examples=200)
    text = str(info.value)
    assert "differs from its reference on Mesh(" in text and "smallest case found" in text
    snippet = text.split("Reproduce with:\n", 1)[1]
    assert "assert_same_as_reference(mlp, Mesh(" in snippet
    mesh_text = text.split(" on ", 1)[1].split(" under ")[0]
    assert mesh_text.count("=") <= 2  # shrunk to a mesh of at most two axes
    with pytest.raises(AssertionError, match="differs from the reference"):
        exec(snippet, {"mlp": mlp, "inputs": (X, W1, W2)})


def test_compare_checks_dims_dtype_and_values():
    a = nm.tensor(np.ones((2, 3), np.float32), "x y")
    compare(a, a)
    with pytest.raises(AssertionError, match="dims"):
        compare(a, a.transpose("y", "x"))
    with pytest.raises(AssertionError, match="dtype"):
        compare(a, a.astype(np.float64))
    with pytest.raises(AssertionError, match="differs from the reference by up to 1"):
        compare(a, a * 2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_compare_takes_a_flushed_subnormal_for_zero_and_nothing_larger(dtype):
    """Compiled XLA code may flush subnormal results to zero, which NumPy keeps; the
    smallest normal number itself (or a normal one against a subnormal) still differs."""
    import ml_dtypes

    tiny = float(ml_dtypes.finfo(dtype).tiny)
    want = nm.tensor(np.array([0.0, tiny / 2, 1.0]).astype(dtype), "x")
    flushed = nm.tensor(np.array([0.0, 0.0, 1.0]).astype(dtype), "x")
    compare(flushed, want, rtol=0.0)
    for wrong in ([tiny, tiny / 2, 1.0], [0.0, tiny, 1.0]):
        with pytest.raises(AssertionError, match="differs"):
            compare(nm.tensor(np.array(wrong).astype(dtype), "x"), want, rtol=0.0)


def test_tolerance_fits_the_dtype():
    assert tolerance(np.float32) == (2e-4, 2e-5)
    assert tolerance(np.int32) == (0.0, 0.0)
    assert tolerance(np.float64)[0] < 1e-8


def test_layout_objects_and_strings_are_both_accepted():
    mesh = Mesh({"rows": 2, "cols": 4})
    assert_same_as_reference(mlp, mesh, Layout("batch:rows;d_model:cols"), X, W1, W2)
    with pytest.raises(nm.LayoutError):
        assert_same_as_reference(mlp, mesh, "batch:rows;d_ff:nope", X, W1, W2)
