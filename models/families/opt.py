"""OPT (OPTForCausalLM): learned positions whose table has 2 rows before position 0
(position p reads row p + 2), ReLU, LayerNorms, biases (enable_bias), pre-norm or,
with do_layer_norm_before false, post-norm without a final norm, tied embeddings;
opt-350m's narrower embeddings (word_embed_proj_dim: project_in, project_out)."""

from __future__ import annotations

from dataclasses import dataclass

from models.architecture import Config, ConfigError
from models.families.common import Entry, Family, act, linear, norm, require
from models.parts import Parts

OFFSET = 2  # OPTLearnedPositionalEmbedding's offset


@dataclass(frozen=True)
class OffsetPositions(Parts):
    """OPT's learned positions: position p reads row p + position_offset of the table,
    which has that many rows more, before position 0 (models.parts.Parts.positions)."""

    position_offset: int = OFFSET

    def __post_init__(self):
        n = self.position_offset
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"Config.position_offset={n!r} must be an int >= 0")


def config(hf: dict, names: set[str]) -> Config:
    require(hf, "_remove_final_layer_norm", (False,), False)
    require(hf, "layer_norm_elementwise_affine", (True,), True)
    hf.get("dropout"), hf.get("activation_dropout"), hf.get("layerdrop"), hf.get("init_std")
    d, h, n = hf["hidden_size"], hf["num_attention_heads"], hf["max_position_embeddings"]
    e = hf.get("word_embed_proj_dim") or d  # opt-350m: 512 wide embeddings, d_model 1024
    return Config(
        vocab=hf["vocab_size"], d_model=d, heads=h, d_kv=d // h, d_ff=hf["ffn_dim"],
        layers=hf["num_hidden_layers"], length=n, max_positions=n, parts=OffsetPositions(),
        ffn=act(hf, "activation_function"), norm_eps=1e-5, bias=hf.get("enable_bias", True),
        block="pre" if hf.get("do_layer_norm_before", True) else "post",
        shared_embedding=bool(hf.get("tie_word_embeddings", True)), scale_tied_logits=False,
        embed_dim=e if e != d else 0,
    )  # fmt: skip


def table(cfg: Config, prefix: str) -> list[Entry]:
    layer, b = f"{prefix}layers.{{i}}.", cfg.bias
    a = f"{layer}self_attn."
    width = "d_embed" if cfg.embed_dim else "d_model"
    rows = [
        Entry("embed", f"{prefix}embed_tokens.weight", f"vocab {width}"),
        Entry("pos", f"{prefix}embed_positions.weight", "length d_model"),
        *norm("layers/attn_norm", f"{layer}self_attn_layer_norm", True),
        *norm("layers/ffn_norm", f"{layer}final_layer_norm", True),
        *linear("layers/attn/q", f"{a}q_proj", "Q d_kv", "d_model", b),
        *linear("layers/attn/k", f"{a}k_proj", "KV d_kv", "d_model", b),
        *linear("layers/attn/v", f"{a}v_proj", "KV d_kv", "d_model", b),
        *linear("layers/attn/o", f"{a}out_proj", "d_model", "Q d_kv", b),
        *linear("layers/ffn/wi", f"{layer}fc1", "d_ff", "d_model", b),
        *linear("layers/ffn/wo", f"{layer}fc2", "d_model", "d_ff", b),
    ]
    if cfg.block == "pre":
        rows += norm("final_norm", f"{prefix}final_layer_norm", True)
    if cfg.embed_dim:  # torch Linear weights: (out, in)
        rows.append(Entry("project_in", f"{prefix}project_in.weight", "d_model d_embed"))
        rows.append(Entry("project_out", f"{prefix}project_out.weight", "d_embed d_model"))
    untied = [Entry("softmax", "lm_head.weight", f"vocab {width}")]
    return rows + ([] if cfg.shared_embedding else untied)


FAMILY = Family(
    "opt", config, table, "lm", ("model.decoder.", "decoder."), "embed_tokens.weight",
    "OPTForCausalLM",  # a tied lm_head.weight: read if the embedding again (hub._tied_head)
    defaults=dict(  # OPTConfig's: ReLU, pre-norm, biases, tied
        activation_function="relu", do_layer_norm_before=True, enable_bias=True,
        tie_word_embeddings=True, _remove_final_layer_norm=False,
        layer_norm_elementwise_affine=True,
    ),
)  # fmt: skip

# The canonical checkpoints' config.json keys (models.catalog.configs names them)
NAMED = {
    "opt-125m": dict(  # OPTConfig's defaults
        vocab_size=50272, hidden_size=768, ffn_dim=3072, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=2048, word_embed_proj_dim=768,
        do_layer_norm_before=True, activation_function="relu", enable_bias=True,
    ),
}  # fmt: skip
