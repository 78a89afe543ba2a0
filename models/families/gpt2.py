"""GPT-2 (GPT2LMHeadModel): learned positions, LayerNorm, tanh-GELU, biases, Conv1D
weights stored (in, out), q, k and v fused in one c_attn tensor, tied embeddings."""

from __future__ import annotations

from models.architecture import Config
from models.families.common import Entry, Family, act, norm, require


def config(hf: dict, names: set[str]) -> Config:
    require(hf, "scale_attn_by_inverse_layer_idx", (False,), False)
    require(hf, "reorder_and_upcast_attn", (False,), False)  # changes only rounding
    require(hf, "add_cross_attention", (False,), False)
    require(hf, "tie_word_embeddings", (True,), True)
    d, h = hf["n_embd"], hf["n_head"]
    return Config(
        vocab=hf["vocab_size"], d_model=d, heads=h, d_kv=d // h, d_ff=hf.get("n_inner") or 4 * d,
        layers=hf["n_layer"], length=hf["n_positions"], max_positions=hf["n_positions"],
        ffn=act(hf, "activation_function"), norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        bias=True, scale_tied_logits=False,
        attention_scale=hf.get("scale_attn_weights", True),
    )  # fmt: skip


def table(cfg: Config, prefix: str) -> list[Entry]:
    h = f"{prefix}h.{{i}}."
    rows = [
        Entry("embed", f"{prefix}wte.weight", "vocab d_model"),
        Entry("pos", f"{prefix}wpe.weight", "length d_model"),
        *norm("final_norm", f"{prefix}ln_f", True),
        *norm("layers/attn_norm", f"{h}ln_1", True),
        *norm("layers/ffn_norm", f"{h}ln_2", True),
        # Conv1D weights are (in, out); c_attn fuses q, k and v along out.
        Entry("layers/attn/o", f"{h}attn.c_proj.weight", "(Q d_kv) d_model"),
        Entry("layers/attn/o_bias", f"{h}attn.c_proj.bias", "d_model"),
        Entry("layers/ffn/wi", f"{h}mlp.c_fc.weight", "d_model d_ff"),
        Entry("layers/ffn/wi_bias", f"{h}mlp.c_fc.bias", "d_ff"),
        Entry("layers/ffn/wo", f"{h}mlp.c_proj.weight", "d_ff d_model"),
        Entry("layers/ffn/wo_bias", f"{h}mlp.c_proj.bias", "d_model"),
    ]
    for i, x in enumerate("qkv"):
        rows.append(
            Entry(f"layers/attn/{x}", f"{h}attn.c_attn.weight", "d_model (Q d_kv)", (1, i, 3))
        )
        rows.append(Entry(f"layers/attn/{x}_bias", f"{h}attn.c_attn.bias", "(Q d_kv)", (0, i, 3)))
    return rows


FAMILY = Family(
    "gpt2", config, table, "lm", ("transformer.", ""), "wte.weight", "GPT2LMHeadModel",
    # the causal-mask buffers of older files (an lm_head.weight is read as the tied
    # embedding if it equals it, else refused: hub._tied_head)
    ignored=(r".*attn\.(masked_)?bias$",),
    defaults=dict(  # GPT2Config's: the tanh GELU
        activation_function="gelu_new", layer_norm_epsilon=1e-5, scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
        add_cross_attention=False, tie_word_embeddings=True,
    ),
)  # fmt: skip
