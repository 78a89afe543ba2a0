"""Llama 1, 2 and 3.x (LlamaForCausalLM): RMSNorm, SwiGLU, rotary positions with
the rope scalings of models/layers/rope.py (llama3, linear, dynamic, yarn, longrope), grouped-query
attention, `head_dim` apart from hidden_size / heads, tied or untied embeddings.
Mistral, Qwen2 and Qwen3 are this family plus an option each and import it."""

from __future__ import annotations

from models.architecture import Config
from models.families.common import Entry, Family, UnsupportedModelError, act, linear, norm
from models.layers.rope import Rope
from models.transformer import dense_config

# rope_parameters' keys each scaling kind reads (besides rope_type and rope_theta)
ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
        "attention_factor", "mscale", "mscale_all_dim", "truncate",
    ),
    "longrope": (
        "factor", "short_factor", "long_factor", "original_max_position_embeddings",
        "attention_factor",
    ),
}  # fmt: skip
_ROPE_FIELDS = {
    "original_max_position_embeddings": "original_positions",
    "partial_rotary_factor": "fraction",
}


def rope_of(hf: dict, partial: bool = False, defaults=None, overrides=None, aliases=None) -> Rope:
    """The Rope of config.json's rope_parameters (transformers 5) or rope_scaling
    and rope_theta (older files); a key the scaling kind does not read is refused (a
    null one is ignored), and partial_rotary_factor unless the family rotates part of
    d_kv (`partial`).
    `defaults` stand for rope keys a file lacks (GPT-NeoX's older rotary_pct);
    `overrides` are top-level values that win for the kinds that read them (Phi-3's
    original_max_position_embeddings); `aliases` rename scaling kinds (Phi-3: su, yarn
    are its longrope)."""
    given = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    params = {k: v for k, v in (defaults or {}).items() if v is not None} | given
    theta = float(params.pop("rope_theta", None) or hf.get("rope_theta", 10000.0))
    kind = params.pop("rope_type", params.pop("type", "default"))
    kind = (aliases or {}).get(kind, kind)
    if kind not in ROPE_KEYS:
        raise UnsupportedModelError(
            f"config.json: rope_type={kind!r} is not supported (supported: {sorted(ROPE_KEYS)})"
        )
    params |= {k: v for k, v in (overrides or {}).items() if k in ROPE_KEYS[kind] and v}
    if not partial and params.get("partial_rotary_factor", 1.0) == 1.0:
        params.pop("partial_rotary_factor", None)
    allowed = (*ROPE_KEYS[kind], *(("partial_rotary_factor",) if partial else ()))
    # a null key is an absent one, as transformers reads it (Llama 3.x files saved with
    # "rope_scaling": null inside rope_parameters); a valued one might change the math
    if stray := {k: v for k, v in params.items() if k not in allowed and v is not None}:
        raise UnsupportedModelError(
            f"config.json: rope option(s) {stray} are not implemented for rope_type {kind!r}"
        )
    fields = {_ROPE_FIELDS.get(k, k): v for k, v in params.items() if v is not None}
    max_pos = hf.get("max_position_embeddings", 2048)
    if kind == "dynamic":
        fields["original_positions"] = max_pos  # transformers grows the base past it
    elif kind in ("llama3", "yarn", "longrope"):
        fields.setdefault("original_positions", max_pos)
        if kind in ("yarn", "longrope") and "factor" not in fields:
            fields["factor"] = max_pos / fields["original_positions"]
    return Rope(theta, kind, **fields)


def decoder_config(hf: dict, names: set[str], **options) -> Config:
    """The Config of a Llama-shaped config.json, with a family's extra `options` (which
    may replace Llama's: a family that passes `ffn` reads its activation itself)."""
    if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
        raise UnsupportedModelError(
            f"config.json: attention_bias={hf.get('attention_bias')} with mlp_bias="
            f"{hf.get('mlp_bias')} is not supported (both or neither)"
        )
    if "ffn" not in options and act(hf, "hidden_act") != "silu":
        raise UnsupportedModelError(f"config.json: hidden_act={hf['hidden_act']!r} (Llama: silu)")
    hf.get("pretraining_tp")  # transformers 5 computes without it: so does the zoo
    rope = rope_of(hf) if "rope" not in options else options["rope"]
    h = hf["num_attention_heads"]
    fields = dict(
        vocab=hf["vocab_size"], d_model=hf["hidden_size"], heads=h,
        kv_heads=hf.get("num_key_value_heads") or h,
        d_kv=hf.get("head_dim") or hf["hidden_size"] // h, d_ff=hf["intermediate_size"],
        layers=hf["num_hidden_layers"], length=hf.get("max_position_embeddings", 2048),
        ffn="gated_silu", norm="rms", norm_eps=hf.get("rms_norm_eps", 1e-6),
        bias=hf.get("attention_bias", False), positions="rotary", rope=rope,
        shared_embedding=bool(hf.get("tie_word_embeddings", False)),
        scale_tied_logits=False,
    )  # fmt: skip
    return Config(**{**fields, **options})


