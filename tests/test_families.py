"""The families of models/families/ against transformers: tiny random models built from
configs (never downloaded), every parameter perturbed, saved with save_pretrained and
loaded with hub.load. Each case gives transformers' logits (float32, 1e-4 relative, with
a padding mask) on one device and under a layout splitting heads, kv_heads, d_ff and
vocab; greedy tokens equal to transformers' generate; its bfloat16 folder loads; hub.save
writes what transformers loads back. Relabelled folders and unread options are refused.

Adding a family: one more entry in `cases()`, in LAYOUT, and in GREEDY when it decodes."""

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lowering import Layout, Mesh  # noqa: E402
from models.architecture import Config, ConfigError  # noqa: E402
from models.cli.generate import Decoder  # noqa: E402
from models.io import hub  # noqa: E402
from models.layers.rope import Rope  # noqa: E402

VOCAB, BATCH, LENGTH, NEW = 64, 4, 12, 12
R = np.random.default_rng(1)
IDS = R.integers(0, VOCAB, (BATCH, LENGTH))
MASK = (np.arange(LENGTH)[None, :] < np.array([[12], [9], [6], [12]])).astype(np.int64)
PROMPTS = [IDS[0, :5], IDS[1, :2]]


# fmt: off
def cases():
    """name -> (transformers class, config): one per family and option it supports.
    8 query heads on 4 kv heads, so a layout splits both over 4 devices."""
    T = transformers
    llama = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32)
    encoder = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, max_position_embeddings=32)
    rope = lambda kind, **kw: {"rope_parameters": {"rope_type": kind, "rope_theta": 500.0, **kw}}
    phi3 = {**llama, "hidden_size": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    longrope = {"rope_type": "longrope", "rope_theta": 500.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.5, 2.0], "long_factor": [2.0, 3.0, 5.0]}
    opt = dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=32, pad_token_id=1)
    return {
        # llama 3.1/3.2: llama3 scaling, tied embeddings (3.2's small models)
        "llama3": (T.LlamaForCausalLM, T.LlamaConfig(**llama, tie_word_embeddings=True, **rope(
            "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8))),
        "llama_linear": (T.LlamaForCausalLM, T.LlamaConfig(**llama, **rope("linear", factor=2.0))),
        # dynamic NTK: max_position_embeddings 8 < LENGTH, so the base grows
        "llama_dynamic": (T.LlamaForCausalLM, T.LlamaConfig(
            **{**llama, "max_position_embeddings": 8}, **rope("dynamic", factor=2.0))),
        # a window of 4 < LENGTH and < the decoded length: attention past the window
        "mistral": (T.MistralForCausalLM, T.MistralConfig(**llama, sliding_window=4)),
        # yarn, as Qwen2.5's long-context configs
        "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config(**llama, **rope(
            "yarn", factor=4.0, original_max_position_embeddings=8))),
        # head_dim 12, not hidden_size / heads = 4
        "qwen3": (T.Qwen3ForCausalLM, T.Qwen3Config(**llama, head_dim=12)),
        # longrope past its original 8 positions (long factors), 6 of 8 dims rotated
        "phi3": (T.Phi3ForCausalLM, T.Phi3Config(**phi3, original_max_position_embeddings=8,
                                                 rope_parameters=longrope)),
        # within its original 32 positions (short factors), a window of 5
        "phi3_window": (T.Phi3ForCausalLM, T.Phi3Config(
            **{**phi3, "max_position_embeddings": 128}, original_max_position_embeddings=32,
            sliding_window=5, rope_parameters=longrope)),
        # parallel residual, 4 of 8 dims rotated, per-head fused q/k/v, untied embed_out
        "gpt_neox": (T.GPTNeoXForCausalLM, T.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=8, max_position_embeddings=32, rope_parameters={
                "rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5})),
        # learned positions offset by 2, ReLU, biases, tied; opt-350m's post-norm and
        # narrower embeddings (project_in, project_out), untied
        "opt": (T.OPTForCausalLM, T.OPTConfig(**opt)),
        "opt_350m": (T.OPTForCausalLM, T.OPTConfig(
            **opt, do_layer_norm_before=False, word_embed_proj_dim=16, tie_word_embeddings=False)),
        # tied, as Gemma's checkpoints are (a tiny tied Gemma, its embeddings x sqrt(d_model),
        # repeats its last token whatever the weights: Gemma 2 and 3 decode untied)
        "gemma": (T.GemmaForCausalLM, T.GemmaConfig(**llama, head_dim=12)),
        # caps that bite (logits reach ~2), a sliding layer then a global one; untied (above)
        "gemma2": (T.Gemma2ForCausalLM, T.Gemma2Config(
            **llama, head_dim=12, sliding_window=4, tie_word_embeddings=False,
            attn_logit_softcapping=1.0, final_logit_softcapping=2.0, query_pre_attn_scalar=10)),
        # sliding, global, sliding; linear scaling on the global layer, another local base
        "gemma3": (T.Gemma3ForCausalLM, T.Gemma3TextConfig(
            **{**llama, "num_hidden_layers": 3}, head_dim=12, sliding_window=4,
            tie_word_embeddings=False,
            sliding_window_pattern=2, query_pre_attn_scalar=10, final_logit_softcapping=2.0,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 500.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})),
        # mixtures of 4 experts, top-2: Mixtral's renormalised top-k and a window of 4;
        # Qwen2-MoE's shared expert and its gate, top-k not renormalised; Qwen3-MoE's
        # q/k norms, renormalised top-k, a dense first layer (a stack of its own), the
        # aux loss where output_router_logits
        "mixtral": (T.MixtralForCausalLM, T.MixtralConfig(
            **llama, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)),
        "qwen2_moe": (T.Qwen2MoeForCausalLM, T.Qwen2MoeConfig(
            **llama, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=24)),
        "qwen3_moe": (T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig(
            **llama, head_dim=12, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.02,
            mlp_only_layers=[0])),
        # Llama's body with Granite's four multipliers, none of them 1
        "granite": (T.GraniteForCausalLM, T.GraniteConfig(
            **llama, embedding_multiplier=3.0, attention_multiplier=0.3, residual_multiplier=0.5,
            logits_scaling=4.0)),
        # masked LMs: 4 heads, so a layout splits them over 4 devices; IDS hold pad id 1
        "roberta": (T.RobertaForMaskedLM, T.RobertaConfig(**encoder, type_vocab_size=1)),
        "distilbert": (T.DistilBertForMaskedLM, T.DistilBertConfig(
            vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=2, n_heads=4,
            max_position_embeddings=32, sinusoidal_pos_embds=True)),
    }
# fmt: on


# The causal families decode (one compile each) and every family runs under a layout,
# choosing the case where it differs most (Gemma's and Granite's options decode in other
# cases: Gemma 2 and 3 are built on Gemma's, and a family's parts are the same calls in
# a pass and in a decoding step): llama3's scaling and tied embeddings,
# Mistral's window past its size, Qwen2's biases and yarn, Qwen3's q/k norms and head_dim,
# Phi-3's longrope and GPT-NeoX's partial rotary and parallel residual in the cache, OPT's
# offset positions, post-norm and projected embeddings in a decoding step, Gemma 2's scaled
# embeddings, offset norms, caps and per-layer windows, Gemma 3's per-layer
# rotary bases; under a layout: Phi-3's unequal q/k/v parts over kv_heads, GPT-NeoX's
# per-head q/k/v over heads, OPT's biases and positions, the windows and caps, Gemma 3's
# per-layer constants, the encoders' heads.
GREEDY = ["llama3", "mistral", "qwen2", "qwen3", "phi3_window", "gpt_neox", "opt_350m"]
GREEDY += ["gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe"]
MOE = ["mixtral", "qwen2_moe", "qwen3_moe"]  # under an expert-parallel layout
LAYOUT = ["llama3", "mistral", "qwen2", "qwen3", "phi3", "gpt_neox", "opt", "gemma", "gemma2"]
LAYOUT += ["gemma3", "roberta", "distilbert"]


def hf_logits(model, mask=MASK) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS), attention_mask=torch.tensor(mask)).logits.numpy()


