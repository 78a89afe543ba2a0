"""Mistral (MistralForCausalLM): Llama with a sliding attention window on every layer
(`sliding_window`; null: none), so a query sees only the last `sliding_window` keys,
in every attention kernel and in the KV cache."""

from __future__ import annotations

from models.architecture import Config
from models.families import llama


def config(hf: dict, names: set[str]) -> Config:
    return llama.decoder_config(hf, names, sliding_window=hf.get("sliding_window") or 0)


# MistralConfig's: a window of 4096 where the file names none
DEFAULTS = llama.DEFAULTS | dict(
    max_position_embeddings=131072, num_key_value_heads=8, sliding_window=4096
)
FAMILY = llama.FAMILY._replace(
    name="mistral", config=config, heads="MistralForCausalLM", defaults=DEFAULTS
)

# The canonical checkpoints' config.json keys (models.catalog.configs names them)
NAMED = {
    "mistral-7b": dict(  # Mistral-7B-v0.1: MistralConfig's but 32768 positions, eps 1e-5
        hidden_act="silu", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False,
    ),
}  # fmt: skip
