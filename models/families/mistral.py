"""Mistral (MistralForCausalLM): Llama with a sliding attention window on every layer
(`sliding_window`; null: none), so a query sees only the last `sliding_window` keys,
in every attention kernel and in the KV cache."""

from __future__ import annotations

from models.config import Config
from models.families import llama


def config(hf: dict, names: set[str]) -> Config:
    return llama.decoder_config(hf, names, sliding_window=hf.get("sliding_window") or 0)


FAMILY = llama.FAMILY._replace(name="mistral", config=config, heads="MistralForCausalLM")