def as_array(logits) -> np.ndarray:
    return np.asarray(logits.transpose("batch", "length", "vocab").data)


def assert_close(got, want):
    """Equal at the real (unpadded) queries: a padded query past Mistral's window sees
    no real key, and what a row of no keys gives is each library's own."""
    got, want = got[MASK == 1], want[MASK == 1]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, np.abs(want).max()))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (folder, transformers model, its logits), each built once."""
    torch.manual_seed(0)
    out = {}
    for name, (cls, cfg) in cases().items():
        model = cls(cfg).eval()
        with torch.no_grad():  # non-trivial biases and norm scales
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = (folder, model, hf_logits(model))
    return out


@pytest.fixture(scope="module")
def loaded(built):
    return {name: hub.load(folder) for name, (folder, _, _) in built.items()}


@pytest.mark.parametrize("name", list(cases()))
def test_logits_equal_transformers(built, loaded, name):
    assert_close(as_array(loaded[name].logits(IDS, attention_mask=MASK)), built[name][2])


def test_configs_hold_the_families_options(loaded):
    c = {name: m.config for name, m in loaded.items()}
    assert c["llama3"].shared_embedding and not c["llama_linear"].shared_embedding
    assert (c["llama3"].rope.kind, c["llama3"].rope.original_positions) == ("llama3", 8)
    assert (c["llama_dynamic"].rope.original_positions, c["llama3"].rope.theta) == (8, 500.0)
    assert (c["mistral"].sliding_window, c["qwen2"].sliding_window) == (4, 0)
    assert c["qwen2"].qkv_bias and not c["qwen2"].bias and c["qwen3"].qk_norm
    assert (c["qwen3"].d_kv, c["qwen3"].kv_heads) == (12, 4)
    phi3, window = c["phi3"].rope, c["phi3_window"].rope
    assert (phi3.kind, phi3.original_positions, phi3.fraction) == ("longrope", 8, 0.75)
    assert (phi3.factor, phi3.long_factor, window.original_positions) == (4, (2, 3, 5), 32)
    assert (c["phi3_window"].sliding_window, c["phi3"].kv_heads) == (5, 4)
    neox = c["gpt_neox"]
    assert neox.block == "parallel" and neox.rope.fraction == 0.5 and not neox.shared_embedding
    assert (c["opt"].parts.position_offset, c["opt"].ffn, c["opt"].bias) == (2, "relu", True)
    opt, opt_350m = c["opt"], c["opt_350m"]
    assert (opt.block, opt_350m.block) == ("pre", "post")
    assert (opt.embed_dim, opt_350m.embed_dim, opt_350m.shared_embedding) == (0, 16, False)
    assert c["gemma"].norm == "rms_offset" and c["gemma"].embed_scale
    assert c["gemma"].shared_embedding and not c["gemma2"].shared_embedding
    assert c["gemma"].ffn == "gated_gelu" and c["gemma"].block == "pre"
    g2, g3 = c["gemma2"], c["gemma3"]
    caps = (g2.parts.attention_softcap, g2.parts.logit_softcap, g3.parts.logit_softcap)
    assert caps == (1.0, 2.0, 2.0) and g2.attention_scale_dim == 10.0
    assert g2.block == "sandwich" and (g2.sliding_window, g2.sliding_layers) == (4, (True, False))
    assert g3.qk_norm and g3.sliding_layers == (True, False, True)
    ropes = (g3.rope.kind, g3.rope.factor, g3.rope.theta, g3.parts.local_rope.theta)
    assert ropes == ("linear", 4.0, 500.0, 50.0)
    mx, q2, q3 = c["mixtral"], c["qwen2_moe"], c["qwen3_moe"]
    assert (mx.experts, mx.experts_per_token, mx.router, mx.sliding_window) == (
        4,
        2,
        "topk_softmax",
        4,
    )
    assert (q2.d_ff, q2.expert_ff, q2.shared_ff, q2.parts.shared_gate) == (64, 16, 24, True)
    assert q2.qkv_bias and q3.qk_norm and (q2.router, q3.router) == ("softmax_topk", "topk_softmax")
    assert (q2.dense_layers, q3.dense_layers, q3.shared_ff) == (0, 1, 0)
    # the balancing loss weighs in where transformers adds it (output_router_logits)
    assert (mx.moe_loss, q2.moe_loss, q3.moe_loss) == (0.0, 0.0, 0.02)


def test_roberta_positions_count_past_left_padding(built, loaded):
    """Rows left-padded with RoBERTa's pad id 1: transformers numbers the real tokens from
    row 2 whatever the padding, as the zoo does (numbering by index would be off)."""
    pad = np.array([[0], [3], [6], [1]])
    ids = np.where(np.arange(LENGTH)[None, :] < pad, 1, np.where(IDS == 1, 2, IDS))
    mask = (ids != 1).astype(np.int64)
    with torch.no_grad():
        want = built["roberta"][1](input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    got = as_array(loaded["roberta"].logits(ids, attention_mask=mask))[mask == 1]
    want = want.logits.numpy()[mask == 1]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert loaded["roberta"].config.parts.position_pad == 1
    assert "type_embed" not in loaded["distilbert"].params


@pytest.mark.parametrize("name", LAYOUT)
def test_logits_under_a_layout_on_8_devices(built, name):
    layout = Layout("batch:rows;heads:cols;kv_heads:cols;d_ff:cols;vocab:cols", shared=True)
    model = hub.load(built[name][0], mesh=Mesh({"rows": 2, "cols": 4}), layout=layout)
    k = model.params["layers"]["attn"]["k"]
    heads = k.dims.index("kv_heads" if "kv_heads" in k.dims else "heads")
    assert k.data.sharding.shard_shape(k.shape)[heads] == k.shape[heads] // 4  # over 4 devices
    assert_close(as_array(model.logits(IDS, attention_mask=MASK)), built[name][2])


EXPERT_PARALLEL = {  # tokens and experts on one axis (GShard's), or on two
    "one axis": "batch:cols;experts:cols;kv_heads:rows;vocab:rows",
    "two axes": "batch:rows;experts:cols;kv_heads:cols;vocab:cols",
}


@pytest.mark.parametrize(
    "name,layout", [(name, "one axis") for name in MOE] + [("mixtral", "two axes")]
)
def test_logits_with_experts_split_over_a_mesh_axis(built, name, layout):
    """Expert parallelism: each of 4 devices holds one expert's weights (and a share of
    the heads and of the vocabulary); tokens reach the experts' devices, from the
    devices that hold them (one axis) or from every row of devices (two axes)."""
    mesh = Mesh({"rows": 2, "cols": 4})
    model = hub.load(built[name][0], mesh=mesh, layout=EXPERT_PARALLEL[layout])
    wi = model.params["layers"]["ffn"]["wi"]
    experts = wi.dims.index("experts")
    assert wi.data.sharding.shard_shape(wi.shape)[experts] == 1
    assert_close(as_array(model.logits(IDS, attention_mask=MASK)), built[name][2])


def hf_greedy(model, prompt) -> np.ndarray:
    model.generation_config.eos_token_id = None  # NEW tokens, whatever they are
    with torch.no_grad():
        out = model.generate(
            torch.tensor(prompt[None]), max_new_tokens=NEW, do_sample=False, pad_token_id=0
        )
    return out.numpy()[0, len(prompt) :]


@pytest.mark.parametrize("name", GREEDY)
def test_greedy_tokens_equal_transformers_generate(built, loaded, name):
    """Prompts of lengths 5 and 2 in one right-padded batch, a prefill, then the KV
    cache (Mistral's window of 4 is passed after a few steps)."""
    model = loaded[name]
    got = Decoder(model.params, model.config, slots=24).decode(PROMPTS, NEW)
    for row, prompt in zip(got, PROMPTS, strict=True):
        np.testing.assert_array_equal(row, hf_greedy(built[name][1], prompt))


@pytest.mark.parametrize("name,kind", [("llama_dynamic", "dynamic"), ("phi3", "longrope")])
def test_length_dependent_rope_refuses_a_cache_past_its_original_length(loaded, name, kind):
    """Dynamic NTK's frequencies change as the sequence grows, longrope's switch to the
    long factors past it: keys cached under older ones would differ from a full pass
    (transformers' cached keys keep the short factors), so a cache past 8 positions is
    refused."""
    model = loaded[name]
    with pytest.raises(ConfigError, match=f"'{kind}' with a KV cache of 24 slots"):
        Decoder(model.params, model.config, slots=24).decode(PROMPTS, 4)


@pytest.mark.parametrize("name", list(cases()))
def test_bfloat16_folder_loads_and_save_round_trips(built, loaded, tmp_path, name):
    folder, model, want = built[name]
    hub.save(loaded[name], tmp_path / "out")
    back = type(model).from_pretrained(tmp_path / "out").eval()
    assert_close(hf_logits(back), want)
    type(model).from_pretrained(folder).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    # transformers on the rounded weights (its rotary buffers made again in float32)
    rounded = type(model).from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    want16 = hf_logits(rounded)
    assert_close(as_array(hub.load(tmp_path / "bf16").logits(IDS, attention_mask=MASK)), want16)


@pytest.mark.parametrize(
    "name,attention,block",
    [("mistral", "blockwise", 5), ("mistral", "ring", 4), ("gemma2", "ring", 4)]
    + [("gemma3", "blockwise", 5)],
)
def test_sliding_window_inside_blockwise_and_ring(built, loaded, name, attention, block):
    """A window of 4 over 12 positions (Mistral's on every layer, Gemma's per layer,
    with Gemma 2's soft-capped logits and Gemma 3's per-layer rotary bases), the keys in
    blocks of 5 or a ring of 3."""
    model = loaded[name]
    cfg = model.config.replace(attention=attention, attention_block=block)
    logits = hub.HubModel(model.family, cfg, model.params, None, model.hf_config).logits(
        IDS, attention_mask=MASK
    )
    assert_close(as_array(logits), built[name][2])


# --- refusals ------------------------------------------------------------------------------
def relabel(built, name, tmp_path, **changes):
    folder = tmp_path / name
    shutil.copytree(built[name][0], folder)
    path = folder / "config.json"
    hf = {**json.loads(path.read_text()), **changes}
    path.write_text(json.dumps({k: v for k, v in hf.items() if v is not None}))
    return folder


def test_a_relabelled_qwen2_folder_is_refused_naming_its_biases(built, tmp_path):
    """model_type llama on Qwen2 weights: the q/k/v biases would go unread (logits off)."""
    keys = dict(use_sliding_window=None, max_window_layers=None, layer_types=None)
    folder = relabel(built, "qwen2", tmp_path, model_type="llama", sliding_window=None, **keys)
    with pytest.raises(hub.UnsupportedModelError, match=r"does not read: .*q_proj\.bias"):
        hub.load(folder)


def test_a_relabelled_mistral_folder_is_refused_naming_its_window(built, tmp_path):
    folder = relabel(built, "mistral", tmp_path, model_type="llama")
    with pytest.raises(hub.UnsupportedModelError, match=r"'sliding_window': 4.*families/llama"):
        hub.load(folder)


def test_mixed_sliding_layers_are_refused(built, tmp_path):
    kinds = ["sliding_attention", "full_attention"]
    folder = relabel(built, "qwen2", tmp_path, use_sliding_window=True, layer_types=kinds)
    with pytest.raises(hub.UnsupportedModelError, match="use_sliding_window=True with layer"):
        hub.load(folder)


@pytest.mark.parametrize(
    "name,changes,match",
    [
        ("gpt_neox", {"attention_bias": False}, "attention_bias=False is not supported"),
        (
            "phi3",
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "partial_rotary_factor": 0.75,
                    "short_factor": [1.0, 2.0],
                    "long_factor": [1.0, 2.0, 3.0],
                }
            },
            "short_factor has 2 values; the 6 rotated dims of d_kv have 3 pairs",
        ),
        (
            "llama_linear",
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "'partial_rotary_factor': 0.5.* are not implemented",
        ),
    ],
)
def test_options_a_family_does_not_implement_are_refused(built, tmp_path, name, changes, match):
    with pytest.raises((hub.UnsupportedModelError, ConfigError), match=match):
        hub.load(relabel(built, name, tmp_path, **changes))


