"""Transformer building blocks on named dims, written only in the namedmesh language.

Each block is a function of Tensors and a dict of parameter Tensors; parameters are
declared as `Param(sizes, init)` so a model's shapes exist before (or without) its
values. Activations have dims batch, length (queries), memory (attended positions),
d_model, heads, d_kv, d_ff, vocab: a layout maps any of them to mesh axes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

import namedmesh as nm
from models.attention import blockwise_attend, ring_attend
from models.config import Config

NEG = -1e9  # the attention logit of a masked position
DTYPES = ("float32", "bfloat16")


def compute_dtype(cfg: Config) -> np.dtype:
    """The dtype of cfg's matmuls and activations (parameters and statistics stay float32)."""
    if cfg.dtype not in DTYPES:
        raise nm.DtypeError(f"config dtype must be one of {DTYPES}, got {cfg.dtype!r}")
    return np.dtype(cfg.dtype)


def cast(params, dtype: np.dtype):
    """The floating Tensors of a (nested dict of) parameters converted to `dtype`; the
    conversion's transpose brings their gradients back in their own dtype."""
    if isinstance(params, dict):
        return {k: cast(v, dtype) for k, v in params.items()}
    floating = np.issubdtype(params.dtype, np.floating) or params.dtype == np.dtype("bfloat16")
    return nm.astype(params, dtype) if floating and params.dtype != dtype else params


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
    """LayerNorm (mean and variance over d_model, then scale and bias) or RMSNorm. The
    statistics are float32 whatever x's dtype; the result has x's dtype."""
    dtype = x.dtype
    x = nm.astype(x, np.float32) if dtype != np.float32 else x
    if kind == "rms":
        y = x * nm.rsqrt(nm.mean(x * x, "d_model") + eps)
    else:
        centered = x - nm.mean(x, "d_model")
        y = centered * nm.rsqrt(nm.mean(centered * centered, "d_model") + eps)
    y = nm.astype(y, dtype) if dtype != np.float32 else y
    return y * p["scale"] if kind == "rms" else y * p["scale"] + p["bias"]


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
    bias_fn=None,
):
    """Multi-head attention of x (batch, length, d_model) over `memory` (batch, memory,
    d_model; x itself when None), plus `bias` (any of batch, heads, length, memory) and
    `bias_fn(queries, slots)`, the bias for query and memory positions (int Tensors
    over length and memory).

    With `cache` ({"k", "v"}: batch, memory, heads, d_kv), x holds one new position at
    index `position` (an int Tensor): its keys and values are written into the cache
    there, attention runs over the whole cache, and `(out, new_cache)` is returned."""
    q = nm.einsum(x, p["q"], out=("batch", "length", "heads", "d_kv"))
    src = x.rename(length="memory") if memory is None else memory
    k = nm.einsum(src, p["k"], out=("batch", "memory", "heads", "d_kv"))
    v = nm.einsum(src, p["v"], out=("batch", "memory", "heads", "d_kv"))
    if cache is not None:
        slots = cache["k"].size_of("memory")
        at = nm.one_hot(position, "memory", slots, k.dtype)  # write position: 1 there
        k = cache["k"] * (1.0 - at) + at * k.sum("memory")
        v = cache["v"] * (1.0 - at) + at * v.sum("memory")
        cache = {"k": k, "v": v}
    scale = cfg.d_kv**-0.5
    if cfg.attention == "blockwise":
        o = blockwise_attend(q, k, v, bias, scale, cfg.attention_block, bias_fn)
    elif cfg.attention == "ring":
        ring = k.size_of("memory") // min(cfg.attention_block, k.size_of("memory"))
        o = ring_attend(q, k, v, bias, scale, ring, bias_fn)
    elif cfg.attention == "full":
        slots = nm.arange("memory", k.size_of("memory"))
        more = None if bias_fn is None else bias_fn(nm.arange("length", q.size_of("length")), slots)
        if more is not None:
            bias = more if bias is None else bias + more
        o = attend(q, k, v, bias, scale)
    else:
        raise ValueError(f"attention must be full, blockwise or ring, got {cfg.attention!r}")
    out = nm.einsum(o, p["o"], out=("batch", "length", "d_model"))
    return out if cache is None else (out, cache)


def attend(q: nm.Tensor, k: nm.Tensor, v: nm.Tensor, bias=None, scale: float = 1.0):
    """softmax over memory of scale * q.k + bias, times v: q (..., length, d_kv), k and v
    (..., memory, d_kv), other dims matched by name; the logits and softmax in float32,
    the result (q's dims) in v's dtype."""
    logits = nm.einsum(q, k, out=_logit_dims(q, k), preferred_element_type=np.float32) * scale
    if bias is not None:
        logits = logits + bias
    weights = nm.astype(nm.softmax(logits, "memory"), v.dtype)
    return nm.einsum(weights, v, out=q.dims)


def _logit_dims(q: nm.Tensor, k: nm.Tensor) -> tuple[str, ...]:
    batch = tuple(d for d in q.dims if d in k.dims and d != "d_kv")
    return batch + ("length", "memory")


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
    logits = nm.astype(logits, np.float32) if logits.dtype != np.float32 else logits
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
