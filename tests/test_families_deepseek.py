"""DeepSeek-V3 (models/families/deepseek_v3.py) against transformers, as tests/
test_families.py holds the other families (its ids, mask, prompts and checks): tiny
random models built from configs, every parameter and the routers' correction biases
perturbed, saved and loaded with hub.load. Logits equal on one device and with experts
(and heads, d_ff, vocab) split over 8 devices; greedy tokens equal to generate; the KV
cache holds the latent, and decoding through it gives the full forward's logits; the
loss and every gradient equal torch's (a fine-tune's step), and hub.save writes what
transformers loads back. Multi-token-prediction weights are refused by name."""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import namedmesh as nm  # noqa: E402
from lowering import Layout, Mesh  # noqa: E402
from models import transformer  # noqa: E402
from models.architecture import Config, ConfigError  # noqa: E402
from models.inference.decoding import Decoder, init_cache  # noqa: E402
from models.io import hub  # noqa: E402
from models.layers.latent import Latent  # noqa: E402
from tests.test_families import (  # noqa: E402
    IDS,
    MASK,
    NEW,
    PROMPTS,
    VOCAB,
    as_array,
    assert_close,
    hf_greedy,
    hf_logits,
)

SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
    num_experts_per_tok=3, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12,
    max_position_embeddings=64, num_nextn_predict_layers=0,
)  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "mscale": 0.8,
        "mscale_all_dim": 0.6, "original_max_position_embeddings": 16}  # fmt: skip