@pytest.mark.parametrize(
    "name,changes,match",
    [
        ("qwen2_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\].* layer\(s\) \[1\] of"),
        ("qwen3_moe", {"mlp_only_layers": [0, 1]}, r"layer\(s\) \[0, 1\] of 2 dense"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
    ],
)
def test_moe_options_the_zoo_does_not_implement_are_refused(built, tmp_path, name, changes, match):
    """Dense layers after a sparse one or no sparse layer (the dense ones are a stack
    before the sparse ones), the router's training-time jitter."""
    with pytest.raises(hub.UnsupportedModelError, match=match):
        hub.load(relabel(built, name, tmp_path, **changes))


def test_a_sparse_step_reads_as_the_dense_layers_it_makes(built, loaded, tmp_path):
    """decoder_sparse_step 2 over 2 layers makes layer 0 dense, as mlp_only_layers [0]."""
    folder = relabel(built, "qwen3_moe", tmp_path, decoder_sparse_step=2, mlp_only_layers=[])
    assert hub.config_of(folder)[1] == loaded["qwen3_moe"].config


def test_a_relabelled_mixtral_folder_is_refused_naming_its_experts(built, tmp_path):
    """model_type mistral on Mixtral's weights, its MoE keys gone: the experts unread."""
    moe = ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef")
    moe += ("output_router_logits", "router_jitter_noise")
    folder = relabel(built, "mixtral", tmp_path, model_type="mistral", **dict.fromkeys(moe))
    with pytest.raises(hub.UnsupportedModelError, match=r"does not read: .*block_sparse_moe"):
        hub.load(folder)


def test_a_qwen2_moe_without_a_shared_expert_equals_transformers(built, tmp_path):
    """shared_expert_intermediate_size 0 (issue 38): transformers saves the shared
    expert's weights empty, and its gate, which scales that 0; the folder loads, equals
    transformers and saves what transformers loads back. The same 0 over a shared
    expert that holds weights contradicts the folder: a WeightShapeError naming one."""
    T = transformers
    cls, cfg = cases()["qwen2_moe"]
    cfg = T.Qwen2MoeConfig(**{**cfg.to_dict(), "shared_expert_intermediate_size": 0})
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf")
    want = hf_logits(model)
    zoo = hub.load(tmp_path / "hf")
    assert (zoo.config.shared_ff, zoo.config.parts.shared_gate) == (0, False)
    assert_close(as_array(zoo.logits(IDS, attention_mask=MASK)), want)
    hub.save(zoo, tmp_path / "out")
    assert_close(hf_logits(cls.from_pretrained(tmp_path / "out").eval()), want)
    folder = relabel(built, "qwen2_moe", tmp_path / "bad", shared_expert_intermediate_size=0)
    with pytest.raises(hub.WeightShapeError, match=r"shared_expert\..*\((32, 24|24, 32)\).*empty"):
        hub.load(folder)


OLDER = {  # config.json as the hub's files spell it, before transformers 5's rope_parameters
    "gpt_neox": dict(rope_parameters=None, rotary_pct=0.5, rotary_emb_base=500.0),
    "phi3": dict(rope_parameters=None, rope_theta=500.0, partial_rotary_factor=0.75, rope_scaling={
        "type": "su", "short_factor": [1.0, 1.5, 2.0], "long_factor": [2.0, 3.0, 5.0]}),
    "opt": dict(activation_dropout=0.0, auto_map={"AutoConfig": "configuration_opt.OPTConfig"}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(OLDER))
def test_older_config_spellings_read_the_same(built, loaded, tmp_path, name):
    """Pythia's rotary_pct and rotary_emb_base, Phi-3's rope_scaling of type su (its
    longrope) and top-level partial_rotary_factor, OPT's activation_dropout: the same
    Config, the same logits."""
    model = hub.load(relabel(built, name, tmp_path, **OLDER[name]))
    assert model.config == loaded[name].config
    assert_close(as_array(model.logits(IDS, attention_mask=MASK)), built[name][2])


def test_roberta_with_another_activation_is_refused(built, tmp_path):
    """Its head's GELU is fixed: a hidden_act of gelu_new would apply to the head too."""
    folder = relabel(built, "roberta", tmp_path, hidden_act="gelu_new")
    with pytest.raises(hub.UnsupportedModelError, match="hidden_act='gelu_new'"):
        hub.load(folder)


def test_kernels_refuse_what_they_do_not_implement(loaded):
    model = loaded["gemma2"]
    cfg = model.config.replace(attention="ring")
    with pytest.raises(ConfigError, match="attention='ring' with cached"):
        Decoder(model.params, cfg, slots=24).decode(PROMPTS, 2)


def test_older_gemma_config_files_read_as_transformers_reads_them():
    """Gemma 3 files from before transformers 5 (rope_theta, rope_local_base_freq and
    rope_scaling; a sliding_window_pattern, no layer_types) and Gemma files whose
    hidden_act "gelu" means the tanh approximation: the Config holds what transformers'
    own config makes of them."""
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=7,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=12)  # fmt: skip
    old = dict(sizes, model_type="gemma3_text", rope_theta=1e5, rope_local_base_freq=100.0,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=16,
               sliding_window_pattern=3, cache_implementation="hybrid")  # fmt: skip
    want = transformers.Gemma3TextConfig(**old)
    cfg = hub.family_config("gemma3_text", dict(old), set())
    assert cfg.sliding_layers == tuple(k == "sliding_attention" for k in want.layer_types)
    full, local = want.rope_parameters["full_attention"], want.rope_parameters["sliding_attention"]
    assert (cfg.rope.kind, cfg.rope.factor, cfg.rope.theta) == ("linear", 8.0, full["rope_theta"])
    local_rope = cfg.parts.local_rope
    assert (local_rope.kind, local_rope.theta) == ("default", local["rope_theta"])
    gemma = dict(sizes, model_type="gemma", hidden_act="gelu", hidden_activation=None)
    assert transformers.GemmaConfig(**gemma).hidden_act == "gelu_pytorch_tanh"
    assert hub.family_config("gemma", dict(gemma), set()).ffn == "gated_gelu"  # tanh


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(sliding_layers=(True,), sliding_window=4), "1 flags for layers=2"),
        (dict(sliding_layers=(True, False)), "need sliding_window > 0"),
        (dict(local_rope=Rope(50.0), sliding_window=4), "local_rope needs sliding_layers"),
        (dict(logit_softcap=-1.0), "logit_softcap=-1.0 must be >= 0"),
    ],
)
def test_per_layer_options_that_contradict_are_config_errors(options, match):
    with pytest.raises(ConfigError, match=match):
        Config(layers=2, **options)


