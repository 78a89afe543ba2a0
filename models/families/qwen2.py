"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): Llama plus biases on the q, k and v
projections (none on o or the MLP). Sliding windows only when `use_sliding_window`
and on the layers `layer_types` marks: the zoo implements all or none of them."""

from __future__ import annotations

from models.architecture import Config
from models.families import llama
from models.families.common import UnsupportedModelError


def window(hf: dict) -> int:
    """The sliding window every layer has (0: none); mixed layer_types are refused."""
    kinds = set(hf.get("layer_types") or ["full_attention"])
    hf.get("max_window_layers")  # transformers reads it only to make layer_types
    use = hf.get("use_sliding_window", False)
    size = hf.get("sliding_window")
    if kinds == {"full_attention"} and not use:
        return 0
    if kinds == {"sliding_attention"} and use and size:
        return size
    raise UnsupportedModelError(
        f"config.json: use_sliding_window={use} with layer_types {sorted(kinds)} "
        f"(sliding_window={size}): only all-full or all-sliding layers are implemented"
    )


def config(hf: dict, names: set[str]) -> Config:
    return llama.decoder_config(hf, names, qkv_bias=True, sliding_window=window(hf))


# Qwen2Config's (its window only where use_sliding_window)
DEFAULTS = llama.DEFAULTS | dict(
    max_position_embeddings=32768, num_key_value_heads=32, use_sliding_window=False,
    sliding_window=4096, max_window_layers=28,
)  # fmt: skip
FAMILY = llama.FAMILY._replace(
    name="qwen2",
    config=config,
    heads="Qwen2ForCausalLM",
    tokens=(),  # no BOS: text alone
    defaults=DEFAULTS,
)

# The canonical checkpoints' config.json keys (models.catalog.configs names them)
NAMED = {
    "qwen2.5-7b": dict(
        hidden_act="silu", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
        rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False,
        sliding_window=131072, max_window_layers=28, tie_word_embeddings=False,
    ),
}  # fmt: skip
