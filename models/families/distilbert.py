"""DistilBERT (DistilBertForMaskedLM): BERT's post-norm encoder under its own names,
no token types, LayerNorms of eps 1e-12, positions from a table (learned, or
sinusoidal when sinusoidal_pos_embds: transformers stores those in the table too,
so both read it); the masked-LM head vocab_transform, activation, vocab_layer_norm,
then vocab_projector (tied to the word embedding, with a bias).
Tokenizer: WordPiece (tokenizer.json or vocab.txt), [CLS] ... [SEP]."""

from __future__ import annotations

from models.architecture import Config
from models.families import bert
from models.families.common import Entry, Family, act, linear, norm, require

EPS = 1e-12  # transformers' DistilBERT fixes its LayerNorms' eps


def config(hf: dict, names: set[str]) -> Config:
    require(hf, "tie_word_embeddings", (True,), True)
    require(hf, "tie_weights_", (True,), True)  # older files' name for the same
    hf.get("sinusoidal_pos_embds")  # the table holds the sinusoids: read as it is
    hf.get("dropout"), hf.get("qa_dropout"), hf.get("seq_classif_dropout")  # training only
    d, h, n = hf["dim"], hf["n_heads"], hf["max_position_embeddings"]
    return Config(
        vocab=hf["vocab_size"], d_model=d, heads=h, d_kv=d // h, d_ff=hf["hidden_dim"],
        layers=hf["n_layers"], length=n, max_positions=n, ffn=act(hf, "activation"),
        norm_eps=EPS, block="post", bias=True, scale_tied_logits=False,
        embed_norm=True, mlm_head=True,
    )  # fmt: skip


def table(cfg: Config, prefix: str) -> list[Entry]:
    e, layer = f"{prefix}embeddings.", f"{prefix}transformer.layer.{{i}}."
    a = f"{layer}attention."
    return [
        Entry("embed", f"{e}word_embeddings.weight", "vocab d_model"),
        Entry("pos", f"{e}position_embeddings.weight", "length d_model"),
        *norm("embed_norm", f"{e}LayerNorm", True),
        *linear("layers/attn/q", f"{a}q_lin", "Q d_kv", "d_model", True),
        *linear("layers/attn/k", f"{a}k_lin", "KV d_kv", "d_model", True),
        *linear("layers/attn/v", f"{a}v_lin", "KV d_kv", "d_model", True),
        *linear("layers/attn/o", f"{a}out_lin", "d_model", "Q d_kv", True),
        *norm("layers/attn_norm", f"{layer}sa_layer_norm", True),
        *linear("layers/ffn/wi", f"{layer}ffn.lin1", "d_ff", "d_model", True),
        *linear("layers/ffn/wo", f"{layer}ffn.lin2", "d_model", "d_ff", True),
        *norm("layers/ffn_norm", f"{layer}output_layer_norm", True),
        *bert.mlm_head("vocab_transform", "vocab_layer_norm", "vocab_projector.bias"),
    ]


FAMILY = Family(
    "distilbert", config, table, "bert", ("distilbert.",), "embeddings.word_embeddings.weight",
    "DistilBertForMaskedLM",
    # position_ids is a buffer; vocab_projector.weight is the tied word embedding
    ignored=(r".*embeddings\.position_ids$", r"^vocab_projector\.weight$"),
    defaults=dict(activation="gelu", sinusoidal_pos_embds=False, tie_word_embeddings=True),
)  # fmt: skip

# The canonical checkpoints' config.json keys (models.catalog.configs names them)
NAMED = {
    "distilbert-base-uncased": dict(  # DistilBertConfig's defaults
        vocab_size=30522, dim=768, hidden_dim=3072, n_layers=6, n_heads=12,
        max_position_embeddings=512, activation="gelu", sinusoidal_pos_embds=False,
    ),
}  # fmt: skip