def test_family_options_keep_their_old_config_spellings():
    """The options that moved from Config into their family's parts (models/parts.py)
    are still set by their old names (a run.json's --set, Config(...)); a misspelt one
    gets the closest name, and one the config's family lacks names the family it is
    of. The hub's builder records each model's family."""
    from models import architecture as config
    from models import catalog

    gemma2, opt = catalog.get("gemma-2-2b"), catalog.get("opt-125m")
    assert (gemma2.family, opt.family, catalog.get("bert-base-uncased").family) == (
        "gemma2", "opt", "bert",
    )  # fmt: skip
    sets = config.parse_overrides(["logit_softcap=5", "attention_softcap=2.5"])
    changed = gemma2.replace(**sets)
    assert (changed.parts.logit_softcap, changed.parts.attention_softcap) == (5.0, 2.5)
    assert changed.family == "gemma2" and changed.parts.__class__ is gemma2.parts.__class__
    offset = opt.replace(**config.parse_overrides(["position_offset=3"]))
    assert offset.parts.position_offset == 3 and offset.ffn == "relu"
    assert Config(type_vocab=3).parts.type_vocab == 3  # a plain config takes BERT's types
    with pytest.raises(ConfigError, match="did you mean 'logit_softcap'"):
        config.parse_overrides(["logit_softcp=5"])
    with pytest.raises(ConfigError, match="did you mean 'position_offset'"):
        Config(position_ofset=2)
    with pytest.raises(ConfigError, match="logit_softcap.*models.families.gemma2"):
        opt.replace(logit_softcap=1.0)


def test_gemma_folders_that_would_compute_otherwise_are_refused(built, tmp_path):
    """Gemma 2 weights labelled Gemma (its post-norms unread), and a Gemma 3 attention
    cap, which transformers' Gemma 3 reads but never applies."""
    gemma2_keys = ("attn_logit_softcapping", "final_logit_softcapping", "layer_types")
    gemma2_keys += ("query_pre_attn_scalar", "sliding_window")
    folder = relabel(built, "gemma2", tmp_path, model_type="gemma", **dict.fromkeys(gemma2_keys))
    with pytest.raises(hub.UnsupportedModelError, match=r"does not read: .*post_feedforward"):
        hub.load(folder)
    folder = relabel(built, "gemma3", tmp_path, attn_logit_softcapping=50.0)
    with pytest.raises(hub.UnsupportedModelError, match="attn_logit_softcapping=50.0"):
        hub.load(folder)
