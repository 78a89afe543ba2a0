"""A mixture-of-experts FFN with top-2 gating (GShard, and Mesh-TensorFlow's `moe.py`).

`experts` is a dim like any other, so expert parallelism is the layout rule
`experts:<axis>`. Each batch row is a group: its `length` tokens fill each expert's
`expert_capacity` slots in order, first choices before second choices; a token past
an expert's capacity skips that expert (the residual still carries it).
"""

from __future__ import annotations

import math

import numpy as np

import namedmesh as nm
from models.config import Config, ConfigError
from models.layers import Param, activation


def moe_params(cfg: Config) -> dict:
    d, f, e = cfg.d_model, cfg.d_ff, cfg.experts
    if cfg.ffn not in ("relu", "gelu"):
        raise ConfigError(f"the MoE FFN (experts > 0) takes ffn relu or gelu, got {cfg.ffn!r}")
    return {
        "gate": Param({"d_model": d, "experts": e}, d**-0.5),
        "wi": Param({"experts": e, "d_model": d, "d_ff": f}, d**-0.5),
        "wo": Param({"experts": e, "d_ff": f, "d_model": d}, f**-0.5),
    }


def capacity(cfg: Config, group: int) -> int:
    """Slots per expert for a group of `group` tokens, each sent to two experts."""
    return min(group, math.ceil(2 * cfg.capacity_factor * group / cfg.experts))


def _slots(chosen: nm.Tensor, before: nm.Tensor | float, c: int) -> tuple[nm.Tensor, nm.Tensor]:
    """(kept, slot): `chosen` (0/1 over experts) where the token's place in its expert's
    queue, after `before` tokens already there, is below capacity `c`; and the one-hot
    of that place over expert_capacity."""
    place = nm.cumsum(chosen, "length") - 1.0 + before
    kept = chosen * nm.astype(place < c, np.float32)
    slot = nm.one_hot(nm.astype(place * kept, np.int32), "expert_capacity", c)
    return kept, slot


def gating(probs: nm.Tensor, c: int) -> tuple[nm.Tensor, nm.Tensor, nm.Tensor]:
    """(combine, dispatch, aux) from gate probabilities (batch, length, experts):
    combine (batch, length, experts, expert_capacity) holds each token's normalised
    gate weight at its slot, dispatch is its 0/1 pattern, aux is the load-balancing
    loss (1 when tokens and probability spread evenly over the experts)."""
    e = probs.size_of("experts")
    first = nm.one_hot(nm.argmax(probs, "experts"), "experts", e)
    second = nm.one_hot(nm.argmax(probs * (1.0 - first), "experts"), "experts", e)
    aux = nm.mean(nm.mean(first, "length") * nm.mean(probs, "length")) * float(e * e)
    kept1, slot1 = _slots(first, 0.0, c)
    kept2, slot2 = _slots(second, kept1.sum("length"), c)
    g1, g2 = (probs * first).sum("experts"), (probs * second).sum("experts")
    total = g1 + g2
    d1, d2 = kept1 * slot1, kept2 * slot2
    combine = d1 * (g1 / total) + d2 * (g2 / total)
    return combine, d1 + d2, aux


def moe(x: nm.Tensor, p: dict, cfg: Config) -> tuple[nm.Tensor, nm.Tensor]:
    """(out, aux) for x (batch, length, d_model): each token's output is the gated sum
    of its top-2 experts' FFNs; aux is the load-balancing loss of this layer."""
    c = capacity(cfg, x.size_of("length"))
    gate = nm.einsum(
        x, p["gate"], out=("batch", "length", "experts"), preferred_element_type=np.float32
    )
    combine, dispatch, aux = gating(nm.softmax(gate, "experts"), c)  # float32 statistics
    if x.dtype != np.float32:  # the routing tensors take the activations' dtype
        combine, dispatch = nm.astype(combine, x.dtype), nm.astype(dispatch, x.dtype)
    slots = ("batch", "experts", "expert_capacity")
    expert_in = nm.einsum(dispatch, x, out=slots + ("d_model",))
    h = activation(cfg.ffn)[0](nm.einsum(expert_in, p["wi"], out=slots + ("d_ff",)))
    expert_out = nm.einsum(h, p["wo"], out=slots + ("d_model",))
    return nm.einsum(combine, expert_out, out=("batch", "length", "d_model")), aux
