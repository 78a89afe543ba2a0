"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 (q/k norms, head_dim its own size, no
biases) whose FFN is a mixture of experts as Qwen2-MoE's without the shared expert.
A sliding window on every layer where use_sliding_window (transformers' Qwen3-MoE
ignores max_window_layers)."""

from __future__ import annotations

from models.architecture import Config
from models.families import llama, qwen2_moe
from models.families.common import Entry, moe_rows


def window(hf: dict) -> int:
    hf.get("max_window_layers")  # kept in the files, read by no layer
    size = hf.get("sliding_window") or 0
    return size if hf.get("use_sliding_window", False) else 0


def config(hf: dict, names: set[str]) -> Config:
    # transformers 5 writes num_local_experts (its attribute_map), the hub's files num_experts
    key = "num_experts" if "num_experts" in hf else "num_local_experts"
    moe = qwen2_moe.sparse_options(hf, key)
    return llama.decoder_config(hf, names, qk_norm=True, sliding_window=window(hf), **moe)


def table(cfg: Config, prefix: str) -> list[Entry]:
    return llama.stacks(cfg, prefix, lambda c, layer: moe_rows(layer, "mlp"))


FAMILY = qwen2_moe.FAMILY._replace(
    name="qwen3_moe",
    config=config,
    table=table,
    heads="Qwen3MoeForCausalLM",
    unused=lambda cfg: (),  # no shared expert: a folder holding one is refused
    # Qwen3MoeConfig's: top-8 not renormalised, no biases
    defaults={k: v for k, v in qwen2_moe.DEFAULTS.items() if k != "max_window_layers"}
    | dict(num_key_value_heads=4, num_experts_per_tok=8),
)

# The canonical checkpoints' config.json keys (models.catalog.configs names them)
NAMED = {
    "qwen3-30b-a3b": dict(
        hidden_act="silu", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        use_sliding_window=False, sliding_window=None, max_window_layers=48,
        decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        output_router_logits=False, router_aux_loss_coef=0.001, tie_word_embeddings=False,
    ),
}  # fmt: skip
