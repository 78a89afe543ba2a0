"""The models by name: each is its parameter shapes and its loss, both of a Config."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from models import transformer


class Model(NamedTuple):
    """`shapes(cfg)`: nested dict of Params; `loss(params, batch, cfg, key)`: a 0-d
    Tensor; `objective`: how batches are made from text ("lm")."""

    shapes: Callable
    loss: Callable
    objective: str


MODELS: dict[str, Model] = {
    "lm": Model(transformer.lm_shapes, transformer.lm_loss, "lm"),
}


def get(name: str) -> Model:
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]
