"""The families of models/families/ against transformers: tiny random models built from
configs (never downloaded), every parameter perturbed, saved with save_pretrained and
loaded with hub.load. Each case gives transformers' logits (float32, 1e-4 relative, with
a padding mask) on one device and under a layout splitting heads, kv_heads, d_ff and
vocab; greedy tokens equal to transformers' generate; its bfloat16 folder loads; hub.save
writes what transformers loads back. Relabelled folders and unread options are refused.

Adding a family: one more entry in `cases()`, and in GREEDY / LAYOUT when it decodes."""

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lowering import Layout, Mesh  # noqa: E402
from models import hub  # noqa: E402
from models.config import ConfigError  # noqa: E402
from models.generate import Decoder  # noqa: E402

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
    rope = lambda kind, **kw: {"rope_parameters": {"rope_type": kind, "rope_theta": 500.0, **kw}}
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
    }
# fmt: on


# decoding (one compile each) where it differs: llama3's scaling and tied embeddings,
# Mistral's window past its size, Qwen3's q/k norms and head_dim; within the budget
GREEDY = ["llama3", "mistral", "qwen3"]
LAYOUT = ["llama3", "qwen2", "qwen3"]


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


@pytest.mark.parametrize("name", LAYOUT)
def test_logits_under_a_layout_on_8_devices(built, name):
    layout = Layout("batch:rows;heads:cols;kv_heads:cols;d_ff:cols;vocab:cols", shared=True)
    model = hub.load(built[name][0], mesh=Mesh({"rows": 2, "cols": 4}), layout=layout)
    k = model.params["layers"]["attn"]["k"].data
    assert k.sharding.shard_shape(k.shape)[2] == 1  # 4 kv heads over 4 devices
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


def test_dynamic_rope_refuses_a_cache_past_its_original_length(loaded):
    """Dynamic NTK's frequencies change as the sequence grows: keys cached under older
    ones would differ from transformers', so a cache past 8 positions is refused."""
    model = loaded["llama_dynamic"]
    with pytest.raises(ConfigError, match="'dynamic' with a KV cache of 24 slots"):
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


@pytest.mark.parametrize("attention,block", [("blockwise", 5), ("ring", 4)])
def test_sliding_window_inside_blockwise_and_ring(built, loaded, attention, block):
    """Mistral's window of 4 over 12 positions, the keys in blocks of 5 or a ring of 3."""
    model = loaded["mistral"]
    cfg = model.config.replace(attention=attention, attention_block=block)
    logits = hub.HubModel(model.family, cfg, model.params, None, model.hf_config).logits(
        IDS, attention_mask=MASK
    )
    assert_close(as_array(logits), built["mistral"][2])


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


def test_kernels_refuse_what_they_do_not_implement(loaded):
    model = loaded["mistral"]
    cfg = model.config.replace(attention="blockwise", attention_softcap=30.0)
    with pytest.raises(ConfigError, match="attention='blockwise' with softcap"):
        hub.HubModel(model.family, cfg, model.params, None, {}).logits(IDS)
