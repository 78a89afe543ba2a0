"""BERT (BertForMaskedLM): post-norm encoder, learned absolute positions, token-type
embeddings, exact GELU, the masked-LM head (dense, activation, LayerNorm, vocab bias)
over the tied embedding; padding masks over the keys."""

from __future__ import annotations

from models.config import Config
from models.families.common import Entry, Family, act, linear, norm, require


def config(hf: dict, names: set[str]) -> Config:
    require(hf, "position_embedding_type", ("absolute",), "absolute")
    require(hf, "is_decoder", (False,), False)
    require(hf, "add_cross_attention", (False,), False)
    require(hf, "tie_word_embeddings", (True,), True)
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    return Config(
        vocab=hf["vocab_size"], d_model=d, heads=h, d_kv=d // h, d_ff=hf["intermediate_size"],
        layers=hf["num_hidden_layers"], length=hf["max_position_embeddings"],
        max_positions=hf["max_position_embeddings"], ffn=act(hf, "hidden_act"),
        norm_eps=hf.get("layer_norm_eps", 1e-12), norm_position="post", bias=True,
        scale_tied_logits=False, type_vocab=hf.get("type_vocab_size", 2), embed_norm=True,
        mlm_head=True,
    )  # fmt: skip


def table(cfg: Config, prefix: str) -> list[Entry]:
    e, layer = f"{prefix}embeddings.", f"{prefix}encoder.layer.{{i}}."
    return [
        Entry("embed", f"{e}word_embeddings.weight", "vocab d_model"),
        Entry("pos", f"{e}position_embeddings.weight", "length d_model"),
        Entry("type_embed", f"{e}token_type_embeddings.weight", "token_types d_model"),
        *norm("embed_norm", f"{e}LayerNorm", True),
        *linear("layers/attn/q", f"{layer}attention.self.query", "Q d_kv", "d_model", True),
        *linear("layers/attn/k", f"{layer}attention.self.key", "KV d_kv", "d_model", True),
        *linear("layers/attn/v", f"{layer}attention.self.value", "KV d_kv", "d_model", True),
        *linear("layers/attn/o", f"{layer}attention.output.dense", "d_model", "Q d_kv", True),
        *norm("layers/attn_norm", f"{layer}attention.output.LayerNorm", True),
        *linear("layers/ffn/wi", f"{layer}intermediate.dense", "d_ff", "d_model", True),
        *linear("layers/ffn/wo", f"{layer}output.dense", "d_model", "d_ff", True),
        *norm("layers/ffn_norm", f"{layer}output.LayerNorm", True),
        *linear("mlm/dense", "cls.predictions.transform.dense", "d_model_out", "d_model", False),
        Entry("mlm/dense_bias", "cls.predictions.transform.dense.bias", "d_model"),
        *norm("mlm/norm", "cls.predictions.transform.LayerNorm", True),
        Entry("mlm/vocab_bias", "cls.predictions.bias", "vocab"),
    ]


FAMILY = Family(
    "bert", config, table, "bert", ("bert.",), "embeddings.word_embeddings.weight",
    "BertForMaskedLM",
    # position_ids is a buffer; the decoder is the tied word embedding and its bias
    ignored=(r".*embeddings\.position_ids$", r"^cls\.predictions\.decoder\.(weight|bias)$"),
)  # fmt: skip
