"""Qwen3 (Qwen3ForCausalLM): Llama plus an RMSNorm of each head's queries and keys
over head_dim (q_norm, k_norm) before the rotary embedding; head_dim is its own size.
Windows as Qwen2's."""

from __future__ import annotations

from models.architecture import Config
from models.families import llama, qwen2


def config(hf: dict, names: set[str]) -> Config:
    return llama.decoder_config(hf, names, qk_norm=True, sliding_window=qwen2.window(hf))


# Qwen3Config's: head_dim 128 whatever hidden_size / heads is
DEFAULTS = qwen2.DEFAULTS | dict(head_dim=128)
FAMILY = qwen2.FAMILY._replace(
    name="qwen3", config=config, heads="Qwen3ForCausalLM", defaults=DEFAULTS
)

# The canonical checkpoints' config.json keys (models.catalog.configs names them)
NAMED = {
    "qwen3-8b": dict(
        hidden_act="silu", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        use_sliding_window=False, sliding_window=None, max_window_layers=36,
        tie_word_embeddings=False,
    ),
}  # fmt: skip
