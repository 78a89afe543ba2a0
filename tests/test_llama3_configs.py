"""The catalog's Llama 3 70B and 405B (Llama 3.1) are what the hub makes of their
config.json, with as many parameters as transformers' models built from those configs
on the meta device and as their model cards publish."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models import catalog  # noqa: E402
from models.io import hub  # noqa: E402
from models.layers.common import count  # noqa: E402

# config.json of meta-llama/Meta-Llama-3-70B and Llama-3.1-405B, written out here
LLAMA = {
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                       rms_norm_eps=1e-5, max_position_embeddings=8192, rope_theta=500000.0),
    "llama3-405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                        num_attention_heads=128, num_key_value_heads=8, vocab_size=128256,
                        rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
}  # fmt: skip
PUBLISHED = {"llama3-70b": 70_553_706_496, "llama3-405b": 405_853_388_800}


@pytest.mark.parametrize("name", list(LLAMA))
def test_llama3_named_config_is_the_checkpoints(name):
    hf = transformers.LlamaConfig(**LLAMA[name])
    with torch.device("meta"):
        reference = transformers.LlamaForCausalLM(hf)
    names = {k for k, _ in reference.named_parameters()}
    named = catalog.get(name)
    built = hub.FAMILIES["llama"].config(
        hf.to_dict(), names
    )  # hub.family_config records the family
    assert built.replace(batch=named.batch, family="llama") == named
    held = sum(p.numel() for p in reference.parameters())
    assert count(hub.shapes_of("llama", named)) == held == PUBLISHED[name]