def config(hf: dict, names: set[str]) -> Config:
    return decoder_config(hf, names)


def mlp_rows(cfg: Config, layer: str) -> list[Entry]:
    """The rows of Llama's MLP (gate_proj: the activation's input, up_proj, down_proj)."""
    b, m = cfg.bias, f"{layer}mlp."
    return [
        *linear("layers/ffn/wi", f"{m}gate_proj", "d_ff", "d_model", b),
        *linear("layers/ffn/wg", f"{m}up_proj", "d_ff", "d_model", b),
        *linear("layers/ffn/wo", f"{m}down_proj", "d_model", "d_ff", b),
    ]


def table(cfg: Config, prefix: str, ffn=mlp_rows) -> list[Entry]:
    """Llama's weight table; `ffn(cfg, layer)` gives the FFN's rows (a MoE family's)."""
    layer, b = f"{prefix}layers.{{i}}.", cfg.bias
    qkv = cfg.bias or cfg.qkv_bias
    a = f"{layer}self_attn."
    rows = [
        Entry("embed", f"{prefix}embed_tokens.weight", "vocab d_model"),
        *norm("final_norm", f"{prefix}norm", False),
        *norm("layers/attn_norm", f"{layer}input_layernorm", False),
        *norm("layers/ffn_norm", f"{layer}post_attention_layernorm", False),
        *linear("layers/attn/q", f"{a}q_proj", "Q d_kv", "d_model", qkv),
        *linear("layers/attn/k", f"{a}k_proj", "KV d_kv", "d_model", qkv),
        *linear("layers/attn/v", f"{a}v_proj", "KV d_kv", "d_model", qkv),
        *linear("layers/attn/o", f"{a}o_proj", "d_model", "Q d_kv", b),
        *ffn(cfg, layer),
    ]
    if cfg.qk_norm:
        rows += norm("layers/attn/q_norm", f"{a}q_norm", False, dim="d_kv")
        rows += norm("layers/attn/k_norm", f"{a}k_norm", False, dim="d_kv")
    return rows + (
        [] if cfg.shared_embedding else [Entry("softmax", "lm_head.weight", "vocab d_model")]
    )


def stacks(cfg: Config, prefix: str, ffn) -> list[Entry]:
    """`table` with a MoE family's FFN rows `ffn(cfg, layer)`; where cfg.dense_layers,
    the first layers (Llama's MLP, d_ff wide) are the dense stack's rows (`dense/...`,
    file layers 0..k-1) and the MoE stack's (`layers/...`) start at file layer k."""
    rows = table(cfg, prefix, ffn)
    if not (k := cfg.dense_layers):
        return rows
    dense = [
        e._replace(path="dense/" + e.path.removeprefix("layers/"))
        for e in table(dense_config(cfg), prefix)
        if e.path.startswith("layers/")
    ]
    return [e._replace(first=k) if e.path.startswith("layers/") else e for e in rows] + dense


# LlamaConfig's defaults of the option keys read above (common.Family.defaults)
DEFAULTS = dict(
    hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False, mlp_bias=False,
    tie_word_embeddings=False, max_position_embeddings=2048, rope_theta=10000.0,
    pretraining_tp=1,
)  # fmt: skip

FAMILY = Family(
    "llama", config, table, "lm", ("model.", ""), "embed_tokens.weight", "LlamaForCausalLM",
    ignored=(r".*rotary_emb\.inv_freq$",), tokens=("bos",),  # <s> text (SentencePiece)
    defaults=DEFAULTS,
)  # fmt: skip
