"""GPT-NeoX and Pythia (GPTNeoXForCausalLM): LayerNorms and biases everywhere, exact
GELU, a parallel residual (use_parallel_residual: attention and MLP both read the
block's input), rotary positions on the first rotary_pct of each head's dims, q, k
and v fused per head in query_key_value (each head's q, k, v rows together), and an
untied output embedding `embed_out` (outside the gpt_neox. prefix)."""

from __future__ import annotations

from models.architecture import Config
from models.families import llama
from models.families.common import Entry, Family, act, linear, norm, require


def config(hf: dict, names: set[str]) -> Config:
    require(hf, "attention_bias", (True,), True)  # the MLP's biases are there regardless
    hf.get("hidden_dropout"), hf.get("is_decoder")  # training / bookkeeping only
    # older files: rotary_pct and rotary_emb_base beside the rope keys (default 0.25)
    old = {"partial_rotary_factor": hf.get("rotary_pct", 0.25)}
    rope = llama.rope_of(hf, partial=True, defaults=old | {"rope_theta": hf.get("rotary_emb_base")})
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    return Config(
        vocab=hf["vocab_size"], d_model=d, heads=h, d_kv=d // h, d_ff=hf["intermediate_size"],
        layers=hf["num_hidden_layers"], length=hf.get("max_position_embeddings", 2048),
        ffn=act(hf, "hidden_act"), norm_eps=hf.get("layer_norm_eps", 1e-5), bias=True,
        positions="rotary", rope=rope, shared_embedding=bool(hf.get("tie_word_embeddings", False)),
        scale_tied_logits=False,
        block="parallel" if hf.get("use_parallel_residual", True) else "pre",
    )  # fmt: skip


def table(cfg: Config, prefix: str) -> list[Entry]:
    layer = f"{prefix}layers.{{i}}."
    a = f"{layer}attention."
    rows = [
        Entry("embed", f"{prefix}embed_in.weight", "vocab d_model"),
        *norm("final_norm", f"{prefix}final_layer_norm", True),
        *norm("layers/attn_norm", f"{layer}input_layernorm", True),
        *norm("layers/ffn_norm", f"{layer}post_attention_layernorm", True),
        *linear("layers/attn/o", f"{a}dense", "d_model", "Q d_kv", True),
        *linear("layers/ffn/wi", f"{layer}mlp.dense_h_to_4h", "d_ff", "d_model", True),
        *linear("layers/ffn/wo", f"{layer}mlp.dense_4h_to_h", "d_model", "d_ff", True),
    ]
    for i, x in enumerate("qkv"):  # rows (heads, 3, d_kv): each head's q, k, v together
        fused = f"{a}query_key_value"
        rows.append(Entry(f"layers/attn/{x}", f"{fused}.weight", "(Q * d_kv) d_model", (0, i, 3)))
        rows.append(Entry(f"layers/attn/{x}_bias", f"{fused}.bias", "(Q * d_kv)", (0, i, 3)))
    untied = [Entry("softmax", "embed_out.weight", "vocab d_model")]
    return rows + ([] if cfg.shared_embedding else untied)


FAMILY = Family(
    "gpt_neox", config, table, "lm", ("gpt_neox.", ""), "embed_in.weight", "GPTNeoXForCausalLM",
    # the causal-mask buffers and rotary frequencies of older files
    ignored=(r".*attention\.(masked_)?bias$", r".*rotary_emb\.inv_freq$"),
    defaults=dict(  # GPTNeoXConfig's
        hidden_act="gelu", layer_norm_eps=1e-5, use_parallel_residual=True, attention_bias=True,
        tie_word_embeddings=False, max_position_embeddings=2048,
    ),
)  # fmt: skip

# The canonical checkpoints' config.json keys (models.catalog.configs names them)
NAMED = {
    "pythia-160m": dict(
        vocab_size=50304, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=2048, rotary_pct=0.25,
        rotary_emb_base=10000, use_parallel_residual=True, layer_norm_eps=1e-5,
        hidden_act="gelu", tie_word_embeddings=False,
    ),
}  # fmt: skip
