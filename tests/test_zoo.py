"""The zoo beyond the decoder LM: the MoE FFN against a per-token NumPy statement of
top-2 routing and on expert-parallel layouts, BERT's and the encoder-decoder's
attention patterns, and the masked-LM and span-corruption objectives."""

import functools

import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh
from models import architecture as config
from models import transformer, zoo
from models.layers import moe
from models.training import data, objectives
from models.training.trainer import OptimizerSpec, Trainer, TrainSpec, batch_tensors, optimizer

R = np.random.default_rng(1)
CFG = config.Config(vocab=384, d_model=16, heads=4, d_kv=4, d_ff=32, layers=2, length=16, batch=4)


def np_softmax(x, axis=-1):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def np_moe(x, p, experts, c):
    """Top-2 capacity routing token by token: positions queue in order, a token's two
    choices together; a choice past the expert's `c` slots is dropped; the output is
    each kept expert's ReLU FFN weighted by its gate over the two gates' sum."""
    gate, wi, wo = (np.asarray(p[k].data) for k in ("gate", "wi", "wo"))
    out, aux = np.zeros_like(x), 0.0
    for b in range(x.shape[0]):
        probs = np_softmax(x[b] @ gate)
        first = probs.argmax(-1)
        masked = probs.copy()
        masked[np.arange(len(first)), first] = 0
        second = masked.argmax(-1)
        queue = np.zeros(experts, int)
        for t in range(x.shape[1]):
            total = probs[t, first[t]] + probs[t, second[t]]
            for e in (first[t], second[t]):
                if queue[e] < c:
                    ffn = np.maximum(x[b, t] @ wi[e], 0) @ wo[e]
                    out[b, t] += probs[t, e] / total * ffn
                queue[e] += 1
        frac = np.bincount(first, minlength=experts) / len(first)
        aux += (frac * probs.mean(0)).mean() * experts**2 / x.shape[0]
    return out, aux


@pytest.mark.parametrize("capacity_factor", [0.5, 2.0])
def test_moe_equals_per_token_top2_routing(capacity_factor):
    cfg = CFG.replace(experts=4, ffn="relu", capacity_factor=capacity_factor, routing="capacity")
    c = moe.capacity(cfg)
    p = transformer.init(moe.moe_params(cfg), 3)
    p["gate"] = p["gate"] * 4.0  # sharper gates: routing is uneven, some tokens overflow
    x = R.normal(size=(cfg.batch, cfg.length, cfg.d_model)).astype(np.float32)
    out, stats, _ = moe.moe(nm.tensor(x, ("batch", "length", "d_model")), p, cfg)
    want, want_aux = np_moe(x, p, cfg.experts, c)
    np.testing.assert_allclose(np.asarray(out.data), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(stats["balance"].data), want_aux, rtol=1e-5)
    if capacity_factor < 1:  # the case that drops tokens: some rows differ from no-drop
        free, _ = np_moe(x, p, cfg.experts, cfg.length)
        assert not np.allclose(want, free)


def test_moe_capacity_counts_two_choices_per_token():
    cfg = CFG.replace(experts=4, capacity_factor=1.25)
    assert moe.capacity(cfg, 16) == 10  # ceil(2 * 1.25 * 16 / 4)
    assert moe.capacity(cfg.replace(experts=2), 4) == 4  # never more than the group
    assert moe.capacity(cfg.replace(experts_per_token=1)) == 5  # a group of cfg.length


@functools.cache
def corpus(objective):
    return data.Corpus(data.load_text(), data.ByteTokenizer(), CFG.length, objective)


def curve(model_name, mesh, layout, steps=8, cfg=CFG):
    model = zoo.get(model_name)
    cfg = model.configure(cfg)
    opt, _ = optimizer(OptimizerSpec("adamw", 1e-2, steps, 2, 1.0))
    tr = Trainer(model, cfg, mesh, layout, TrainSpec(opt))
    state, losses = tr.init_state(), []
    for s in range(1, steps + 1):
        state, loss = tr.step(state, corpus(model.objective).batch(s, cfg.batch, 0), s)
        losses.append(float(loss))
    return np.array(losses), tr


@pytest.fixture(scope="module")
def moe_one_device():
    return curve("moe", Mesh({"one": 1}), "")[0]


@pytest.mark.parametrize(
    "sizes, layout",
    [
        ({"data": 2, "model": 4}, "batch:data;experts:model"),
        ({"data": 4}, "batch:data;experts:data"),
        ({"rows": 2, "cols": 2}, "batch:rows;experts:cols;d_ff:rows"),
    ],
)
def test_moe_under_expert_parallelism_trains_as_on_one_device(sizes, layout, moe_one_device):
    got, tr = curve("moe", Mesh(sizes), layout)
    assert abs(got[0] - moe_one_device[0]) <= 1e-5 * abs(moe_one_device[0])
    np.testing.assert_allclose(got, moe_one_device, rtol=1e-3)
    wi = tr.init_state()["params"]["layers"]["ffn"]["wi"]
    axis = layout.split("experts:")[1].split(";")[0]
    assert wi.dims.index("experts") == 1
    assert wi.data.sharding.spec[1] == axis  # the experts' weights are split: each device
    assert wi.data.addressable_shards[0].data.shape[1] == 4 // sizes[axis]  # holds its own


BIG_BATCH = CFG.replace(batch=16)  # MLM predicts 15% of positions: a batch big enough to learn


@functools.cache
def one_device_curve(name):
    """The one-device losses, shared by the layouts compared with them."""
    return curve(name, Mesh({"one": 1}), "", steps=12, cfg=BIG_BATCH)[0]


