"""auto_layout finds the layouts the Mesh-TensorFlow paper's analysis says are best."""

import numpy as np
import pytest

import namedmesh as nm
from lowering import Layout, Mesh, auto_layout

A = nm.abstract
MESH = Mesh({"rows": 2, "cols": 4})


def mlp(x, w1, w2):
    return nm.einsum(nm.relu(nm.einsum(x, w1)), w2, out="batch d_model")


def mlp_inputs(b, d, h):
    return A({"batch": b, "d_model": d}), A({"d_model": d, "d_ff": h}), A({"d_ff": h, "d_model": d})


def layer(x, wq, wk, wv, wo, w1, w2):
    """A Transformer layer: multi-head attention and a ReLU FFN, with residuals."""
    q = nm.einsum(x, wq)
    k = nm.rename(nm.einsum(x, wk), seq="kseq")
    v = nm.rename(nm.einsum(x, wv), seq="kseq")
    att = nm.softmax(nm.einsum(q, k, out="batch heads seq kseq") * 0.125, "kseq")
    x = x + nm.einsum(nm.einsum(att, v, out="batch seq heads d_head"), wo, out="batch seq d_model")
    return x + nm.einsum(nm.relu(nm.einsum(x, w1)), w2, out="batch seq d_model")


def layer_inputs(b, s, d, heads, dh, f):
    proj = {"d_model": d, "heads": heads, "d_head": dh}
    return (
        A({"batch": b, "seq": s, "d_model": d}),
        A(proj),
        A(proj),
        A(proj),
        A({"heads": heads, "d_head": dh, "d_model": d}),
        A({"d_model": d, "d_ff": f}),
        A({"d_ff": f, "d_model": d}),
    )


def test_large_batch_small_weights_is_data_parallel():
    layout, _ = auto_layout(mlp, MESH, *mlp_inputs(8192, 64, 256), grad_argnums=(1, 2))
    assert layout == Layout("batch:rows,cols")


def test_small_batch_large_weights_splits_the_hidden_dim():
    layout, table = auto_layout(mlp, MESH, *mlp_inputs(16, 1024, 8192), grad_argnums=(1, 2))
    rules = dict(layout.rules)
    assert "d_ff" in rules and "batch" not in rules
    assert table[0].layout == layout and table[0].time < table[-1].time


def test_transformer_layer_large_batch_is_data_parallel():
    layout, _ = auto_layout(
        layer, MESH, *layer_inputs(512, 128, 256, 8, 32, 1024), grad_argnums=tuple(range(1, 7))
    )
    assert layout == Layout("batch:rows,cols")


def test_transformer_layer_large_model_shares_an_axis_between_heads_and_d_ff():
    """Megatron: attention heads and the FFN's hidden dim split on the same model axis."""
    layout, _ = auto_layout(
        layer, MESH, *layer_inputs(8, 128, 4096, 32, 128, 16384), grad_argnums=tuple(range(1, 7))
    )
    rules = dict(layout.rules)
    assert rules.get("heads") and rules.get("heads") == rules.get("d_ff")
    assert "batch" not in rules


def test_memory_limit_excludes_layouts_and_is_reported():
    inputs = mlp_inputs(8192, 64, 256)
    _, table = auto_layout(mlp, MESH, *inputs)
    tight = sorted(c.memory for c in table if np.isfinite(c.time))[1]
    layout, table = auto_layout(mlp, MESH, *inputs, memory_limit=tight)
    chosen = table[0]
    assert chosen.memory <= tight
    assert any("over memory limit" in c.note for c in table)
    assert "chosen" in chosen.note and "layout" in str(table).splitlines()[0]


def test_no_valid_layout_is_a_layout_error():
    with pytest.raises(nm.LayoutError, match="no layout"):
        auto_layout(mlp, MESH, *mlp_inputs(8192, 64, 256), memory_limit=1)
