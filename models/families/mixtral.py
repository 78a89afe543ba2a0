"""Mixtral (MixtralForCausalLM): Mistral whose FFN is a mixture of experts. A router
(block_sparse_moe.gate) takes each token's top num_experts_per_tok of num_local_experts
experts by its softmax and renormalises their weights to sum to 1 (transformers: softmax
over all, top-k, divide by the top-k's sum; equal to the softmax over the chosen logits:
the zoo's `topk_softmax` router); each expert is a SwiGLU (experts.{e}.w1, the
activation's input; w3; w2), stacked over `experts` (models/families/common.py
`moe_rows`). Routing is dropless, as transformers': every token reaches its experts.
A sliding window on every layer where `sliding_window` is set, as Mistral's."""

from __future__ import annotations

from models.architecture import Config
from models.families import llama
from models.families.common import Entry, moe_rows, require


def moe_options(hf: dict, experts: int, router: str) -> dict:
    """The Config options of a MoE family's router: its experts, the top-k, the router
    kind, and the weight of the balancing loss: router_aux_loss_coef where
    output_router_logits is set (transformers adds its auxiliary loss to the training
    loss only then; 0 otherwise, so a fine-tune minimises what transformers' does)."""
    coef = hf.get("router_aux_loss_coef", 0.001)  # transformers' default
    return dict(
        experts=experts, experts_per_token=hf["num_experts_per_tok"], router=router,
        moe_loss=float(coef) if hf.get("output_router_logits", False) else 0.0,
    )  # fmt: skip


def config(hf: dict, names: set[str]) -> Config:
    require(hf, "router_jitter_noise", (0, 0.0), 0.0)  # training noise on the router input
    moe = moe_options(hf, hf["num_local_experts"], "topk_softmax")
    return llama.decoder_config(hf, names, sliding_window=hf.get("sliding_window") or 0, **moe)


def table(cfg: Config, prefix: str) -> list[Entry]:
    return llama.table(cfg, prefix, lambda c, layer: moe_rows(layer, "block_sparse_moe", NAMES))


NAMES = ("w1", "w3", "w2")  # an expert's gate (activation's input), up and down projections

# MixtralConfig's: RMSNorm eps 1e-5, rotary base 1e6, top-2 of 8 experts
DEFAULTS = llama.DEFAULTS | dict(
    rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=131072, num_key_value_heads=8,
    num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.001,
    output_router_logits=False, router_jitter_noise=0.0,
)  # fmt: skip
FAMILY = llama.FAMILY._replace(
    name="mixtral", config=config, table=table, heads="MixtralForCausalLM", defaults=DEFAULTS
)

# The canonical checkpoints' config.json keys (models.catalog.configs names them)
NAMED = {
    "mixtral-8x7b": dict(  # Mixtral-8x7B-v0.1
        hidden_act="silu", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
        sliding_window=None, num_local_experts=8, num_experts_per_tok=2,
        output_router_logits=False, router_aux_loss_coef=0.02, tie_word_embeddings=False,
    ),
}  # fmt: skip
