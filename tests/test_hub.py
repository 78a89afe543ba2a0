"""models.io.hub against the reference implementations: small random-init `transformers`
models (built from configs, never downloaded), every parameter perturbed so biases and
norm scales are not trivial, saved with save_pretrained and loaded with hub.load, give
the same logits alone and under layouts on 8 devices; hub.save writes what
transformers loads back; bad folders raise typed errors."""

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lowering import Layout, Mesh  # noqa: E402
from models import transformer  # noqa: E402
from models.cli.generate import Decoder  # noqa: E402
from models.io import hub  # noqa: E402

VOCAB, BATCH, LENGTH, DEC_LENGTH = 64, 8, 12, 7
R = np.random.default_rng(0)
IDS = R.integers(0, VOCAB, (BATCH, LENGTH))
DEC_IDS = R.integers(0, VOCAB, (BATCH, DEC_LENGTH))
TYPES = R.integers(0, 2, (BATCH, LENGTH))
MASK = (np.arange(LENGTH)[None, :] < R.integers(LENGTH // 2, LENGTH + 1, (BATCH, 1))).astype(
    np.int64
)


# fmt: off
def hf_models():
    """name -> (a transformers model class, its config): each family's options."""
    T = transformers
    small = dict(vocab_size=VOCAB)
    return {
        "gpt2": (T.GPT2LMHeadModel, T.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, n_positions=32, **small)),
        # grouped-query (8 query heads on 4 kv heads), head_dim != d_model / heads
        "llama": (T.LlamaForCausalLM, T.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-5, rope_theta=500.0, **small)),
        "t5": (T.T5ForConditionalGeneration, T.T5Config(
            d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=10, **small)),
        "t5_v1_1": (T.T5ForConditionalGeneration, T.T5Config(
            d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            feed_forward_proj="gated-gelu", tie_word_embeddings=False, **small)),
        "bert": (T.BertForMaskedLM, T.BertConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=16, type_vocab_size=3, **small)),
    }
# fmt: on


def reference_logits(name: str, model) -> np.ndarray:
    with torch.no_grad():
        return model(**hf_inputs(name)).logits.numpy()


def hf_inputs(name: str) -> dict:
    t = lambda x: torch.tensor(np.asarray(x))
    if name.startswith("t5"):
        return {"input_ids": t(IDS), "attention_mask": t(MASK), "decoder_input_ids": t(DEC_IDS)}
    if name == "bert":
        return {"input_ids": t(IDS), "attention_mask": t(MASK), "token_type_ids": t(TYPES)}
    return {"input_ids": t(IDS)}


def zoo_inputs(name: str) -> dict:
    if name.startswith("t5"):
        return {"input_ids": IDS, "attention_mask": MASK, "decoder_input_ids": DEC_IDS}
    if name == "bert":
        return {"input_ids": IDS, "attention_mask": MASK, "token_type_ids": TYPES}
    return {"input_ids": IDS}


def as_array(logits) -> np.ndarray:
    return np.asarray(logits.transpose("batch", "length", "vocab").data)


