"""DeepSeek-V3 (DeepseekV3ForCausalLM; DeepSeek-V2's attention): Llama's blocks with
multi-head latent attention (models/mla.py: low-rank q with its norm, or one q
projection; keys and values from a kv_lora_rank latent with its norm; qk_rope_head_dim
rotated dims shared by every head's key, interleaved in pairs unless rope_interleave is
false; YaRN's mscale_all_dim on the softmax scale), the first `first_k_dense_replace`
layers a dense SwiGLU FFN. The cache holds the latent, not keys and values."""

from __future__ import annotations

from models.config import Config
from models.families import llama
from models.families.common import Entry, UnsupportedModelError, linear, norm, require
from models.latent import Latent


def latent(hf: dict) -> Latent:
    """The Latent of config.json; head_dim and qk_head_dim are derived (transformers
    sets them from qk_rope_head_dim and qk_nope_head_dim whatever the file says)."""
    hf.get("head_dim"), hf.get("qk_head_dim")
    return Latent(
        kv_rank=hf["kv_lora_rank"], nope=hf["qk_nope_head_dim"], v=hf["v_head_dim"],
        q_rank=hf.get("q_lora_rank") or 0, interleave=bool(hf.get("rope_interleave", True)),
    )  # fmt: skip


def check_heads(hf: dict) -> None:
    """Every head has its own key and value, expanded from the latent: key/value head
    counts other than the query heads' are refused (transformers' repeat_kv would not
    run), as are attention biases."""
    h = hf["num_attention_heads"]
    require(hf, "num_key_value_heads", (h, None), h)
    require(hf, "attention_bias", (False,), False)


def check_mtp(hf: dict, names: set[str]) -> None:
    """Multi-token-prediction layers (num_nextn_predict_layers, after the last layer) serve
    speculative decoding; the zoo has none, so weights holding them are refused by name."""
    n, extra = hf["num_hidden_layers"], hf.get("num_nextn_predict_layers", 0)
    held = sorted({x.split(".")[2] for x in names if x.startswith("model.layers.")})
    if mtp := [i for i in held if i.isdigit() and int(i) >= n]:
        raise UnsupportedModelError(
            f"the weights hold multi-token-prediction layer(s) model.layers.{mtp[0]}.* "
            f"(num_nextn_predict_layers={extra}): not implemented; drop them from the folder"
        )


MOE_KEYS = ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "n_shared_experts")
MOE_KEYS += ("moe_intermediate_size", "routed_scaling_factor", "norm_topk_prob")


def dense_layers(hf: dict) -> int:
    """The dense layers: all of them (the MoE layers after first_k_dense_replace are
    refused until the family routes them)."""
    n, k = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 3)
    for key in MOE_KEYS + ("output_router_logits",):
        hf.get(key)
    if k < n:
        raise UnsupportedModelError(
            f"config.json: first_k_dense_replace={k} < num_hidden_layers={n}: DeepSeek's "
            "mixture-of-experts layers are not implemented"
        )
    return n


def config(hf: dict, names: set[str]) -> Config:
    check_heads(hf)
    check_mtp(hf, names)
    dense_layers(hf)
    return llama.decoder_config(hf, names, mla=latent(hf), d_kv=hf["qk_rope_head_dim"], kv_heads=0)


def attention_rows(cfg: Config, prefix: str) -> list[Entry]:
    """The latent attention's tensors: kv_a_proj_with_mqa fuses the latent's rows then the
    shared rotated key's; q_b_proj and kv_b_proj hold each head's parts together."""
    m, a = cfg.mla, f"{prefix}layers.{{i}}.self_attn."
    kv_a, parts = f"{a}kv_a_proj_with_mqa.weight", (m.kv_rank, cfg.d_kv)
    rows = [
        Entry("layers/attn/kv_a", kv_a, "latent d_model", (0, 0, parts)),
        Entry("layers/attn/k_rope", kv_a, "d_kv d_model", (0, 1, parts)),
        *norm("layers/attn/kv_norm", f"{a}kv_a_layernorm", False, dim="latent"),
        Entry("layers/attn/kv_b", f"{a}kv_b_proj.weight", "(heads d_kvb) latent"),
        Entry("layers/attn/o", f"{a}o_proj.weight", "d_model (heads d_v)"),
    ]
    if not m.q_rank:
        return rows + [Entry("layers/attn/q", f"{a}q_proj.weight", "(heads d_qk) d_model")]
    return rows + [
        *linear("layers/attn/q_a", f"{a}q_a_proj", "q_latent", "d_model", False),
        *norm("layers/attn/q_a_norm", f"{a}q_a_layernorm", False, dim="q_latent"),
        Entry("layers/attn/q_b", f"{a}q_b_proj.weight", "(heads d_qk) q_latent"),
    ]


def table(cfg: Config, prefix: str) -> list[Entry]:
    rows = [e for e in llama.table(cfg, prefix) if not e.path.startswith("layers/attn/")]
    return rows + attention_rows(cfg, prefix)


FAMILY = llama.FAMILY._replace(
    name="deepseek_v3", config=config, table=table, heads="DeepseekV3ForCausalLM"
)
