"""The model zoo's blocks against NumPy, the paper's configs against the paper's parameter
counts and mesh shapes, and the LM's loss under several layouts against one device."""

import functools
import math

import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, lower
from models import architecture as config
from models import catalog, transformer, zoo
from models.layers import common as layers
from models.training import data
from models.training.trainer import OptimizerSpec, Trainer, TrainSpec, optimizer

R = np.random.default_rng(0)


def t(shape, dims, scale=1.0):
    return nm.tensor((R.normal(size=shape) * scale).astype(np.float32), dims)


def np_softmax(x, axis):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


CFG = config.Config(vocab=32, d_model=16, heads=4, d_kv=4, d_ff=32, layers=2, length=8, batch=4)


def test_layer_norm_and_rms_norm_equal_numpy():
    x = t((2, 3, 16), ("batch", "length", "d_model"))
    scale, bias = t((16,), ("d_model",)), t((16,), ("d_model",))
    mu = x.data.mean(-1, keepdims=True)
    var = ((x.data - mu) ** 2).mean(-1, keepdims=True)
    want = (x.data - mu) / np.sqrt(var + 1e-6) * scale.data + bias.data
    got = layers.norm(x, {"scale": scale, "bias": bias}, "layer")
    np.testing.assert_allclose(got.data, want, rtol=1e-4, atol=1e-5)
    rms = x.data / np.sqrt((x.data**2).mean(-1, keepdims=True) + 1e-6) * scale.data
    np.testing.assert_allclose(
        layers.norm(x, {"scale": scale}, "rms").data, rms, rtol=1e-4, atol=1e-5
    )


def attention_params():
    return {
        "q": t((16, 2, 4), ("d_model", "heads", "d_kv"), 0.3),
        "k": t((16, 2, 4), ("d_model", "heads", "d_kv"), 0.3),
        "v": t((16, 2, 4), ("d_model", "heads", "d_kv"), 0.3),
        "o": t((2, 4, 16), ("heads", "d_kv", "d_model"), 0.3),
    }