def assert_close(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, np.abs(want).max()))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (folder written by save_pretrained, the reference's logits)."""
    torch.manual_seed(0)
    out = {}
    for name, (cls, cfg) in hf_models().items():
        model = cls(cfg).eval()
        with torch.no_grad():  # non-trivial biases, norm scales, relative and type tables
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = (folder, reference_logits(name, model))
    return out


@pytest.fixture(scope="module")
def loaded(folders):
    return {name: hub.load(folder) for name, (folder, _) in folders.items()}


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5", "t5_v1_1", "bert"])
def test_logits_equal_the_reference(folders, loaded, name):
    assert_close(as_array(loaded[name].logits(**zoo_inputs(name))), folders[name][1])


def test_loaded_configs_have_the_families_options(loaded):
    llama, t5, bert = loaded["llama"].config, loaded["t5"].config, loaded["bert"].config
    assert (llama.kv_heads, llama.q_per_kv, llama.d_kv, llama.positions) == (4, 2, 8, "rotary")
    assert llama.rope.theta == 500.0 and llama.norm_eps == 1e-5
    assert loaded["llama"].params["layers"]["attn"]["k"].dims == (
        "layers", "d_model", "kv_heads", "d_kv",
    )  # fmt: skip
    assert (t5.relative_buckets, t5.relative_max_distance, t5.encoder_layers, t5.layers) == (
        8, 10, 2, 3,
    )  # fmt: skip
    assert not t5.attention_scale and t5.scale_tied_logits
    assert not loaded["t5_v1_1"].config.scale_tied_logits
    assert (bert.block, bert.parts.type_vocab, bert.ffn, bert.norm_eps) == (
        "post", 3, "gelu_exact", 1e-12,
    )  # fmt: skip


MESH = {"rows": 2, "cols": 4}
LAYOUTS = {  # data, Megatron (heads, d_ff and vocab on one axis), 2D; shared by the
    # families, so a rule may name a dim one lacks (kv_heads in GPT-2)
    "data": Layout("batch:rows,cols", shared=True),
    "megatron": Layout("heads:cols;kv_heads:cols;d_ff:cols;vocab:cols", shared=True),
    "2d": Layout("batch:rows;heads:cols;kv_heads:cols;d_ff:cols", shared=True),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ["gpt2", "llama", "t5", "bert"])
def test_logits_under_layouts_on_8_devices(folders, name, layout):
    """Each parameter placed on its devices straight from the file, then the same logits."""
    mesh = Mesh(MESH)
    model = hub.load(folders[name][0], mesh=mesh, layout=LAYOUTS[layout])
    if layout != "data":  # the split parameters hold only their shards
        p = model.params["layers"]["ffn"]["wi"]
        axis = p.dims.index("d_ff")
        assert p.data.sharding.shard_shape(p.data.shape)[axis] == p.data.shape[axis] // 4
    assert_close(as_array(model.logits(**zoo_inputs(name))), folders[name][1])


def test_rotary_is_layout_independent_under_a_split_length(folders):
    model = hub.load(folders["llama"][0], mesh=Mesh(MESH), layout="length:cols;kv_heads:rows")
    assert_close(as_array(model.logits(IDS)), folders["llama"][1])


def test_a_device_reads_only_its_slice_of_a_fused_tensor(folders, loaded):
    """GPT-2's c_attn fuses q, k, v: the block of k for layer 1 and heads 2:4 is read as
    that slice of the file and equals the loaded parameter's block."""
    gpt2 = loaded["gpt2"]
    t = hub.tensors("gpt2", gpt2.config, "transformer.")["layers/attn/k"]
    weights = hub.Weights(folders["gpt2"][0])
    index = (slice(1, 2), slice(None), slice(2, 4), slice(None))
    full = np.asarray(gpt2.params["layers"]["attn"]["k"].transpose(*t.dims).data)
    np.testing.assert_array_equal(t.read(weights, index), full[index])


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5_v1_1", "bert"])
def test_save_round_trips_through_transformers(folders, loaded, tmp_path, name):
    hub.save(loaded[name], tmp_path)
    cls, _ = hf_models()[name]
    back = cls.from_pretrained(tmp_path).eval()
    assert_close(reference_logits(name, back), folders[name][1])


def test_sharded_checkpoints_load(folders, tmp_path):
    cls, _ = hf_models()["llama"]
    cls.from_pretrained(folders["llama"][0]).save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert_close(as_array(hub.load(tmp_path).logits(IDS)), folders["llama"][1])


def test_bfloat16_files_load_as_float32(folders, tmp_path):
    """safetensors' NumPy reader has no bfloat16: such tensors are memory-mapped."""
    cls, _ = hf_models()["gpt2"]
    model = cls.from_pretrained(folders["gpt2"][0]).eval()
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    want = reference_logits("gpt2", model.to(torch.float32))  # the rounded weights
    got = hub.load(tmp_path)
    assert got.params["embed"].data.dtype == np.float32
    assert_close(as_array(got.logits(IDS)), want)


def test_t5_buckets_equal_the_reference():
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = np.arange(-300, 301)
    for bidirectional in (True, False):
        for buckets, distance in ((32, 128), (8, 10), (6, 20)):
            want = T5Attention._relative_position_bucket(
                torch.tensor(rel), bidirectional, buckets, distance
            ).numpy()
            got = transformer.relative_buckets([0], rel, bidirectional, buckets, distance)[0]
            np.testing.assert_array_equal(got, want)


# --- greedy decoding with the KV cache -------------------------------------------------
NEW = 16


def hf_greedy(name: str, folder, **inputs) -> np.ndarray:
    model = hf_models()[name][0].from_pretrained(folder).eval()
    model.generation_config.eos_token_id = None  # 16 tokens, whatever they are
    with torch.no_grad():
        out = model.generate(
            **{k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in inputs.items()},
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            use_cache=False,  # its cache fails on T5 with more decoder than encoder layers
        )
    return out.numpy()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_greedy_decoding_equals_transformers_generate(folders, loaded, name):
    """Prompts of lengths 5, 2 and 4 in one right-padded batch, one prefill pass, then
    the cache: each row's tokens are transformers' for that prompt alone."""
    prompts = [IDS[0, :5], IDS[1, :2], IDS[2, :4]]
    model = loaded[name]
    got = Decoder(model.params, model.config, slots=32).decode(prompts, NEW)
    for row, prompt in zip(got, prompts, strict=True):
        want = hf_greedy(name, folders[name][0], input_ids=prompt[None])[0, len(prompt) :]
        np.testing.assert_array_equal(row, want)


def test_t5_greedy_decoding_encodes_once_and_equals_transformers(folders, loaded):
    """A padded batch: the encoder runs once, the decoder caches its self-attention."""
    inputs, mask = IDS[:2], MASK[:2]
    want = hf_greedy(
        "t5", folders["t5"][0], input_ids=inputs, attention_mask=mask, decoder_start_token_id=0
    )[:, 1:]
    model = loaded["t5"]
    dec = Decoder(model.params, model.config, slots=NEW + 1)
    dec.encode(inputs, mask)
    got = dec.greedy_rows(np.zeros((2, 1), np.int64), NEW)
    np.testing.assert_array_equal(got, want)


# --- typed errors -------------------------------------------------------------------------
def copy(folders, name, tmp_path):
    shutil.copytree(folders[name][0], tmp_path / name)
    return tmp_path / name


def edit_config(folder, **changes):
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_unsupported_family_is_named(folders, tmp_path):
    folder = copy(folders, "gpt2", tmp_path)
    edit_config(folder, model_type="mamba")
    with pytest.raises(hub.UnsupportedModelError, match="'mamba'.*bert, .*gpt2, .*llama, .*t5"):
        hub.load(folder)


def test_missing_files_are_named(folders, tmp_path):
    folder = copy(folders, "bert", tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(hub.MissingFileError, match="no model.safetensors"):
        hub.load(folder)
    (folder / "config.json").unlink()
    with pytest.raises(hub.MissingFileError, match="no config.json"):
        hub.load(folder)


def test_a_shape_mismatch_names_the_tensor_and_both_shapes(folders, tmp_path):
    folder = copy(folders, "llama", tmp_path)
    edit_config(folder, intermediate_size=48)
    with pytest.raises(
        hub.WeightShapeError, match=r"gate_proj.weight' has shape \(64, 32\).*\(48, 32\)"
    ):
        hub.load(folder)


def test_unsupported_options_are_named(folders, tmp_path):
    folder = copy(folders, "llama", tmp_path)
    edit_config(folder, rope_parameters={"rope_type": "su", "rope_theta": 1e4})
    with pytest.raises(hub.UnsupportedModelError, match="rope_type='su'"):
        hub.load(folder)
    edit_config(folder, rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "beta": 2})
    with pytest.raises(hub.UnsupportedModelError, match="'beta': 2.*'linear'"):
        hub.load(folder)
    edit_config(folder, rope_parameters=None, logit_scale=0.5)  # read by no family module
    with pytest.raises(hub.UnsupportedModelError, match="'logit_scale': 0.5.*families/llama"):
        hub.load(folder)


# --- the named configs have the published shapes -------------------------------------------
# fmt: off
def published():
    """The published models' configs (transformers' defaults are gpt2 and t5-small),
    written out here, not derived from the zoo (bert-base-uncased, a family's NAMED, is
    tests/test_named_configs.py's)."""
    T = transformers
    return {
        "gpt2": (T.GPT2LMHeadModel, T.GPT2Config()),
        "gpt2-medium": (T.GPT2LMHeadModel, T.GPT2Config(n_embd=1024, n_layer=24, n_head=16)),
        "tinyllama-1.1b": (T.LlamaForCausalLM, T.LlamaConfig(
            hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
            num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
            rms_norm_eps=1e-5, max_position_embeddings=2048)),
        "llama3-8b": (T.LlamaForCausalLM, T.LlamaConfig(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
            rms_norm_eps=1e-5, max_position_embeddings=8192, rope_theta=500000.0)),
        "t5-small": (T.T5ForConditionalGeneration, T.T5Config()),
        "t5-base": (T.T5ForConditionalGeneration, T.T5Config(
            d_model=768, d_ff=3072, num_layers=12, num_heads=12)),
        "t5-v1_1-small": (T.T5ForConditionalGeneration, T.T5Config(
            d_model=512, d_ff=1024, num_layers=8, num_heads=6, feed_forward_proj="gated-gelu",
            tie_word_embeddings=False)),
    }
# fmt: on


@pytest.mark.parametrize("name", list(published()))
def test_named_configs_are_the_published_models(name):
    """The zoo's named config is what hub makes of the model's config.json, and it has
    as many parameters as transformers' model (built on the meta device: no memory)."""
    from models import catalog
    from models.layers.common import count

    cls, hf = published()[name]
    family = hf.model_type
    with torch.device("meta"):
        reference = cls(hf)
    names = {k for k, _ in reference.named_parameters()}
    if name == "t5-v1_1-small":
        names.add("lm_head.weight")  # the file holds it; transformers 5 ties it on load
    hf_dict = hf.to_dict()
    if name == "t5-v1_1-small":
        hf_dict["tie_word_embeddings"] = False
        hf_dict.pop("scale_decoder_outputs")
    cfg = hub.FAMILIES[family].config(hf_dict, names)
    named = catalog.get(name)
    assert cfg.replace(batch=named.batch, family=family) == named
    extra = hf.vocab_size * hf.d_model if name == "t5-v1_1-small" else 0
    want = sum(p.numel() for p in reference.parameters()) + extra
    assert count(hub.shapes_of(family, named)) == want


def test_config_options_that_contradict_are_refused():
    from models.architecture import Config, ConfigError

    with pytest.raises(ConfigError, match="kv_heads=3 does not divide heads=4"):
        Config(heads=4, kv_heads=3)
    with pytest.raises(ConfigError, match="Config.block must be one of .*'middle'"):
        Config(block="middle")
    with pytest.raises(ValueError, match="ffn must be one of"):
        transformer.lm_shapes(Config(ffn="gated_tanh"))
