"""Convolution and pooling along split spatial dims (halos by ppermute), stack and prod,
against the eager single-device results."""

import jax
import numpy as np
import pytest

import namedmesh as nm
from lowering import Layout, Mesh, lower

R = np.random.default_rng(0)
IMG = nm.tensor(R.normal(size=(2, 16, 16, 3)).astype(np.float32), "b h w c")
K2 = nm.tensor(R.normal(size=(3, 3, 3, 4)).astype(np.float32), "kh kw c o")
K1 = nm.tensor(R.normal(size=(5, 3, 4)).astype(np.float32), "kh c o")
MESH = Mesh({"rows": 2, "cols": 4})

CASES = {
    "same3x3": lambda x: nm.conv(x, K2, {"h": "kh", "w": "kw"}, padding="SAME"),
    "same_stride2": lambda x: nm.conv(x, K2, {"h": "kh", "w": "kw"}, padding="SAME", stride=2),
    "valid": lambda x: nm.conv(x, K2, {"h": "kh", "w": "kw"}),
    "dilated": lambda x: nm.conv(x, K2, {"h": "kh", "w": "kw"}, padding="SAME", dilation=2),
    "1d_causal": lambda x: nm.conv(x, K1, {"h": "kh"}, padding={"h": (4, 0)}),
    "maxpool": lambda x: nm.pool(x, {"h": 2, "w": 2}),
    "maxpool_overlap": lambda x: nm.pool(x, {"h": 3}, stride=1, padding="SAME"),
    "meanpool": lambda x: nm.pool(x, {"h": 2, "w": 4}, kind="mean"),
}
HALO = {"same3x3", "same_stride2", "dilated", "1d_causal", "maxpool_overlap"}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("layout", ["h:rows;w:cols", "h:rows,cols", "b:rows;w:cols"])
def test_spatial_ops_match_eager(name, layout):
    fn = CASES[name]
    lowered = lower(fn, MESH, layout)
    if name == "valid":  # 14 x 14 outputs, which none of these layouts' axes divide
        with pytest.raises(nm.LayoutError, match="of size 14 is not divisible"):
            lowered(IMG)
        return
    np.testing.assert_allclose(np.asarray(lowered(IMG).data), fn(IMG).data, rtol=1e-5, atol=1e-5)
    kinds = {c[0] for s in lowered.plan(IMG) for c in s.collectives}
    if layout == "h:rows;w:cols" and name in HALO:
        assert kinds == {"ppermute"}  # halos only: nothing gathered
    if name in ("maxpool", "meanpool") and layout != "b:rows;w:cols":
        assert kinds == set()  # windows tile the shards


def test_conv_gradient_through_halos():
    fn = CASES["same3x3"]
    lowered = lower(lambda x: (fn(x) ** 2).sum(), MESH, "h:rows;w:cols")
    got = jax.grad(lambda x: lowered(x).data)(IMG)
    want = jax.grad(lambda x: (fn(x) ** 2).sum().data)(IMG)
    np.testing.assert_allclose(np.asarray(got.data), np.asarray(want.data), rtol=1e-4, atol=1e-4)


X = nm.tensor(R.uniform(0.5, 1.5, size=(8, 16)).astype(np.float32), "a b")


@pytest.mark.parametrize("layout", ["a:rows;b:cols", "b:rows,cols", "n:cols;a:rows"])
@pytest.mark.parametrize(
    "fn",
    [
        lambda t: nm.prod(t, "b"),
        lambda t: nm.prod(t),
        lambda t: nm.stack([t, t * 2, t * 3, t * 4], "n"),
    ],
)
def test_prod_and_stack_match_eager(fn, layout):
    got = lower(fn, MESH, Layout(layout, shared=True))(X)  # only stack makes "n"
    want = fn(X)
    np.testing.assert_allclose(np.asarray(got.data), want.data, rtol=1e-5)
    assert got.dims == want.dims
