"""The mixture-of-experts FFN: a router picks each token's top-k experts
(cfg.experts_per_token), and the token's output is their FFNs weighted by the router.

`experts` is a dim like any other, so expert parallelism is the layout rule
`experts:<axis>`. Two routings (cfg.routing; docs/models.md, "Mixture of experts"):

- dropless (the default): every choice is computed exactly, by grouped matmuls
  (`nm.grouped_ffn`: rows sorted by expert, the whole expert FFN one op), whatever the
  load.
- capacity (GShard, Mesh-TensorFlow's `moe.py`; the throughput option): each batch row
  is a group whose tokens fill each expert's `capacity` slots in position order, a
  token's choices together, so a token's slot depends only on the tokens at or before
  it (causal); a choice that finds its expert full is dropped (the residual still
  carries the token). The slots are one-hot dispatch and combine einsums.

A shared expert (cfg.shared_ff; Qwen2-MoE, DeepSeek) is an FFN every token passes,
added to the routed experts' output, as the family's parts take it (Qwen2-MoE's gate:
models/families/qwen2_moe.py).

The router's weights (cfg.router): topk_softmax, the softmax over the chosen experts'
logits (Mixtral; Qwen-MoE's `norm_topk_prob`), or softmax_topk, the softmax over all
experts' logits read at the chosen ones (Qwen-MoE without `norm_topk_prob`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

import namedmesh as nm
from models.architecture import Config, ConfigError
from models.layers.common import Param, activation, activation_name, ffn, ffn_params


def moe_params(cfg: Config) -> dict:
    """The router's gate (and its choosing bias under a sigmoid router), the experts'
    FFNs (each cfg.expert_ff wide, else d_ff), and a shared FFN (cfg.shared_ff)."""
    d, f, e = cfg.d_model, cfg.expert_ff or cfg.d_ff, cfg.experts
    if cfg.bias:
        raise ConfigError("the MoE FFN (experts > 0) has no biases: Config.bias must be False")
    p = {
        "gate": Param({"d_model": d, "experts": e}, d**-0.5),
        "wi": Param({"experts": e, "d_model": d, "d_ff": f}, d**-0.5),
        "wo": Param({"experts": e, "d_ff": f, "d_model": d}, f**-0.5),
    }
    if activation(cfg.ffn)[1]:
        p["wg"] = Param({"experts": e, "d_model": d, "d_ff": f}, d**-0.5)
    if ROUTERS[cfg.router].biased:
        p["gate_bias"] = Param({"experts": e}, "zeros")
    if cfg.shared_ff:
        shared = cfg.replace(d_ff=cfg.shared_ff)
        p["shared"] = ffn_params(shared) | cfg.parts.shared_expert_shapes(shared)
    return p


def capacity(cfg: Config, group: int | None = None) -> int:
    """Slots per expert for a group of `group` tokens (cfg.length: a training row,
    whatever the input's length, so a prefix routes as it does inside the longer
    sequence), each sent to cfg.experts_per_token experts."""
    group = cfg.length if group is None else group
    k = cfg.experts_per_token
    return min(group, math.ceil(k * cfg.capacity_factor * group / cfg.experts))


class Routed(NamedTuple):
    """The MoE's output (batch, length, d_model), its statistics (`stats`), and the
    experts each position chose (batch, length, experts; 0/1), which a capacity
    router's decoding cache keeps."""

    out: nm.Tensor
    stats: dict
    chosen: nm.Tensor


class Router(NamedTuple):
    """A router kind: the experts' scores of the gate's logits (over experts), whether a
    learned bias (gate_bias) is added to them for choosing only, and the chosen experts'
    weights from their scores (over choices)."""

    score: Callable
    biased: bool
    weights: Callable


_softmax = lambda gate: nm.softmax(gate, "experts")
ROUTERS = {
    "topk_softmax": Router(_softmax, False, lambda top: top / top.sum("choices")),
    "softmax_topk": Router(_softmax, False, lambda top: top),
    "sigmoid_topk": Router(nm.sigmoid, True, lambda top: top),
    "sigmoid_topk_norm": Router(nm.sigmoid, True, lambda top: top / (top.sum("choices") + 1e-20)),
}


