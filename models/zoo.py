"""The models by name: each is its parameter shapes and its loss, both of a Config."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from models import transformer
from models.architecture import Config


class Model(NamedTuple):
    """`shapes(cfg)`: nested dict of Params; `loss(params, batch, cfg, key)`: a 0-d
    Tensor; `objective`: how batches are made from text (models/training/objectives.py);
    `defaults`: config fields this model sets where the config leaves them 0;
    `logits(params, batch, cfg)`: its logits for a batch of inputs, weights (padding),
    token_types and the fields of `needs` (what models.io.hub passes a loaded model)."""

    shapes: Callable
    loss: Callable
    objective: str
    defaults: dict = {}
    logits: Callable = transformer.batch_logits
    needs: tuple[str, ...] = ()

    def configure(self, cfg: Config) -> Config:
        return cfg.replace(**{k: v for k, v in self.defaults.items() if not getattr(cfg, k)})


MODELS: dict[str, Model] = {
    "lm": Model(transformer.lm_shapes, transformer.lm_loss, "lm"),
    "moe": Model(transformer.lm_shapes, transformer.lm_loss, "lm", {"experts": 4}),
    "bert": Model(
        transformer.lm_shapes, transformer.mlm_loss, "mlm", logits=transformer.mlm_batch_logits
    ),
    "encdec": Model(
        transformer.encdec_shapes,
        transformer.encdec_loss,
        "span",
        logits=transformer.encdec_batch_logits,
        needs=("decoder_inputs",),
    ),
}


def get(name: str) -> Model:
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]
