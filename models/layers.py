"""Transformer building blocks on named dims, written only in the namedmesh language.

Each block is a function of Tensors and a dict of parameter Tensors; parameters are
declared as `Param(sizes, init)` so a model's shapes exist before (or without) its
values. Activations have dims batch, length (queries), memory (attended positions),
d_model, heads, d_kv, d_ff, vocab: a layout maps any of them to mesh axes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import namedmesh as nm
from models.config import Config

NEG = -1e9  # the attention logit of a masked position


class Param(NamedTuple):
    """A parameter's dims and sizes, and how it starts: "ones", "zeros", or a normal
    with this standard deviation."""

    sizes: dict
    init: str | float


# --- norms -------------------------------------------------------------------------
def norm_params(cfg: Config) -> dict:
    p = {"scale": Param({"d_model": cfg.d_model}, "ones")}
    if cfg.norm == "layer":
        p["bias"] = Param({"d_model": cfg.d_model}, "zeros")
    return p


def norm(x: nm.Tensor, p: dict, kind: str, eps: float = 1e-6) -> nm.Tensor:
    """LayerNorm (mean and variance over d_model, then scale and bias) or RMSNorm."""
    if kind == "rms":
        return x * nm.rsqrt(nm.mean(x * x, "d_model") + eps) * p["scale"]
    centered = x - nm.mean(x, "d_model")
    y = centered * nm.rsqrt(nm.mean(centered * centered, "d_model") + eps)
    return y * p["scale"] + p["bias"]


# --- attention ---------------------------------------------------------------------
def attention_params(cfg: Config) -> dict:
    d, h, k = cfg.d_model, cfg.heads, cfg.d_kv
    p = {
        "q": Param({"d_model": d, "heads": h, "d_kv": k}, d**-0.5),
        "k": Param({"d_model": d, "heads": h, "d_kv": k}, d**-0.5),
        "v": Param({"d_model": d, "heads": h, "d_kv": k}, d**-0.5),
        "o": Param({"heads": h, "d_kv": k, "d_model": d}, (h * k) ** -0.5),
    }
    if cfg.relative_bias:
        p["rel"] = Param({"heads": h, "distance": 2 * cfg.relative_bias + 1}, "zeros")
    return p


def padding_bias(memory_weights: nm.Tensor) -> nm.Tensor:
    """0 for real memory positions (weight 1), NEG for padding: dims batch, memory."""
    return (1.0 - memory_weights) * NEG


def relative_bias(rel: nm.Tensor, queries, memory, max_distance: int) -> nm.Tensor:
    """The learned bias of each head for (memory - query) position, clipped to
    +-max_distance: dims heads, length, memory. `queries` and `memory` are the
    positions (int Tensors over length and memory)."""
    distance = nm.clip(memory - queries, -max_distance, max_distance) + max_distance
    return nm.gather(rel, "distance", distance)


def attention(
    x: nm.Tensor,
    p: dict,
    cfg: Config,
    memory: nm.Tensor | None = None,
    bias=None,
    cache: dict | None = None,
    position=None,
):
    """Multi-head attention of x (batch, length, d_model) over `memory` (batch, memory,
    d_model; x itself when None), plus `bias` (any of batch, heads, length, memory).

    With `cache` ({"k", "v"}: batch, memory, heads, d_kv), x holds one new position at
    index `position` (an int Tensor): its keys and values are written into the cache
    there, attention runs over the whole cache, and `(out, new_cache)` is returned."""
    q = nm.einsum(x, p["q"], out=("batch", "length", "heads", "d_kv"))
    src = x.rename(length="memory") if memory is None else memory
    k = nm.einsum(src, p["k"], out=("batch", "memory", "heads", "d_kv"))
    v = nm.einsum(src, p["v"], out=("batch", "memory", "heads", "d_kv"))
    if cache is not None:
        slots = cache["k"].size_of("memory")
        at = nm.one_hot(position, "memory", slots)  # write position: 1 there, else 0
        k = cache["k"] * (1.0 - at) + at * k.sum("memory")
        v = cache["v"] * (1.0 - at) + at * v.sum("memory")
        cache = {"k": k, "v": v}
    logits = nm.einsum(q, k, out=("batch", "heads", "length", "memory")) * cfg.d_kv**-0.5
    if bias is not None:
        logits = logits + bias
    weights = nm.softmax(logits, "memory")
    o = nm.einsum(weights, v, out=("batch", "length", "heads", "d_kv"))
    out = nm.einsum(o, p["o"], out=("batch", "length", "d_model"))
    return out if cache is None else (out, cache)


# --- feed-forward ------------------------------------------------------------------
def ffn_params(cfg: Config) -> dict:
    d, f = cfg.d_model, cfg.d_ff
    p = {
        "wi": Param({"d_model": d, "d_ff": f}, d**-0.5),
        "wo": Param({"d_ff": f, "d_model": d}, f**-0.5),
    }
    if cfg.ffn == "gated_gelu":
        p["wg"] = Param({"d_model": d, "d_ff": f}, d**-0.5)
    return p


_ACTIVATIONS = {"relu": nm.relu, "gelu": nm.gelu, "gated_gelu": nm.gelu}


def ffn(x: nm.Tensor, p: dict, cfg: Config) -> nm.Tensor:
    """d_model -> d_ff -> d_model with ReLU, GELU, or a GELU-gated linear unit."""
    if cfg.ffn not in _ACTIVATIONS:
        raise ValueError(f"ffn must be one of {sorted(_ACTIVATIONS)}, got {cfg.ffn!r}")
    h = _ACTIVATIONS[cfg.ffn](nm.einsum(x, p["wi"], out=x.dims[:-1] + ("d_ff",)))
    if cfg.ffn == "gated_gelu":
        h = h * nm.einsum(x, p["wg"], out=x.dims[:-1] + ("d_ff",))
    return nm.einsum(h, p["wo"], out=x.dims)


# --- embeddings and loss -----------------------------------------------------------
def embed(tokens: nm.Tensor, table: nm.Tensor) -> nm.Tensor:
    """The rows of `table` (vocab, d_model) at integer `tokens`."""
    return nm.gather(table, "vocab", tokens)


def cross_entropy(logits: nm.Tensor, targets: nm.Tensor, weights: nm.Tensor) -> nm.Tensor:
    """Mean over weighted positions of -log softmax(logits)[target], as a 0-d Tensor.
    The target's log-probability is an einsum with its one-hot, so a vocab split over
    mesh axes costs one psum of per-position scalars."""
    logp = nm.log_softmax(logits, "vocab")
    picked = nm.einsum(
        logp, nm.one_hot(targets, "vocab", logits.size_of("vocab")), out=targets.dims
    )
    return -(picked * weights).sum() / nm.maximum(weights.sum(), 1.0)


def dropout(x: nm.Tensor, rate: float, key) -> nm.Tensor:
    return x if not rate or key is None else nm.dropout(x, rate, key)


def count(shapes) -> int:
    """The number of parameters in a (nested dict) of Params."""
    if isinstance(shapes, Param):
        return math.prod(shapes.sizes.values())
    return sum(count(v) for v in shapes.values())
