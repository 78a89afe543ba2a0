"""Model configurations by name: `tiny`, `small`, `base`, and the Mesh-TensorFlow paper's
LM1B language models `lm1b_m1` ... `lm1b_5` (tensor2tensor's `mtf_transformer_paper_lm`:
d_model 1024, d_kv 256, 6 layers, heads 8·2^k, d_ff 8192·2^k, unshared embeddings,
a 32768-token vocabulary; 0.14B to 4.90B parameters), each with the paper's mesh and
layout."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    """A Transformer's sizes and options. Dims of the named parameters and activations:
    batch, length, memory (attended positions), d_model, heads, d_kv, d_ff, vocab,
    layers, experts, expert_capacity."""

    vocab: int = 256
    d_model: int = 64
    heads: int = 4
    d_kv: int = 16
    d_ff: int = 256
    layers: int = 2
    length: int = 64  # training sequence length (and the largest position)
    batch: int = 16
    ffn: str = "gelu"  # relu | gelu | gated_gelu
    norm: str = "layer"  # layer | rms
    shared_embedding: bool = True  # the softmax reuses the input embedding
    relative_bias: int = 0  # > 0: a learned bias per head for relative distances up to it
    dropout: float = 0.0
    experts: int = 0  # > 0: mixture-of-experts FFN (top-2 gating)
    capacity_factor: float = 1.25
    moe_loss: float = 0.01  # weight of the load-balancing loss
    encoder_layers: int = 0  # encoder-decoder: layers of the encoder
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 (parameters stay float32)
    remat: str = "none"  # the layer scan's rematerialisation: none | full | dots
    attention: str = "full"  # full | blockwise (online softmax over key blocks) | ring
    attention_block: int = 128  # keys per block of blockwise attention
    mesh: tuple[tuple[str, int], ...] = (("batch", 1),)  # the paper's mesh shape
    layout: str = "batch:batch"

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)


_PAPER_LAYOUT = "batch:batch;vocab:model;d_ff:model;heads:model"
_PAPER_MESHES = {
    -1: (("batch", 32),),
    0: (("batch", 32),),
    1: (("model", 4), ("batch", 8)),
    2: (("model", 4), ("batch", 8)),
    3: (("model", 8), ("batch", 16)),
    4: (("batch", 16), ("model", 32)),
    5: (("batch", 16), ("model", 32)),
}
# Parameters (billions) that tensor2tensor reports for each size.
PAPER_PARAMS = {-1: 0.14, 0: 0.22, 1: 0.37, 2: 0.67, 3: 1.28, 4: 2.48, 5: 4.90}


def _paper_lm(k: int) -> Config:
    n = 2.0**k
    return Config(
        vocab=32768,
        d_model=1024,
        heads=int(8 * n),
        d_kv=256,
        d_ff=int(8192 * n),
        layers=6,
        length=256,
        batch=256,
        ffn="relu",
        shared_embedding=False,
        mesh=_PAPER_MESHES[k],
        layout=_PAPER_LAYOUT if k > 0 else "batch:batch",  # the smallest: data-parallel
    )


CONFIGS: dict[str, Config] = {
    "tiny": Config(),
    "small": Config(d_model=256, heads=4, d_kv=64, d_ff=1024, layers=4, length=128),
    "base": Config(d_model=512, heads=8, d_kv=64, d_ff=2048, layers=6, length=256, batch=64),
    **{f"lm1b_{'m1' if k < 0 else k}": _paper_lm(k) for k in PAPER_PARAMS},
}


def get(name: str, **changes) -> Config:
    """The config called `name`, with `changes` applied."""
    if name not in CONFIGS:
        raise KeyError(f"unknown config {name!r}; known: {', '.join(CONFIGS)}")
    return CONFIGS[name].replace(**changes)


class ConfigError(ValueError):
    """A `--set field=value` that names no Config field or whose value has the wrong type."""


def parse_overrides(items: list[str]) -> dict:
    """`["d_model=128", "ffn=relu"]` -> `{"d_model": 128, "ffn": "relu"}`, each value
    converted to its Config field's type (bool: true/false; tuples: Python literals).
    ConfigError for a malformed item, an unknown field (with the closest name) or a
    value that does not convert."""
    import ast
    import difflib
    import typing

    hints = typing.get_type_hints(Config)
    out = {}
    for item in items:
        name, eq, text = item.partition("=")
        name = name.strip()
        if not eq or not name:
            raise ConfigError(f"--set {item!r}: expected field=value, e.g. d_model=128")
        if name not in hints:
            near = difflib.get_close_matches(name, list(hints), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"--set {item!r}: Config has no field {name!r}{hint}")
        kind = hints[name]
        try:
            if kind is bool:
                if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(text)
                value = text.lower() in ("true", "1", "yes")
            elif kind in (int, float, str):
                value = kind(text)
            else:
                value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ConfigError(
                f"--set {item!r}: {text!r} is not a valid {getattr(kind, '__name__', kind)} "
                f"for Config.{name}"
            ) from None
        out[name] = value
    return out
