"""DeepSeek-V3 (DeepseekV3ForCausalLM; DeepSeek-V2's attention): Llama's blocks with
multi-head latent attention (models/layers/mla.py: low-rank q with its norm, or one q
projection; keys and values from a kv_lora_rank latent with its norm; qk_rope_head_dim
rotated dims shared by every head's key, interleaved in pairs unless rope_interleave is
false; YaRN's mscale_all_dim on the softmax scale), whose KV cache holds the latent, not
keys and values; and a mixture of experts (models/layers/moe.py: sigmoid scores chosen with a
correction bias among the best expert groups, shared experts) after the first
`first_k_dense_replace` layers, which have a dense SwiGLU FFN (a stack of their own).
Multi-token-prediction layers in the weights are refused by name."""

from __future__ import annotations

from dataclasses import dataclass

from models.architecture import Config, ConfigError
from models.families import llama
from models.families.common import Entry, UnsupportedModelError, linear, norm, require
from models.families.common import experts as experts_linear
from models.layers.latent import Latent
from models.layers.moe import within_groups
from models.parts import Parts
from models.transformer import dense_config


@dataclass(frozen=True)
class GroupRouting(Parts):
    """DeepSeek-V3's routing: the experts in `expert_groups` groups, a token's chosen
    from its best `topk_groups` groups (each ranked by its two best scores: n_group,
    topk_group), the chosen experts' weights times `router_scale`
    (routed_scaling_factor)."""

    expert_groups: int = 1
    topk_groups: int = 1
    router_scale: float = 1.0

    def __post_init__(self):
        for name in ("expert_groups", "topk_groups"):
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ConfigError(f"Config.{name} (--set {name}=) must be an int >= 1, got {n!r}")

    def check(self, cfg) -> None:
        e, g, k, best = cfg.experts, self.expert_groups, cfg.experts_per_token, self.topk_groups
        if g > 1 and not e:
            raise ConfigError(
                f"Config.expert_groups={g} is an option of a mixture of experts: experts is 0"
            )
        if g > 1 and (e % g or e // g < 2 or not best <= g):
            raise ConfigError(
                f"Config.expert_groups={g} must divide experts={e} into groups of >= 2 (each "
                f"ranked by its two best), with topk_groups={best} <= {g}"
            )
        if g > 1 and k > best * (e // g):
            raise ConfigError(
                f"Config.experts_per_token={k} exceeds the experts of topk_groups={best} "
                f"groups of {e // g}"
            )

    def route_pick(self, pick):
        g = self.expert_groups
        return within_groups(pick, g, self.topk_groups) if g > 1 else pick

    def route_weights(self, weight):
        return weight * self.router_scale if self.router_scale != 1 else weight

    def dense(self) -> Parts:
        return Parts()  # routing is all these parts do


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


def experts(hf: dict) -> dict:
    """The mixture of experts' options: none when first_k_dense_replace leaves no MoE
    layer; sigmoid scores chosen with e_score_correction_bias within the best topk_group
    of n_group groups, their weights normed (norm_topk_prob) and scaled
    (routed_scaling_factor); n_shared_experts shared experts as one FFN. aux_loss_alpha
    and seq_aux weigh a training loss that transformers does not compute either: the
    zoo's fine-tune has none (moe_loss 0)."""
    n, k = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 3)
    require(hf, "scoring_func", ("sigmoid",), "sigmoid")
    require(hf, "topk_method", ("noaux_tc",), "noaux_tc")
    require(hf, "moe_layer_freq", (1,), 1)
    for key in ("output_router_logits", "aux_loss_alpha", "seq_aux", "ep_size"):
        hf.get(key)
    e, width = hf.get("n_routed_experts", 256), hf.get("moe_intermediate_size", 2048)
    fields = dict(
        experts=e, experts_per_token=hf.get("num_experts_per_tok", 8), expert_ff=width,
        router="sigmoid_topk_norm" if hf.get("norm_topk_prob", True) else "sigmoid_topk",
        parts=GroupRouting(
            hf.get("n_group") or 1, hf.get("topk_group") or 1,
            float(hf.get("routed_scaling_factor", 2.5)),
        ),
        shared_ff=width * (hf.get("n_shared_experts") or 0), dense_layers=k, moe_loss=0.0,
    )  # fmt: skip
    return {} if k >= n else fields


def config(hf: dict, names: set[str]) -> Config:
    check_heads(hf)
    check_mtp(hf, names)
    mla = dict(mla=latent(hf), d_kv=hf["qk_rope_head_dim"], kv_heads=0)
    return llama.decoder_config(hf, names, **mla, **experts(hf))


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


def layer_rows(cfg: Config, prefix: str) -> list[Entry]:
    """One stack's rows (paths under layers/): Llama's norms, the latent attention, and a
    dense FFN or the experts (one tensor each: experts.{e}), their router and the shared
    experts."""
    rows = [e for e in llama.table(cfg, prefix) if e.path.startswith("layers/")]
    rows = [e for e in rows if not e.path.startswith("layers/attn/")]
    if not cfg.experts:
        return rows + attention_rows(cfg, prefix)
    mlp = f"{prefix}layers.{{i}}.mlp."
    return [e for e in rows if not e.path.startswith("layers/ffn/")] + [
        *attention_rows(cfg, prefix),
        Entry("layers/ffn/gate", f"{mlp}gate.weight", "experts d_model"),
        Entry("layers/ffn/gate_bias", f"{mlp}gate.e_score_correction_bias", "experts"),
        *experts_linear("layers/ffn/wi", f"{mlp}experts.{{e}}.gate_proj", "d_ff", "d_model"),
        *experts_linear("layers/ffn/wg", f"{mlp}experts.{{e}}.up_proj", "d_ff", "d_model"),
        *experts_linear("layers/ffn/wo", f"{mlp}experts.{{e}}.down_proj", "d_model", "d_ff"),
        *linear("layers/ffn/shared/wi", f"{mlp}shared_experts.gate_proj", "d_ff", "d_model", False),
        *linear("layers/ffn/shared/wg", f"{mlp}shared_experts.up_proj", "d_ff", "d_model", False),
        *linear("layers/ffn/shared/wo", f"{mlp}shared_experts.down_proj", "d_model", "d_ff", False),
    ]


def table(cfg: Config, prefix: str) -> list[Entry]:
    """The embeddings and final norm, then the dense stack's layers (`dense/`: the first
    dense_layers) and the mixture-of-experts stack's (`layers/`, its layer 0 the file's
    layer dense_layers)."""
    rows = [e for e in llama.table(cfg, prefix) if not e.path.startswith("layers/")]
    if not (k := cfg.dense_layers):
        return rows + layer_rows(cfg, prefix)
    dense = [e._replace(path="dense/" + e.path.removeprefix("layers/"))
             for e in layer_rows(dense_config(cfg), prefix)]  # fmt: skip
    return rows + dense + [e._replace(first=k) for e in layer_rows(cfg, prefix)]


# DeepseekV3Config's: the best 4 of 8 groups, one shared expert, q of rank 1536
DEFAULTS = llama.DEFAULTS | dict(
    max_position_embeddings=4096, q_lora_rank=1536, rope_interleave=True,
    first_k_dense_replace=3, n_group=8, topk_group=4, n_shared_experts=1, num_experts_per_tok=8,
    norm_topk_prob=True, routed_scaling_factor=2.5, output_router_logits=False,
)  # fmt: skip
FAMILY = llama.FAMILY._replace(
    name="deepseek_v3", config=config, table=table, heads="DeepseekV3ForCausalLM",
    defaults=DEFAULTS,
)  # fmt: skip

# The canonical checkpoint's config.json keys (models.catalog.configs names it): those of
# transformers' DeepseekV3Config (the file's scoring_func "sigmoid", topk_method "noaux_tc"
# and moe_layer_freq 1 are its defaults; its quantization_config, FP8 weights, is not)
NAMED = {
    "deepseek-v3": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
        topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
        hidden_act="silu", max_position_embeddings=163840, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_theta=10000.0, attention_bias=False,
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                      "type": "yarn"},
        num_nextn_predict_layers=1,
    ),
}  # fmt: skip
