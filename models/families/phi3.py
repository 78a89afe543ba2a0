"""Phi-3 and Phi-4-mini (Phi3ForCausalLM): Llama with q, k and v fused in one
qkv_proj tensor (q's rows, then k's, then v's: parts of unequal sizes under
grouped-query heads) and the gate and up projections in one gate_up_proj; rope
scaling `longrope` (short and long factors per pair, switched past
original_max_position_embeddings), partial rotary (partial_rotary_factor), and a
sliding window on every layer when `sliding_window` is set."""

from __future__ import annotations

from models.architecture import Config
from models.families import llama
from models.families.common import Entry

FUSED = ("layers/attn/q", "layers/attn/k", "layers/attn/v", "layers/ffn/wi", "layers/ffn/wg")


def config(hf: dict, names: set[str]) -> Config:
    # the pretraining context: transformers prefers it to rope_parameters' own
    top = {"original_max_position_embeddings": hf.get("original_max_position_embeddings")}
    partial = {"partial_rotary_factor": hf.get("partial_rotary_factor")}  # Phi-4-mini: top level
    longrope = {"su": "longrope", "yarn": "longrope"}  # as transformers' Phi3Config reads them
    rope = llama.rope_of(hf, partial=True, defaults=partial, overrides=top, aliases=longrope)
    return llama.decoder_config(hf, names, rope=rope, sliding_window=hf.get("sliding_window") or 0)


def table(cfg: Config, prefix: str) -> list[Entry]:
    """Llama's table with q, k, v and the gate and up projections read from their
    fused tensors."""
    layer = f"{prefix}layers.{{i}}."
    qkv, gate_up = f"{layer}self_attn.qkv_proj.weight", f"{layer}mlp.gate_up_proj.weight"
    q, kv = cfg.heads * cfg.d_kv, (cfg.kv_heads or cfg.heads) * cfg.d_kv
    return [e for e in llama.table(cfg, prefix) if e.path not in FUSED] + [
        Entry("layers/attn/q", qkv, "(Q d_kv) d_model", (0, 0, (q, kv, kv))),
        Entry("layers/attn/k", qkv, "(KV d_kv) d_model", (0, 1, (q, kv, kv))),
        Entry("layers/attn/v", qkv, "(KV d_kv) d_model", (0, 2, (q, kv, kv))),
        Entry("layers/ffn/wi", gate_up, "d_ff d_model", (0, 0, 2)),  # gate: activated
        Entry("layers/ffn/wg", gate_up, "d_ff d_model", (0, 1, 2)),  # up
    ]


# Phi3Config's: RMSNorm eps 1e-5, 4096 positions
DEFAULTS = llama.DEFAULTS | dict(
    rms_norm_eps=1e-5, max_position_embeddings=4096, original_max_position_embeddings=4096
)
FAMILY = llama.FAMILY._replace(
    name="phi3", config=config, table=table, heads="Phi3ForCausalLM", defaults=DEFAULTS
)

# The canonical checkpoints' config.json keys (models.catalog.configs names them)
NAMED = {
    "phi-3-mini-4k": dict(  # Phi3Config's defaults but the 2047-token window
        hidden_act="silu", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
        original_max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
        sliding_window=2047, tie_word_embeddings=False,
    ),
}  # fmt: skip
