"""isel, squeeze, expand_dims, var and std: against xarray (the oracle), on jax, and
lowered under layouts that split the dims they act on."""

import jax
import numpy as np
import pytest

import namedmesh as nm
from lowering import Layout, Mesh, lower

xr = pytest.importorskip("xarray")

R = np.random.default_rng(3)
A = nm.tensor(R.normal(size=(8, 8, 1)).astype(np.float32), "batch d unit")
XA = A.to_xarray()

CASES = {
    "isel int": (lambda t: nm.isel(t, batch=2), lambda x: x.isel(batch=2)),
    "isel negative": (lambda t: t.isel(d=-1), lambda x: x.isel(d=-1)),
    "isel slice": (
        lambda t: nm.isel(t, batch=slice(1, 8, 2)),
        lambda x: x.isel(batch=slice(1, 8, 2)),
    ),
    "isel both": (
        lambda t: t.isel({"batch": slice(4, None), "d": 0}),
        lambda x: x.isel(batch=slice(4, None), d=0),
    ),
    "squeeze all": (lambda t: nm.squeeze(t), lambda x: x.squeeze()),
    "squeeze one": (lambda t: t.squeeze("unit"), lambda x: x.squeeze("unit")),
    "expand one": (lambda t: nm.expand_dims(t, "one"), lambda x: x.expand_dims("one")),
    "expand sized": (lambda t: t.expand_dims({"new": 4}), lambda x: x.expand_dims({"new": 4})),
    "var": (lambda t: nm.var(t, "batch"), lambda x: x.var("batch")),
    "var all ddof": (lambda t: t.var(ddof=1), lambda x: x.var(ddof=1)),
    "std": (lambda t: nm.std(t, "batch d"), lambda x: x.std(["batch", "d"])),
    "std ddof": (lambda t: t.std("d", ddof=1), lambda x: x.std("d", ddof=1)),
}


def _check(got, want, rtol=1e-5):
    assert got.dims == want.dims, (got.dims, want.dims)
    np.testing.assert_allclose(np.asarray(got), want.values, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_against_xarray_eager_and_under_jit(name):
    op, oracle = CASES[name]
    want = oracle(XA)
    _check(op(A), want)
    _check(jax.jit(op)(A), want)


LAYOUTS = ["batch:rows;d:cols", "d:rows,cols", "batch:rows;new:cols"]


@pytest.mark.parametrize("rules", LAYOUTS)
def test_under_layouts(rules):
    """Every case at once (one compile per layout), lowered on a 2x4 mesh, against
    xarray; the layout splits the dims each op selects, reduces or adds."""
    fn = lambda t: [op(t) for op, _ in CASES.values()]
    mesh = Mesh({"rows": 2, "cols": 4})
    f = lower(fn, mesh, Layout(rules, shared=True))  # "new" only where expand_dims adds it
    for got, (_, oracle) in zip(f(A), CASES.values(), strict=True):
        _check(got, oracle(XA))


def test_var_over_a_split_dim_psums_twice_and_moves_no_data():
    f = lower(lambda t: nm.var(t, "batch"), Mesh({"rows": 2, "cols": 4}), "batch:rows,cols")
    text = str(f.plan(A))
    assert text.count("psum over rows,cols") == 2 and "all_gather" not in text


def test_gradient_of_std_under_a_layout_matches_xarray_free_numpy():
    loss = lambda t: nm.std(t, "batch").sum()
    f = lower(loss, Mesh({"rows": 2, "cols": 4}), "batch:rows,cols")
    g = nm.grad(f)(A)
    x = A.data.astype(np.float64)
    dev = x - x.mean(0)
    want = dev / (x.shape[0] * np.sqrt((dev**2).mean(0)))
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: A.isel(batch=8), r"index 8 is out of range for dim 'batch' of size 8"),
        (lambda: A.isel(bacth=0), r"did you mean 'batch'"),
        (lambda: A.isel(batch=[0, 1]), r"nm.gather"),
        (lambda: A.squeeze("d"), r"\['d: 8'\].*other than 1"),
        (lambda: A.expand_dims("d"), r"\['d'\] are already dims"),
        (lambda: A.var(0), r"by name, not by position.*'batch'"),
    ],
)
def test_errors(call, match):
    with pytest.raises(nm.ShapeError, match=match):
        call()
