"""Qwen3 (Qwen3ForCausalLM): Llama plus an RMSNorm of each head's queries and keys
over head_dim (q_norm, k_norm) before the rotary embedding; head_dim is its own size.
Windows as Qwen2's."""

from __future__ import annotations

from models.config import Config
from models.families import llama, qwen2


def config(hf: dict, names: set[str]) -> Config:
    return llama.decoder_config(hf, names, qk_norm=True, sliding_window=qwen2.window(hf))


FAMILY = llama.FAMILY._replace(name="qwen3", config=config, heads="Qwen3ForCausalLM")