@pytest.mark.parametrize(
    "name, sizes, layout",
    [
        ("bert", {"rows": 2, "cols": 2}, "batch:rows;heads:cols;d_ff:cols;vocab:cols"),
        ("encdec", {"rows": 2, "cols": 2}, "batch:rows;heads:cols;d_ff:cols;vocab:cols"),
        ("encdec", {"data": 4}, "batch:data;d_model:data"),
    ],
)
def test_bert_and_encdec_train_the_same_under_a_layout_as_on_one_device(name, sizes, layout):
    one = one_device_curve(name)
    got, _ = curve(name, Mesh(sizes), layout, steps=12, cfg=BIG_BATCH)
    np.testing.assert_allclose(got, one, rtol=1e-3)
    # it learns: the last 3 steps' mean below the first 3's (one step's loss, the first
    # batch's masking alone, moved by 0.19 when the windows' draw changed)
    assert got[-3:].mean() < got[:3].mean() - 0.3


def _logits(name, params, batch, cfg):
    if name == "encdec":
        return np.asarray(transformer.encdec_logits(params, batch_tensors(batch), cfg)[0].data)
    inputs = {"inputs": nm.tensor(batch["inputs"], ("batch", "length"))}
    logits, _ = transformer.lm_forward(params, inputs, cfg, causal=name == "lm")
    return np.asarray(logits.data)


@pytest.mark.parametrize("name", ["lm", "bert"])
def test_lm_is_causal_and_bert_sees_both_ways(name):
    params = transformer.init(transformer.lm_shapes(CFG), 0)
    batch = corpus("mlm").batch(1, CFG.batch, 0)
    changed = {**batch, "inputs": batch["inputs"].copy()}
    changed["inputs"][:, -1] = (changed["inputs"][:, -1] + 1) % 256
    a, b = _logits(name, params, batch, CFG), _logits(name, params, changed, CFG)
    assert not np.allclose(a[:, -1], b[:, -1])  # the changed position sees itself
    same_before = np.allclose(a[:, :-1], b[:, :-1], atol=1e-6)
    assert same_before == (name == "lm")


def test_encdec_hides_padding_and_its_decoder_is_causal():
    cfg = CFG
    params = transformer.init(transformer.encdec_shapes(cfg), 0)
    batch = corpus("span").batch(1, cfg.batch, 0)
    assert (batch["input_weights"] == 0).any()  # corrupted inputs are shorter: padded
    pad_changed = {**batch, "inputs": np.where(batch["input_weights"] > 0, batch["inputs"], 7)}
    np.testing.assert_allclose(
        _logits("encdec", params, batch, cfg),
        _logits("encdec", params, pad_changed, cfg),
        atol=1e-5,
    )
    late = {**batch, "decoder_inputs": batch["decoder_inputs"].copy()}
    late["decoder_inputs"][:, -1] += 1
    a, b = _logits("encdec", params, batch, cfg), _logits("encdec", params, late, cfg)
    np.testing.assert_allclose(a[:, :-1], b[:, :-1], atol=1e-6)
    assert not np.allclose(a[:, -1], b[:, -1])
    enc = {**batch, "inputs": batch["inputs"].copy()}
    enc["inputs"][:, 0] = (enc["inputs"][:, 0] + 1) % 256  # a real input token
    assert not np.allclose(a[:, 0], _logits("encdec", params, enc, cfg)[:, 0])


def test_span_corruption_splits_the_text_into_inputs_and_targets():
    base = 256
    ids = R.integers(0, base, size=64).astype(np.int32)
    ex = objectives.span_corruption(ids, base, np.random.default_rng(0))
    inputs = ex["inputs"][ex["input_weights"] > 0]
    targets = ex["targets"][ex["weights"] > 0]
    sentinels = [s for s in inputs if s >= base + 2]
    assert len(sentinels) >= 2 and sentinels == [s for s in targets if s >= base + 2]
    # putting each span back in place of its sentinel gives the text again
    spans, cur = {}, None
    for tok in targets:
        if tok >= base + 2:
            cur = tok
            spans[cur] = []
        else:
            spans[cur].append(tok)
    restored = [t for tok in inputs for t in (spans[tok] if tok >= base + 2 else [tok])]
    assert restored == list(ids)
    assert sum(len(s) for s in spans.values()) == round(64 * 0.15)
    np.testing.assert_array_equal(ex["decoder_inputs"][1:], ex["targets"][:-1])
    assert ex["decoder_inputs"][0] == base + 1


def test_masked_lm_masks_a_sixth_of_the_tokens_mostly_with_mask():
    windows = R.integers(0, 256, size=(64, 128)).astype(np.int32)
    ex = objectives.masked_lm(windows, 256, np.random.default_rng(0))
    w = ex["weights"] > 0
    assert 0.13 < w.mean() < 0.17
    np.testing.assert_array_equal(ex["targets"], windows)
    np.testing.assert_array_equal(ex["inputs"][~w], windows[~w])
    masked = (ex["inputs"][w] == 256).mean()
    assert 0.75 < masked < 0.85
    assert ex["inputs"].max() <= 256


def test_objective_batches_depend_on_seed_and_step_only():
    a, b = corpus("span").batch(5, 4, 0), corpus("span").batch(5, 4, 0)
    c = corpus("span").batch(6, 4, 0)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["inputs"], c["inputs"])
    assert set(a) == set(objectives.FIELDS["span"])
    assert data.padded_vocab(256, "span") == 384 and data.padded_vocab(256, "lm") == 256
