"""BERT (BertForMaskedLM): post-norm encoder, learned absolute positions, token-type
embeddings, exact GELU, the masked-LM head (dense, activation, LayerNorm, vocab bias)
over the tied embedding; padding masks over the keys. RoBERTa is this encoder with
its own positions and head names and imports it."""

from __future__ import annotations

from dataclasses import dataclass

import namedmesh as nm
from models.architecture import Config, ConfigError
from models.families.common import Entry, Family, act, linear, norm, require
from models.layers.common import Param
from models.parts import Parts


@dataclass(frozen=True)
class TokenTypes(Parts):
    """BERT's token-type embeddings: `type_vocab` of them (0: none; parameter
    `type_embed`), the type of each token added to its embedding (type 0 where the
    batch gives none)."""

    type_vocab: int = 2

    def __post_init__(self):
        n = self.type_vocab
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"Config.type_vocab={n!r} must be an int >= 0")

    def embedding_shapes(self, cfg) -> dict:
        if not self.type_vocab:
            return {}
        return {"type_embed": Param({"token_types": self.type_vocab, "d_model": cfg.d_model}, 0.1)}

    def embed_extras(self, params: dict, x, token_types=None):
        if not self.type_vocab:
            return x
        table = params["type_embed"]
        if token_types is None:
            return x + nm.slice(table, "token_types", 0, 1).sum("token_types")
        return x + nm.gather(table, "token_types", token_types)


# BertConfig's and RobertaConfig's defaults of the option keys encoder_config reads
ENCODER_DEFAULTS = dict(
    hidden_act="gelu", layer_norm_eps=1e-12, type_vocab_size=2, tie_word_embeddings=True,
    is_decoder=False, add_cross_attention=False,
)  # fmt: skip


def encoder_config(hf: dict, parts: Parts | None = None, **options) -> Config:
    """The Config of a BERT-shaped config.json, with a family's extra `options` and its
    `parts` (BERT's: token types)."""
    require(hf, "position_embedding_type", ("absolute",), "absolute")
    require(hf, "is_decoder", (False,), False)
    require(hf, "add_cross_attention", (False,), False)
    require(hf, "tie_word_embeddings", (True,), True)
    d, h, n = hf["hidden_size"], hf["num_attention_heads"], hf["max_position_embeddings"]
    return Config(
        vocab=hf["vocab_size"], d_model=d, heads=h, d_kv=d // h, d_ff=hf["intermediate_size"],
        layers=hf["num_hidden_layers"], length=options.pop("length", n), max_positions=n,
        ffn=act(hf, "hidden_act"), norm_eps=hf.get("layer_norm_eps", 1e-12),
        block="post", bias=True, scale_tied_logits=False,
        parts=parts or TokenTypes(hf.get("type_vocab_size", 2)), embed_norm=True,
        mlm_head=True, **options,
    )  # fmt: skip


def config(hf: dict, names: set[str]) -> Config:
    return encoder_config(hf)


def encoder_table(prefix: str) -> list[Entry]:
    """The embeddings and layers of BERT's encoder (BertModel's names)."""
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
    ]


def mlm_head(dense: str, layer_norm: str, vocab_bias: str) -> list[Entry]:
    """A masked-LM head: dense (d_model -> d_model), its norm, a bias over the vocab."""
    return [
        *linear("mlm/dense", dense, "d_model_out", "d_model", False),
        Entry("mlm/dense_bias", f"{dense}.bias", "d_model"),
        *norm("mlm/norm", layer_norm, True),
        Entry("mlm/vocab_bias", vocab_bias, "vocab"),
    ]


def table(cfg: Config, prefix: str) -> list[Entry]:
    head = "cls.predictions."
    return encoder_table(prefix) + mlm_head(
        f"{head}transform.dense", f"{head}transform.LayerNorm", f"{head}bias"
    )


FAMILY = Family(
    "bert", config, table, "bert", ("bert.",), "embeddings.word_embeddings.weight",
    "BertForMaskedLM",
    # position_ids is a buffer; the decoder is the tied word embedding and its bias
    ignored=(r".*embeddings\.position_ids$", r"^cls\.predictions\.decoder\.(weight|bias)$"),
    defaults=ENCODER_DEFAULTS,
)  # fmt: skip

# The canonical checkpoints' config.json keys (models.architecture.configs names them)
NAMED = {
    "bert-base-uncased": dict(  # BertConfig's defaults
        vocab_size=30522, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=512, type_vocab_size=2,
        hidden_act="gelu", layer_norm_eps=1e-12,
    ),
}  # fmt: skip