def np_gelu(x):
    """GELU's tanh approximation, as nm.gelu (and jax.nn.gelu) compute it."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def np_attention(x, p, mask):
    q = np.einsum("bld,dhk->bhlk", x, p["q"].data)
    k = np.einsum("bmd,dhk->bhmk", x, p["k"].data)
    v = np.einsum("bmd,dhk->bhmk", x, p["v"].data)
    logits = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
    logits = np.where(mask, logits, -1e9)
    o = np_softmax(logits, -1) @ v
    return np.einsum("bhlk,hkd->bld", o, p["o"].data)


def test_causal_attention_equals_numpy():
    x = t((2, 5, 16), ("batch", "length", "d_model"))
    p = attention_params()
    pos = nm.arange("length", 5)
    bias = transformer.self_attention_bias({}, CFG, pos, pos.rename(length="memory"), True)
    got = layers.attention(x, p, CFG, bias=bias)
    causal = np.tril(np.ones((5, 5), bool))[None, None]
    np.testing.assert_allclose(got.data, np_attention(x.data, p, causal), rtol=1e-4, atol=1e-5)
    assert got.dims == ("batch", "length", "d_model")


def test_padding_mask_hides_padded_memory():
    x = t((2, 5, 16), ("batch", "length", "d_model"))
    p = attention_params()
    w = np.ones((2, 5), np.float32)
    w[1, 3:] = 0  # the second sequence has 3 real positions
    bias = layers.padding_bias(nm.tensor(w, ("batch", "memory")))
    got = layers.attention(x, p, CFG, bias=bias)
    mask = w[:, None, None, :] > 0
    np.testing.assert_allclose(got.data, np_attention(x.data, p, mask), rtol=1e-4, atol=1e-5)


def test_relative_bias_adds_the_learned_bias_of_each_distance():
    rel = t((2, 5), ("heads", "distance"))
    pos = nm.arange("length", 4)
    got = layers.relative_bias(rel, pos, pos.rename(length="memory"), 2)
    d = np.clip(np.arange(4)[None, :] - np.arange(4)[:, None], -2, 2) + 2
    np.testing.assert_allclose(got.transpose("heads", "length", "memory").data, rel.data[:, d])


@pytest.mark.parametrize("kind", ["relu", "gelu", "gated_gelu"])
def test_ffn_variants_equal_numpy(kind):
    cfg = CFG.replace(ffn=kind)
    x = t((3, 16), ("batch", "d_model"))
    p = {
        "wi": t((16, 32), ("d_model", "d_ff"), 0.3),
        "wo": t((32, 16), ("d_ff", "d_model"), 0.3),
        "wg": t((16, 32), ("d_model", "d_ff"), 0.3),
    }
    h = x.data @ p["wi"].data
    h = np.maximum(h, 0) if kind == "relu" else np_gelu(h)
    if kind == "gated_gelu":
        h = h * (x.data @ p["wg"].data)
    np.testing.assert_allclose(layers.ffn(x, p, cfg).data, h @ p["wo"].data, rtol=1e-3, atol=1e-4)


def test_cross_entropy_is_the_weighted_mean_negative_log_likelihood():
    logits = t((2, 3, 7), ("batch", "length", "vocab"))
    targets = R.integers(0, 7, size=(2, 3)).astype(np.int32)
    w = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
    logp = np.log(np_softmax(logits.data, -1))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    got = layers.cross_entropy(
        logits, nm.tensor(targets, ("batch", "length")), nm.tensor(w, ("batch", "length"))
    )
    np.testing.assert_allclose(got.data, (nll * w).sum() / w.sum(), rtol=1e-5)


def np_lm_logits(params, tokens, cfg):
    """The LM forward pass in plain NumPy, an independent statement of the model."""
    P = {k: np.asarray(v.data) for k, v in _flat(params).items()}

    def norm(x, scale, bias):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-6) * scale + bias

    x = P["embed"][tokens] + P["pos"][: tokens.shape[1]]
    n = tokens.shape[1]
    causal = np.tril(np.ones((n, n), bool))
    for i in range(cfg.layers):
        L = {k[len("layers/") :]: v[i] for k, v in P.items() if k.startswith("layers/")}
        h = norm(x, L["attn_norm/scale"], L["attn_norm/bias"])
        q = np.einsum("bld,dhk->bhlk", h, L["attn/q"])
        k = np.einsum("bmd,dhk->bhmk", h, L["attn/k"])
        v = np.einsum("bmd,dhk->bhmk", h, L["attn/v"])
        a = np.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(cfg.d_kv), -1e9)
        x = x + np.einsum("bhlk,hkd->bld", np_softmax(a, -1) @ v, L["attn/o"])
        h = norm(x, L["ffn_norm/scale"], L["ffn_norm/bias"])
        f = h @ L["ffn/wi"]
        f = np_gelu(f)
        x = x + f @ L["ffn/wo"]
    x = norm(x, P["final_norm/scale"], P["final_norm/bias"])
    return x @ P["embed"].T / math.sqrt(cfg.d_model)


def _flat(tree, prefix=""):
    if isinstance(tree, nm.Tensor):
        return {prefix: tree}
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}/{k}" if prefix else k))
    return out


def small_batch(cfg, seed=0):
    r = np.random.default_rng(seed)
    tok = r.integers(0, cfg.vocab, size=(cfg.batch, cfg.length + 1)).astype(np.int32)
    return {
        "inputs": tok[:, :-1],
        "targets": tok[:, 1:],
        "weights": np.ones((cfg.batch, cfg.length), np.float32),
    }


def test_lm_logits_equal_a_numpy_transformer():
    params = transformer.init(transformer.lm_shapes(CFG), 0)
    tokens = small_batch(CFG)["inputs"]
    got = transformer.lm_logits(params, nm.tensor(tokens, ("batch", "length")), CFG)
    assert got.dims == ("batch", "length", "vocab")
    np.testing.assert_allclose(
        np.asarray(got.data), np_lm_logits(params, tokens, CFG), rtol=1e-3, atol=1e-3
    )


def test_init_depends_on_seed_and_path_only():
    a = transformer.init(transformer.lm_shapes(CFG), 0)
    b = transformer.init(transformer.lm_shapes(CFG), 0)
    c = transformer.init(transformer.lm_shapes(CFG), 1)
    fa, fb, fc = _flat(a), _flat(b), _flat(c)
    assert all(np.array_equal(fa[k].data, fb[k].data) for k in fa)
    assert not np.allclose(fa["embed"].data, fc["embed"].data)
    assert not np.allclose(fa["layers/attn/q"].data, fa["layers/attn/k"].data)
    assert np.all(np.asarray(fa["layers/attn_norm/scale"].data) == 1)


@pytest.mark.parametrize("k", sorted(config.PAPER_PARAMS))
def test_paper_lm_configs_have_the_paper_parameter_counts(k):
    name = f"lm1b_{'m1' if k < 0 else k}"
    cfg = catalog.get(name)
    params = transformer.abstract(transformer.lm_shapes(cfg))  # shapes only, no memory
    leaves = _flat(params).values()
    assert all(not isinstance(x.data, np.ndarray) for x in leaves)
    n = sum(math.prod(x.shape) for x in leaves)
    assert round(n / 1e9, 2) == config.PAPER_PARAMS[k]
    assert n == layers.count(transformer.lm_shapes(cfg))


@pytest.mark.parametrize("name", ["lm1b_m1", "lm1b_2", "lm1b_5"])
def test_paper_layouts_plan_on_the_paper_meshes(name):
    """The paper's layout on the paper's mesh (up to 512 devices), planned without
    devices: model parallelism divides the work, and the layout splits what it names."""
    cfg = catalog.get(name)
    mesh = Mesh(dict(cfg.mesh), devices="abstract")
    b = {"batch": cfg.batch, "length": cfg.length}
    batch = {
        "inputs": nm.abstract(b, np.int32),
        "targets": nm.abstract(b, np.int32),
        "weights": nm.abstract(b),
    }
    params = transformer.abstract(transformer.lm_shapes(cfg))
    loss = lambda p, b: transformer.lm_loss(p, b, cfg)
    sharded = lower(loss, mesh, cfg.layout).report(params, batch, show=False)
    whole = lower(loss, Mesh({"one": 1}, devices="abstract"), "").report(params, batch, show=False)
    assert sharded.flops == pytest.approx(whole.flops / mesh.size, rel=0.1)
    assert sharded.peak_memory < whole.peak_memory / 4
    kinds = {kind for kind, _ in sharded.collectives}
    # pmax: the softmax/logsumexp maxima over a split vocab or heads dim
    assert kinds <= {"psum", "psum_scatter", "all_gather", "all_to_all", "pmax"}
    if "model" in mesh.sizes:  # heads and d_ff split: the attention and FFN outputs psum
        assert any("model" in axes for _, axes in sharded.collectives)


LAYOUTS = {
    "data": ({"data": 8}, "batch:data"),
    "model": ({"model": 4}, "heads:model;d_ff:model;vocab:model"),
    "2d": ({"rows": 2, "cols": 4}, "batch:rows;heads:cols;d_ff:cols;vocab:cols"),
    "fsdp": ({"data": 4}, "batch:data;d_model:data"),
    "seq": ({"rows": 2, "cols": 2}, "batch:rows;d_model:cols"),
    "pipeline": ({"stage": 2, "data": 2}, "layers:stage;batch:data"),  # lowering/pipeline.py
}


@pytest.fixture(scope="module")
def one_device_curve():
    return _curve(Mesh({"one": 1}), "")


@functools.cache
def corpus():
    return data.Corpus(data.load_text(), data.ByteTokenizer(), CFG.length)


def _curve(mesh, layout, steps=20):
    cfg = CFG.replace(batch=8, vocab=256)
    opt, _ = optimizer(OptimizerSpec("adamw", 1e-2, steps, 2, 1.0))
    tr = Trainer(zoo.get("lm"), cfg, mesh, layout, TrainSpec(opt))
    state, losses = tr.init_state(), []
    for s in range(1, steps + 1):
        state, loss = tr.step(state, corpus().batch(s, cfg.batch, 0), s)
        losses.append(float(loss))
    return np.array(losses)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_lm_trains_the_same_under_every_layout(name, one_device_curve):
    sizes, layout = LAYOUTS[name]
    got = _curve(Mesh(sizes), layout)
    assert abs(got[0] - one_device_curve[0]) <= 1e-5 * abs(one_device_curve[0])
    np.testing.assert_allclose(got, one_device_curve, rtol=1e-3)
    assert got[-5:].mean() < got[0] - 0.5  # and it learns
