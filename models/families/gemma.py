"""Gemma (GemmaForCausalLM): Llama's layout and weight names with RMSNorms that scale
by 1 + weight (the product in float32), token embeddings times sqrt(d_model) rounded
to the compute dtype, a gated tanh-GELU FFN, head_dim apart from hidden_size / heads,
tied embeddings by default. Gemma 2 and Gemma 3 build on it."""

from __future__ import annotations

from models.architecture import Config
from models.families import llama
from models.families.common import act, require


def options(hf: dict, activation: str) -> dict:
    """The Config options every Gemma has, its FFN gated by the zoo's `activation`."""
    require(hf, "use_bidirectional_attention", (None, False), None)  # EmbeddingGemma's
    return dict(
        ffn=f"gated_{activation}", norm="rms_offset", embed_scale=True,
        shared_embedding=bool(hf.get("tie_word_embeddings", True)),
    )  # fmt: skip


def config(hf: dict, names: set[str]) -> Config:
    # transformers reads Gemma's legacy hidden_act "gelu" as the tanh approximation, and
    # hidden_activation (in older files) not at all
    hf.get("hidden_activation")
    activation = "gelu" if hf.get("hidden_act", "gelu") == "gelu" else act(hf, "hidden_act")
    return llama.decoder_config(hf, names, **options(hf, activation))


# GemmaConfig's: head_dim 256, tied, tanh-GELU
DEFAULTS = llama.DEFAULTS | dict(
    hidden_act="gelu_pytorch_tanh", head_dim=256, tie_word_embeddings=True,
    max_position_embeddings=8192, num_key_value_heads=16,
)  # fmt: skip
FAMILY = llama.FAMILY._replace(
    name="gemma", config=config, heads="GemmaForCausalLM", defaults=DEFAULTS
)

# The canonical checkpoints' config.json keys (models.catalog.configs names them)
_GEMMA = dict(
    vocab_size=256000, head_dim=256, max_position_embeddings=8192, hidden_act="gelu",
    rms_norm_eps=1e-6, rope_theta=10000.0,
)  # fmt: skip
NAMED = {
    "gemma-2b": dict(_GEMMA, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                     num_attention_heads=8, num_key_value_heads=1),
    "gemma-7b": dict(_GEMMA, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                     num_attention_heads=16, num_key_value_heads=16),  # GemmaConfig's defaults
}  # fmt: skip
