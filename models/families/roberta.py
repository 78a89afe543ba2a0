"""RoBERTa (RobertaForMaskedLM): BERT's encoder whose positions skip the padding id:
a token reads position row padding_idx + (the non-pad tokens up to it), a pad token
row padding_idx (transformers' create_position_ids_from_input_ids, so left padding
and pad ids inside a row count as transformers counts them); the masked-LM head
`lm_head` (dense, exact GELU whatever hidden_act is, LayerNorm, tied decoder, bias).
Tokenizer: byte-level BPE (vocab.json + merges.txt or tokenizer.json), <s> ... </s>."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import namedmesh as nm
from models.architecture import Config, ConfigError
from models.families import bert
from models.families.common import Family, UnsupportedModelError, act


@dataclass(frozen=True)
class CountedPositions(bert.TokenTypes):
    """BERT's token types, and positions that count the tokens that are not
    `position_pad` (RoBERTa's padding_idx): a token reads row position_pad + (such
    tokens up to it), one of that id row position_pad (transformers'
    create_position_ids_from_input_ids); packed examples' own positions as given."""

    type_vocab: int = 1
    position_pad: int = 1

    def __post_init__(self):
        super().__post_init__()
        n = self.position_pad
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"Config.position_pad={n!r} must be an int >= 0")

    def positions(self, table, tokens, at=None):
        if at is not None:
            return super().positions(table, tokens, at)
        real = (tokens != self.position_pad).astype(np.int32)
        rows = nm.cumsum(real, "length") * real + self.position_pad
        return nm.gather(table.rename(length="memory"), "memory", rows)


def config(hf: dict, names: set[str]) -> Config:
    if act(hf, "hidden_act") != "gelu_exact":  # the head's GELU is fixed, the FFN's not
        raise UnsupportedModelError(
            f"config.json: hidden_act={hf['hidden_act']!r}: RoBERTa's head applies exact gelu, "
            "the zoo one activation for both (supported: 'gelu')"
        )
    pad = hf.get("pad_token_id", 1)
    # the first real token reads row pad + 1: max_position_embeddings - pad - 1 positions
    length = hf["max_position_embeddings"] - pad - 1
    types = hf.get("type_vocab_size", 2)
    return bert.encoder_config(hf, CountedPositions(types, pad), length=length)


def table(cfg: Config, prefix: str):
    return bert.encoder_table(prefix) + bert.mlm_head(
        "lm_head.dense", "lm_head.layer_norm", "lm_head.bias"
    )


FAMILY = Family(
    "roberta", config, table, "bert", ("roberta.",), "embeddings.word_embeddings.weight",
    "RobertaForMaskedLM",
    # buffers; the decoder is the tied word embedding and lm_head.bias again
    ignored=(r".*embeddings\.(position|token_type)_ids$", r"^lm_head\.decoder\.(weight|bias)$"),
    tokens=("bos", "eos"),  # <s> text </s>
    defaults=bert.ENCODER_DEFAULTS | {"pad_token_id": 1},  # RobertaConfig's
)  # fmt: skip

# The canonical checkpoints' config.json keys (models.catalog.configs names them)
NAMED = {
    "roberta-base": dict(  # RobertaConfig's defaults but its 514 positions and 1 token type
        vocab_size=50265, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=514, type_vocab_size=1,
        layer_norm_eps=1e-5, pad_token_id=1, hidden_act="gelu",
    ),
}  # fmt: skip
