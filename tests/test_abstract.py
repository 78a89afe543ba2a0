"""Planning without devices: nm.abstract tensors and abstract meshes larger than the machine."""

import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, auto_layout, lower


def mlp(x, w1, w2):
    return nm.einsum(nm.relu(nm.einsum(x, w1)), w2, out="batch d_model")


B, D, H = 1024, 1024, 32768
X = nm.abstract({"batch": B, "d_model": D})
W1 = nm.abstract({"d_model": D, "d_ff": H})
W2 = nm.abstract({"d_ff": H, "d_model": D})
PAPER_MESH = Mesh({"rows": 16, "cols": 32}, devices="abstract")  # 512 cores


def test_abstract_tensors_have_dims_and_no_values():
    assert X.sizes == {"batch": B, "d_model": D} and X.dtype == np.float32
    assert "(abstract)" in repr(X)
    assert nm.trace(mlp, X, W1, W2).outputs[0].shape == (B, D)


def test_report_on_a_512_core_mesh_matches_the_hand_count():
    report = lower(mlp, PAPER_MESH, "batch:rows;d_ff:cols").report(X, W1, W2, show=False)
    b, h = B // 16, H // 32
    matmul_flops = 2 * b * D * h * 2  # two local matmuls
    assert report.flops == pytest.approx(matmul_flops + b * h, rel=1e-9)  # + the relu
    ((kind, axes), (count, sent)) = next(iter(report.collectives.items()))
    assert (kind, axes, count) == ("psum", ("cols",), 1)
    assert sent == pytest.approx(2 * 31 / 32 * b * D * 4)


def test_abstract_mesh_refuses_to_run():
    with pytest.raises(nm.MeshError, match="no devices"):
        lower(mlp, PAPER_MESH, "batch:rows")(X, W1, W2)


def test_auto_layout_on_an_abstract_mesh_splits_the_big_hidden_dim():
    layout, table = auto_layout(mlp, PAPER_MESH, X, W1, W2, grad_argnums=(1, 2), rates="tpu_v2")
    assert "d_ff" in str(layout) and table[0].layout == layout