def route(x: nm.Tensor, p: dict, cfg: Config) -> tuple[nm.Tensor, nm.Tensor, nm.Tensor]:
    """(choice (batch, length, choices) int32, weight (batch, length, choices), probs
    (batch, length, experts)) for x (batch, length, d_model): the top-k experts of the
    router's scores (plus gate_bias, for choosing only; within the best groups when
    the family's parts limit them: DeepSeek's groups), weighted by cfg.router's rule as
    the parts take the weights (DeepSeek's scale), in float32 whatever the compute dtype."""
    gate = nm.einsum(
        x, p["gate"], out=("batch", "length", "experts"), preferred_element_type=np.float32
    )
    router, k = ROUTERS[cfg.router], cfg.experts_per_token
    probs = router.score(gate)
    pick = probs + p["gate_bias"] if "gate_bias" in p else probs
    pick = cfg.parts.route_pick(pick)
    top, choice = nm.top_k(pick, "experts", k, "choices")
    if pick is not probs:  # weights are the scores, not what chose
        top = (nm.one_hot(choice, "experts", cfg.experts, np.float32) * probs).sum("experts")
    weight = router.weights(top)
    return choice, cfg.parts.route_weights(weight), probs


def within_groups(pick: nm.Tensor, groups: int, best: int) -> nm.Tensor:
    """`pick` (.., experts) with the experts outside each token's `best` groups at -inf:
    the experts are `groups` groups in order, each ranked by the sum of its two highest
    scores (DeepSeek-V3's group-limited routing)."""
    e = pick.size_of("experts")
    grouped = nm.reshape(pick, {"groups": groups, "group_experts": e // groups}, from_="experts")
    two, _ = nm.top_k(grouped, "group_experts", 2, "two")
    _, chosen = nm.top_k(two.sum("two"), "groups", best, "best_groups")
    keep = nm.one_hot(chosen, "groups", groups, np.float32).sum("best_groups")
    masked = nm.where(keep > 0, grouped, -np.inf).transpose(*grouped.dims)
    return nm.reshape(masked, {"experts": e}, from_="groups group_experts")


def expert_ffn(x: nm.Tensor, p: dict, cfg: Config, project) -> nm.Tensor:
    """The experts' FFN (an activation, or a gated linear unit) with `project(x, w,
    out_dim)` applying each row's expert weight."""
    act, gated = activation(cfg.ffn)
    h = act(project(x, p["wi"], "d_ff"))
    if gated:
        h = h * project(x, p["wg"], "d_ff")
    return project(h, p["wo"], "d_model")


def shared_expert(x: nm.Tensor, p: dict, cfg: Config) -> nm.Tensor:
    """The shared experts' FFN of every token, as the family's parts take it (Qwen2-MoE's
    sigmoid gate: models.parts.Parts.shared_expert)."""
    return cfg.parts.shared_expert(x, p, ffn(x, p, cfg))


def dropless(x, p, cfg, choice, weight, before):
    """Every choice computed: the experts' FFN of each row's chosen expert as one op
    (`nm.grouped_ffn`, grouped matmuls: under expert parallelism its rows go to their
    experts' devices once for the whole FFN)."""
    act, gated = activation_name(cfg.ffn)
    wg = p["wg"] if gated else None
    y = nm.grouped_ffn(x, p["wi"], p["wo"], choice, wg, activation=act)
    out = nm.einsum(y, nm.astype(weight, y.dtype), out=("batch", "length", "d_model"))
    return out, None  # nothing dropped


def capacity_slots(chosen: nm.Tensor, before, c: int) -> tuple[nm.Tensor, nm.Tensor]:
    """(kept, slot): `chosen` (0/1 over experts) where the position's place in its
    expert's queue, after `before` choices already there (0, or per batch row and expert
    in decoding), is below capacity `c`; and the one-hot of that place over
    expert_capacity. The queue is in position order, so it is causal."""
    place = nm.cumsum(chosen, "length") - 1.0 + before
    kept = chosen * nm.astype(place < c, np.float32)
    slot = nm.one_hot(nm.astype(place * kept, np.int32), "expert_capacity", c)
    return kept, slot


def capacity_routed(x, p, cfg, choice, weight, before):
    """Slots by position (`capacity_slots`), one-hot dispatch and combine einsums."""
    mask = nm.one_hot(choice, "experts", cfg.experts)
    chosen = mask.sum("choices")  # a token's choices are distinct experts
    kept, slot = capacity_slots(chosen, before, capacity(cfg))
    dispatch = kept * slot
    combine = dispatch * (mask * weight).sum("choices")
    if x.dtype != np.float32:  # the routing tensors take the activations' dtype
        combine, dispatch = nm.astype(combine, x.dtype), nm.astype(dispatch, x.dtype)
    slots = ("batch", "experts", "expert_capacity")
    expert_in = nm.einsum(dispatch, x, out=slots + ("d_model",))
    project = lambda t, w, dim: nm.einsum(t, w, out=slots + (dim,))
    expert_out = expert_ffn(expert_in, p, cfg, project)
    out = nm.einsum(combine, expert_out, out=("batch", "length", "d_model"))
    return out, kept


ROUTINGS = {"dropless": dropless, "capacity": capacity_routed}


def moe(x: nm.Tensor, p: dict, cfg: Config, before=0.0, stats: bool = False) -> Routed:
    """The MoE FFN of x (batch, length, d_model) under cfg.routing. `before` (capacity
    routing's decoding: batch, experts) counts the choices of earlier positions already
    queued at each expert. The statistics hold the balancing loss, and with `stats` the
    rest (not computed otherwise: a lowered program would count their collectives)."""
    choice, weight, probs = route(x, p, cfg)
    out, kept = ROUTINGS[cfg.routing](x, p, cfg, choice, weight, before)
    if "shared" in p:  # shared experts: a dense FFN every token passes through
        out = out + shared_expert(x, p["shared"], cfg)
    chosen = nm.one_hot(choice, "experts", cfg.experts).sum("choices")
    kept = chosen if kept is None else kept
    balance = {"balance": balance_loss(choice, probs)}
    return Routed(out, balance | statistics(chosen, kept) if stats else balance, chosen)


def balance_loss(choice: nm.Tensor, probs: nm.Tensor) -> nm.Tensor:
    """GShard's load-balancing loss, per batch row: 1 when first choices and probability
    spread evenly over the experts."""
    e = probs.size_of("experts")
    first = nm.one_hot(nm.slice(choice, "choices", 0, 1).sum("choices"), "experts", e)
    return nm.mean(nm.mean(first, "length") * nm.mean(probs, "length")) * float(e * e)


def statistics(chosen: nm.Tensor, kept: nm.Tensor) -> dict:
    """The router's statistics of one layer besides its balancing loss: `load`
    (experts), the share of all choices each expert got; `dropped`, the share of choices
    capacity routing dropped (0 dropless)."""
    total = chosen.sum()
    load = chosen.sum(("batch", "length")) / total
    return {"load": load, "dropped": 1.0 - kept.sum() / total}


def over_layers(stats: dict) -> dict:
    """A stack's statistics from its layers' (over `layers`): the balancing losses
    summed (the loss adds them), the loads and drops averaged."""
    return {k: v.sum("layers") if k == "balance" else v.mean("layers") for k, v in stats.items()}


def merged(a: dict, b: dict) -> dict:
    """Two stacks' statistics (an encoder-decoder's): losses summed, the rest averaged."""
    return {k: a[k] + b[k] if k == "balance" else (a[k] + b[k]) * 0.5 for k in a}


def queued(route: nm.Tensor, position: nm.Tensor) -> nm.Tensor | float:
    """The choices (batch, experts) of the positions before `position` in a decoding
    cache's `route` (batch, memory, experts; 0/1): what capacity routing's queues hold
    before it. A prefill (position over length) starts at slot 0: nothing before."""
    if "length" in position.dims:
        return 0.0
    slots = nm.arange("memory", route.size_of("memory"))
    return (route * nm.astype(slots < position, route.dtype)).sum("memory")
