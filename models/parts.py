"""A family's own parts: what one family's model does that the shared forward pass
does not ask about. `Config.parts` holds one `Parts` record; the shared pass calls its
hooks at fixed points (the token embeddings, the learned positions, the embeddings'
extras, the attention's scale and soft-cap, each sublayer's residual branch, the
logits) and never asks which family it serves.

`Parts` itself is the plain model's (the zoo's, Llama's...): every hook leaves its
value as the shared pass made it. A family module subclasses it as a frozen dataclass
whose fields are the options only that family has (Gemma 2's soft-caps, OPT's
position offset, BERT's token types, Granite's multipliers) and overrides the hooks
it needs; the subclass registers itself (`KINDS`), so a moved option's old spelling
(`Config(logit_softcap=30.0)`, `--set logit_softcap=30`, a run.json's) still finds
its family's parts (models.architecture routes it)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import ClassVar

import namedmesh as nm

# Parts subclasses by name, each registered when its family module is imported
KINDS: dict[str, type] = {}


@dataclass(frozen=True)
class Parts:
    """The plain parts. `attention_softcap` (> 0: attention logits -> cap * tanh(logits
    / cap)) and `position_offset` (learned positions: position p reads row p + offset)
    are values the shared pass reads; a subclass may make them fields."""

    attention_softcap: ClassVar[float] = 0.0
    position_offset: ClassVar[int] = 0
    ropes: ClassVar[tuple] = ()  # the Ropes the family rotates by besides Config.rope

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        KINDS[cls.__name__] = cls

    def attention_factor(self, plain: float) -> float:
        """The attention logits' factor, given the plain one (Config.attention_factor's
        d_kv**-0.5, attention_scale_dim's, or T5's 1)."""
        return plain

    def embedding_shapes(self, cfg) -> dict:
        """The family's own parameters of the embedding side (models.layers.common.Param)."""
        return {}

    def embed(self, x: nm.Tensor) -> nm.Tensor:
        """The token embeddings (batch, length, d_model), before positions are added."""
        return x

    def positions(self, table: nm.Tensor, tokens: nm.Tensor, at=None) -> nm.Tensor:
        """The learned position embeddings to add to the tokens': `table` (length, d_model)
        read at rows at + position_offset (`at`: ints like tokens, 0-d or over batch), or
        0..n-1 + position_offset of n tokens when `at` is None."""
        if at is not None:
            return nm.gather(table.rename(length="memory"), "memory", at + self.position_offset)
        n, first = tokens.size_of("length"), self.position_offset
        whole = first == 0 and n == table.size_of("length")
        return table if whole else nm.slice(table, "length", first, first + n)

    def embed_extras(self, params: dict, x: nm.Tensor, token_types=None) -> nm.Tensor:
        """The embeddings after positions, before their norm (BERT adds token types)."""
        return x

    def check(self, cfg) -> None:
        """ConfigError where these parts contradict the rest of `cfg` (Config calls it)."""

    def layer_constants(self, cfg, seq_len: int) -> dict:
        """What differs between the layers of a stack (models.layers.common.layer_constants,
        where cfg.sliding_layers) besides their windows: {name: Tensor over layers}."""
        return {}

    def shared_expert_shapes(self, cfg) -> dict:
        """The family's own parameters of a mixture's shared experts (cfg.d_ff: their
        width), beside their FFN's."""
        return {}

    def shared_expert(self, x: nm.Tensor, p: dict, y: nm.Tensor) -> nm.Tensor:
        """The shared experts' output `y` of input `x` (their parameters `p`)."""
        return y

    def route_pick(self, pick: nm.Tensor) -> nm.Tensor:
        """A mixture's router scores (.., experts) that its top-k chooses from."""
        return pick

    def route_weights(self, weight: nm.Tensor) -> nm.Tensor:
        """A mixture's weights of the chosen experts (.., choices)."""
        return weight

    def dense(self) -> Parts:
        """The parts of the dense stack before a mixture's layers (transformer.
        dense_config): these, less what only routing reads."""
        return self

    def residual(self, y: nm.Tensor) -> nm.Tensor:
        """A sublayer's output as it joins the residual stream."""
        return y

    def logits(self, logits: nm.Tensor) -> nm.Tensor:
        """The final logits (float32, over vocab)."""
        return logits

    def replace(self, **changes) -> Parts:
        return dataclasses.replace(self, **changes)


def field_types() -> dict[str, tuple[type, type]]:
    """Every registered family's option -> (its Parts subclass, the option's type)."""
    out = {}
    for cls in KINDS.values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, (cls, hints[f.name]))
    return out


def with_options(parts: Parts, options: dict) -> Parts:
    """`parts` with `options` (names of fields of a family's parts) set: on these parts
    where they have the fields, else on the plain parts' first registered family kind
    that has them all. KeyError naming an option no registered parts have, ValueError
    where `parts` are a family's that lacks it."""
    if not options:
        return parts
    names = {f.name for f in dataclasses.fields(parts)}
    if set(options) <= names:
        return parts.replace(**options)
    known = field_types()
    if missing := [n for n in options if n not in known]:
        raise KeyError(missing[0])
    if type(parts) is not Parts:
        stray = sorted(set(options) - names)
        owner = known[stray[0]][0]
        raise ValueError(
            f"{stray} are options of {owner.__name__} ({owner.__module__}'s parts), not of "
            f"this config's {type(parts).__name__} ({type(parts).__module__})"
        )
    kinds = [c for c in KINDS.values() if set(options) <= {f.name for f in dataclasses.fields(c)}]
    if not kinds:
        raise ValueError(f"no family's parts have all of {sorted(options)}")
    return kinds[0](**options)