CASES = {
    # low-rank q, interleaved rotary pairs, values narrower (10) than queries and keys, YaRN
    # with mscale_all_dim on the softmax scale, a dense first layer, 3 of 8 experts within
    # the best 2 of 4 groups, normed weights x 1.5, two shared experts
    "deepseek_v3": dict(q_lora_rank=24, v_head_dim=10, rope_parameters=YARN,
                        first_k_dense_replace=1, n_group=4, topk_group=2, n_shared_experts=2,
                        routed_scaling_factor=1.5),
    # one q projection, rotary halves, values wider (24) than queries and keys (12 + 8),
    # every layer MoE, unnormed weights, no groups
    "deepseek_v3_plain": dict(q_lora_rank=None, rope_interleave=False, first_k_dense_replace=0,
                              n_group=1, topk_group=1, norm_topk_prob=False, v_head_dim=24),
}  # fmt: skip
LAYOUT = "batch:rows;experts:cols;heads:cols;d_ff:cols;vocab:cols"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (folder, transformers model, its logits, the zoo's model)."""
    torch.manual_seed(0)
    out = {}
    for name, options in CASES.items():
        model = transformers.DeepseekV3ForCausalLM(
            transformers.DeepseekV3Config(**SIZES, **options)
        ).eval()
        with torch.no_grad():  # non-trivial weights, and correction biases that change choices
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
            for n, b in model.named_buffers():
                if n.endswith("e_score_correction_bias"):
                    b.add_(0.3 * torch.randn_like(b))
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = (folder, model, hf_logits(model), hub.load(folder))
    return out


@pytest.fixture(scope="module")
def decoders(built):
    """name -> a Decoder of 24 slots: its compiled prefill and step serve every test."""
    return {name: Decoder(m.params, m.config, slots=24) for name, (*_, m) in built.items()}


@pytest.mark.parametrize("name", CASES)
def test_logits_equal_transformers(built, name):
    folder, _, want, model = built[name]
    assert_close(as_array(model.logits(IDS, attention_mask=MASK)), want)


def test_config_holds_the_latent_attention_and_the_router(built):
    c, plain = built["deepseek_v3"][3].config, built["deepseek_v3_plain"][3].config
    assert (c.mla.q_rank, c.mla.kv_rank, c.mla.nope, c.mla.v, c.d_kv) == (24, 16, 12, 10, 8)
    assert c.mla.interleave and not plain.mla.interleave and plain.mla.q_rank == 0
    assert (c.experts, c.experts_per_token, c.parts.expert_groups, c.parts.topk_groups) == (
        8, 3, 4, 2,
    )  # fmt: skip
    assert (c.router, plain.router, c.parts.router_scale) == (
        "sigmoid_topk_norm", "sigmoid_topk", 1.5,
    )  # fmt: skip
    assert (c.expert_ff, c.shared_ff, c.d_ff, c.dense_layers, plain.dense_layers) == (
        16, 32, 48, 1, 0)  # fmt: skip
    assert (c.rope.kind, c.rope.mscale_all_dim) == ("yarn", 0.6)


@pytest.mark.parametrize("name", ["deepseek_v3"])  # groups of experts split over devices
def test_logits_with_experts_split_over_a_mesh(built, name):
    mesh = Mesh({"rows": 2, "cols": 4})
    model = hub.load(built[name][0], mesh=mesh, layout=Layout(LAYOUT, shared=True))
    wi = model.params["layers"]["ffn"]["wi"]
    at = wi.dims.index("experts")
    assert wi.data.sharding.shard_shape(wi.shape)[at] == 2  # 8 experts over 4 devices
    assert_close(as_array(model.logits(IDS, attention_mask=MASK)), built[name][2])


@pytest.mark.parametrize("name", ["deepseek_v3"])  # the plain case's paths: forward tests
def test_greedy_tokens_equal_transformers_generate(built, decoders, name):
    got = decoders[name].decode(PROMPTS, NEW)
    reference = built[name][1]
    for row, prompt in zip(got, PROMPTS, strict=True):
        np.testing.assert_array_equal(row, hf_greedy(reference, prompt))


def test_the_cache_holds_the_latent_and_decodes_as_the_full_forward(built, decoders):
    """The cache's entries are the normed latent and the rotated shared key (kv_rank +
    d_kv numbers per position and layer, not heads x (nope + d_kv + v)); a prefill of
    5 tokens then one step per token gives the full forward's logits at each position."""
    model = built["deepseek_v3"][3]
    cfg = model.config
    cache = init_cache(cfg, 2, 12)
    assert {k: v.sizes for k, v in cache.items()} == {
        "latent": {"layers": 3, "batch": 2, "memory": 12, "latent": 16},
        "k_rope": {"layers": 3, "batch": 2, "memory": 12, "d_kv": 8},
    }
    rows = IDS[[0, 3]].astype(np.int32)  # the unpadded rows: the compiled logits' of MASK
    want = as_array(model.logits(IDS, attention_mask=MASK))[[0, 3]]
    dec, n = decoders["deepseek_v3"], 5
    out, cache = dec.prefill_logits(rows[:, :8], np.full(2, n))  # as decode pads to 8
    np.testing.assert_allclose(np.asarray(out), want[:, n - 1], rtol=0, atol=1e-4)
    for i in range(n, 12):
        out, cache = dec.step_logits(rows[:, i], np.full(2, i), cache)  # as decode's
        np.testing.assert_allclose(np.asarray(out), want[:, i], rtol=0, atol=1e-4)


def test_loss_and_every_gradient_equal_torch_and_save_round_trips(built, tmp_path):
    """A fine-tune's step: the zoo's loss and the gradient of every parameter (written by
    hub.save under the files' names) equal transformers' loss and torch's .grad; the
    correction bias gets none (a buffer there, left out of weight decay here); the
    model saved loads back into transformers with its logits."""
    folder, reference, want, model = built["deepseek_v3"]
    cfg, ids = model.config, IDS.astype(np.int32)
    weights = np.ones((len(ids), ids.shape[1] - 1), np.float32)
    batch = {name: nm.tensor(a, ("batch", "length")) for name, a in
             (("inputs", ids[:, :-1]), ("targets", ids[:, 1:]), ("weights", weights))}  # fmt: skip
    loss, grads = jax.jit(nm.value_and_grad(lambda p: transformer.lm_loss(p, batch, cfg)))(
        model.params
    )
    reference.zero_grad()
    hf_loss = reference(input_ids=torch.tensor(IDS), labels=torch.tensor(IDS)).loss
    hf_loss.backward()
    np.testing.assert_allclose(float(loss.data), hf_loss.item(), rtol=1e-5)
    hub.save(hub.HubModel(model.family, cfg, grads, None, model.hf_config), tmp_path / "grads")
    from safetensors.numpy import load_file

    got = load_file(tmp_path / "grads" / "model.safetensors")
    expected = torch_grads(reference)
    assert set(got) == set(expected)
    for name, g in got.items():
        np.testing.assert_allclose(g, expected[name], rtol=0, atol=1e-5 * max(1, np.abs(g).max()))
    hub.save(model, tmp_path / "out")
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert_close(hf_logits(back), want)


def torch_grads(model) -> dict:
    """torch's gradients under the files' names: the fused experts' gate_up_proj (experts,
    gate then up rows, in) and down_proj per expert, as save_pretrained writes them; the
    correction biases (buffers, no gradient) 0."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.numpy()
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = g
            continue
        stem, kind = name.rsplit(".", 1)
        for e, ge in enumerate(g):
            if kind == "down_proj":
                out[f"{stem}.{e}.down_proj.weight"] = ge
            else:
                gate, up = np.split(ge, 2)
                out[f"{stem}.{e}.gate_proj.weight"], out[f"{stem}.{e}.up_proj.weight"] = gate, up
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            out[name] = np.zeros(b.shape, np.float32)
    return out


def test_multi_token_prediction_weights_are_refused_by_name(built, tmp_path):
    """A checkpoint's layer past num_hidden_layers (DeepSeek-V3's layer 61) predicts further
    tokens; the zoo has no such layer, so it is named, never dropped silently."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "mtp"
    shutil.copytree(built["deepseek_v3"][0], folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.3.eh_proj.weight"] = np.zeros((32, 64), np.float32)
    save_file(weights, folder / "model.safetensors", {"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(hub.UnsupportedModelError, match=r"multi-token-prediction .*layers\.3\."):
        hub.load(folder)


def test_adamw_leaves_the_choosing_bias_alone():
    """No gradient reaches gate_bias (it moves choices only); AdamW's weight decay alone
    would shrink it, so it is out of the decay mask while other parameters decay."""
    from models.training.trainer import OptimizerSpec, optimizer

    ones = nm.tensor(np.ones(4, np.float32), ("experts",))
    gate = nm.tensor(np.ones((3, 4), np.float32), ("d_model", "experts"))  # a matrix: decayed
    params = {"layers": {"ffn": {"gate_bias": ones, "gate": gate}}}
    opt, _ = optimizer(OptimizerSpec("adamw", 1.0, 10, 0, 0))
    state = opt.init(params)
    zero = jax.tree.map(lambda x: x * 0, params)
    for _ in range(3):
        updates, state = opt.update(zero, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
    np.testing.assert_array_equal(params["layers"]["ffn"]["gate_bias"].data, 1.0)
    assert (np.asarray(params["layers"]["ffn"]["gate"].data) < 1.0).all()


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(mla=Latent(16, 12, 10), kv_heads=2), "mla .* with kv_heads=2"),
        (dict(mla=Latent(16, 12, 10), encoder_layers=2), "mla .* with encoder_layers=2"),
        (dict(experts=8, expert_groups=3), "expert_groups=3 must divide experts=8"),
        (dict(experts=8, expert_groups=4, topk_groups=1, experts_per_token=3),
         "experts_per_token=3 exceeds"),
        (dict(dense_layers=1), "dense_layers=1 .* experts is 0"),
        (dict(experts=8, dense_layers=3), "dense_layers=3 must be <= layers=2"),
    ],
)  # fmt: skip
def test_latent_and_router_options_that_contradict_are_config_errors(options, match):
    with pytest.raises(ConfigError, match=match):
        Config(layers=2, heads=4, d_kv=8, positions="rotary", **options)
