"""IBM Granite (GraniteForCausalLM): Llama's body with four multipliers of its own, as
this module's parts (models/parts.py): the token embeddings times embedding_multiplier,
attention logits scaled by attention_multiplier (not head_dim**-0.5), each sublayer's
output times residual_multiplier as it joins the residual stream, and the logits
divided by logits_scaling."""

from __future__ import annotations

from dataclasses import dataclass

from models.architecture import Config, ConfigError
from models.families import llama
from models.parts import Parts


@dataclass(frozen=True)
class Multipliers(Parts):
    """Granite's multipliers (1.0: Llama's)."""

    embedding_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    def __post_init__(self):
        for name, value in vars(self).items():
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"Config.{name}={value!r} (Granite's) must be a number > 0")

    def attention_factor(self, plain: float) -> float:
        return self.attention_multiplier

    def embed(self, x):
        return x * self.embedding_multiplier

    def residual(self, y):
        return y * self.residual_multiplier

    def logits(self, logits):
        return logits / self.logits_scaling


def config(hf: dict, names: set[str]) -> Config:
    keys = ("embedding_multiplier", "attention_multiplier", "residual_multiplier")
    parts = Multipliers(*(float(hf.get(k, 1.0)) for k in (*keys, "logits_scaling")))
    return llama.decoder_config(hf, names, parts=parts)


# byte-level BPE (vocab.json + merges.txt) that adds no special tokens around a text
# GraniteConfig's: every multiplier 1 (Llama)
DEFAULTS = llama.DEFAULTS | dict(
    embedding_multiplier=1.0, attention_multiplier=1.0, residual_multiplier=1.0,
    logits_scaling=1.0,
)  # fmt: skip
FAMILY = llama.FAMILY._replace(
    name="granite", config=config, heads="GraniteForCausalLM", tokens=(), defaults=DEFAULTS
)
