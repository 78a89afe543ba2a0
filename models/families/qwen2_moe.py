"""Qwen1.5-MoE and Qwen2-MoE (Qwen2MoeForCausalLM): Qwen2 (q/k/v biases, its windows)
whose FFN is a mixture of num_experts experts of moe_intermediate_size, top
num_experts_per_tok of the router's softmax (renormalised over the chosen where
`norm_topk_prob`: the zoo's topk_softmax router, else softmax_topk), plus a shared
expert of shared_expert_intermediate_size that every token passes, scaled by
sigmoid(x . shared_expert_gate) (none where that size is 0). Dense layers
(mlp_only_layers, decoder_sparse_step > 1) are a stack of their own before the sparse
ones (Config.dense_layers, as DeepSeek-V3's); dense layers after a sparse one are
refused."""

from __future__ import annotations

from dataclasses import dataclass

import namedmesh as nm
from models.architecture import Config
from models.families import llama, mixtral, qwen2
from models.families.common import Entry, UnsupportedModelError, linear, moe_rows
from models.layers.common import Param
from models.parts import Parts


@dataclass(frozen=True)
class SharedGate(Parts):
    """The shared experts' output times sigmoid(x . gate), a learned gate over d_model
    (shared_expert_gate), where `shared_gate`."""

    shared_gate: bool = True

    def shared_expert_shapes(self, cfg) -> dict:
        d = cfg.d_model
        return {"gate": Param({"d_model": d}, d**-0.5)} if self.shared_gate else {}

    def shared_expert(self, x, p: dict, y):
        if not self.shared_gate:
            return y
        return y * nm.sigmoid(nm.einsum(x, p["gate"], out=x.dims[:-1]))


def sparse_options(hf: dict, key: str = "num_experts") -> dict:
    """The options of a Qwen-MoE's experts (`key`: how config.json names their number,
    each moe_intermediate_size wide) and of its dense layers (mlp_only_layers, and those
    decoder_sparse_step skips: intermediate_size wide), which the zoo runs as a stack
    of their own before the sparse ones: dense layers after a sparse one are refused."""
    n, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    only = hf.get("mlp_only_layers") or []
    experts = hf[key]  # a size: absent, the file is damaged (not a dense model)
    dense = [i for i in range(n) if i in only or (i + 1) % step or not experts]
    if dense != list(range(len(dense))) or len(dense) == n:
        raise UnsupportedModelError(
            f"config.json: decoder_sparse_step={step}, mlp_only_layers={only}, {key}="
            f"{experts} make layer(s) {dense} of {n} dense: implemented only as the first "
            "layers before at least one sparse one"
        )
    router = "topk_softmax" if hf.get("norm_topk_prob", False) else "softmax_topk"
    moe = mixtral.moe_options(hf, experts, router)
    return dict(moe, expert_ff=hf["moe_intermediate_size"], dense_layers=len(dense))


def config(hf: dict, names: set[str]) -> Config:
    shared = hf["shared_expert_intermediate_size"]
    return llama.decoder_config(
        hf, names, qkv_bias=hf.get("qkv_bias", True), sliding_window=qwen2.window(hf),
        shared_ff=shared, parts=SharedGate(bool(shared)), **sparse_options(hf),
    )  # fmt: skip


def moe_table(cfg: Config, layer: str) -> list[Entry]:
    """The routed experts' rows, and the shared expert's and its gate's."""
    rows = moe_rows(layer, "mlp")
    if cfg.shared_ff:
        s, path = f"{layer}mlp.shared_expert.", "layers/ffn/shared/"
        rows += linear(f"{path}wi", f"{s}gate_proj", "d_ff", "d_model", False)
        rows += linear(f"{path}wg", f"{s}up_proj", "d_ff", "d_model", False)
        rows += linear(f"{path}wo", f"{s}down_proj", "d_model", "d_ff", False)
        rows += [Entry(f"{path}gate", f"{layer}mlp.shared_expert_gate.weight", "() d_model")]
    return rows


def table(cfg: Config, prefix: str) -> list[Entry]:
    return llama.stacks(cfg, prefix, moe_table)


def unused(cfg: Config) -> tuple[tuple[str, bool], ...]:
    """A shared expert of width 0 (shared_expert_intermediate_size 0) adds exactly 0:
    transformers still saves its weights, empty, and its gate, which scales that 0;
    none is read (Family.unused)."""
    if cfg.shared_ff:
        return ()
    return ((r".*mlp\.shared_expert\.(gate|up|down)_proj\.weight$", True),
            (r".*mlp\.shared_expert_gate\.weight$", False))  # fmt: skip


# Qwen2MoeConfig's: top-4 not renormalised, q/k/v biases
DEFAULTS = qwen2.DEFAULTS | dict(
    num_key_value_heads=16, num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1,
    qkv_bias=True, router_aux_loss_coef=0.001, output_router_logits=False,
)  # fmt: skip
FAMILY = qwen2.FAMILY._replace(
    name="qwen2_moe", config=config, table=table, heads="Qwen2MoeForCausalLM", unused=unused,
    defaults=DEFAULTS,
)  # fmt: skip

# The canonical checkpoints' config.json keys (models.catalog.configs names them)
NAMED = {
    "qwen1.5-moe-a2.7b": dict(
        hidden_act="silu", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
        num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=1000000.0,
        use_sliding_window=False, sliding_window=32768, max_window_layers=21,
        decoder_sparse_step=1, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
        norm_topk_prob=False, output_router_logits=False, router_aux_loss_coef=0.001,
        tie_word_embeddings=False,
    ),
}  # fmt: skip
