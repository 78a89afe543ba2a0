"""The decoder-only Transformer language model: shapes, initial values, logits, loss.

Layers are stacked along a `layers` dim and run with `nm.scan`, so the traced program
(and the compile time) does not grow with depth. Pre-norm residual blocks:
h += attention(norm(h)); h += ffn(norm(h)).
"""

from __future__ import annotations

import jax
import numpy as np

import namedmesh as nm
from models.config import Config
from models.layers import (
    Param,
    attention,
    attention_params,
    causal_bias,
    cross_entropy,
    dropout,
    embed,
    ffn,
    ffn_params,
    norm,
    norm_params,
    relative_bias,
)


def stacked(shapes, n: int):
    """`shapes` with a leading `layers` dim of size n on every Param."""
    if isinstance(shapes, Param):
        return Param({"layers": n, **shapes.sizes}, shapes.init)
    return {k: stacked(v, n) for k, v in shapes.items()}


def decoder_layer_shapes(cfg: Config) -> dict:
    return {
        "attn_norm": norm_params(cfg),
        "attn": attention_params(cfg),
        "ffn_norm": norm_params(cfg),
        "ffn": ffn_params(cfg),
    }


def embedding_shapes(cfg: Config) -> dict:
    d, v = cfg.d_model, cfg.vocab
    shapes = {"embed": Param({"vocab": v, "d_model": d}, 1.0), "final_norm": norm_params(cfg)}
    if not cfg.relative_bias:
        shapes["pos"] = Param({"length": cfg.length, "d_model": d}, 0.1)
    if not cfg.shared_embedding:
        shapes["softmax"] = Param({"d_model": d, "vocab": v}, d**-0.5)
    return shapes


def lm_shapes(cfg: Config) -> dict:
    """The LM's parameters as a nested dict of Params."""
    return {**embedding_shapes(cfg), "layers": stacked(decoder_layer_shapes(cfg), cfg.layers)}


def _leaves(shapes, prefix=""):
    if isinstance(shapes, Param):
        yield prefix, shapes
        return
    for k in sorted(shapes):
        yield from _leaves(shapes[k], f"{prefix}/{k}" if prefix else k)


def init(shapes, seed: int) -> dict:
    """Initial values for `shapes` (a nested dict of Params), as jax arrays: each
    parameter's values depend only on the seed and its path, never on a layout."""
    key = nm.tensor(jax.numpy.asarray(nm.random.key(seed).data), ("key",))

    def value(path, p):
        if p.init in ("ones", "zeros"):
            return nm.full(p.sizes, 1.0 if p.init == "ones" else 0.0, np.float32)
        sub = nm.random.fold_in(key, _path_hash(path))
        return nm.random.normal(sub, p.sizes) * np.float32(p.init)

    return _build(shapes, value)


def abstract(shapes) -> dict:
    """`shapes` as abstract Tensors: enough to trace, plan and report, no memory used."""
    return _build(shapes, lambda path, p: nm.abstract(p.sizes))


def _build(shapes, value, prefix=""):
    if isinstance(shapes, Param):
        t = value(prefix, shapes)
        if not isinstance(t.data, jax.Array | jax.ShapeDtypeStruct):
            t = nm.tensor(jax.numpy.asarray(t.data), t.dims)
        return t
    return {k: _build(v, value, f"{prefix}/{k}" if prefix else k) for k, v in shapes.items()}


def _path_hash(path: str) -> int:
    h = 0
    for c in path.encode():
        h = (h * 131 + c) % (2**31 - 1)
    return h


def layer_keys(key, n: int):
    """One dropout key per layer, stacked along `layers` (None without a key)."""
    if key is None:
        return None
    return nm.stack([nm.random.fold_in(key, i) for i in range(n)], "layers")


def self_attention_bias(p: dict, cfg: Config, n: int, causal: bool, extra=None):
    """The additive attention bias of one layer: causal mask, relative positions, and
    `extra` (a padding bias)."""
    bias = causal_bias(n, n) if causal else None
    if cfg.relative_bias:
        pos = nm.arange("length", n)
        rel = relative_bias(p["rel"], pos, pos.rename(length="memory"), cfg.relative_bias)
        bias = rel if bias is None else bias + rel
    if extra is not None:
        bias = extra if bias is None else bias + extra
    return bias


def decoder_layer(h, p, cfg: Config, key, causal: bool = True, extra_bias=None):
    """One pre-norm block: self-attention then FFN, each added to the residual."""
    k1, k2 = (None, None) if key is None else (nm.random.fold_in(key, 1), nm.random.fold_in(key, 2))
    bias = self_attention_bias(p["attn"], cfg, h.size_of("length"), causal, extra_bias)
    h = h + dropout(
        attention(norm(h, p["attn_norm"], cfg.norm), p["attn"], cfg, bias=bias), cfg.dropout, k1
    )
    return h + dropout(ffn(norm(h, p["ffn_norm"], cfg.norm), p["ffn"], cfg), cfg.dropout, k2)


def embed_inputs(params: dict, tokens: nm.Tensor, cfg: Config) -> nm.Tensor:
    x = embed(tokens, params["embed"])
    if "pos" in params:
        n = tokens.size_of("length")
        pos = params["pos"] if n == cfg.length else nm.slice(params["pos"], "length", 0, n)
        x = x + pos
    return x


def output_logits(params: dict, x: nm.Tensor, cfg: Config) -> nm.Tensor:
    x = norm(x, params["final_norm"], cfg.norm)
    if "softmax" in params:
        return nm.einsum(x, params["softmax"], out=x.dims[:-1] + ("vocab",))
    return nm.einsum(x, params["embed"], out=x.dims[:-1] + ("vocab",)) * cfg.d_model**-0.5


def lm_logits(params: dict, tokens: nm.Tensor, cfg: Config, key=None) -> nm.Tensor:
    """Next-token logits (batch, length, vocab) for int tokens (batch, length)."""
    x = embed_inputs(params, tokens, cfg)

    def body(h, xs):
        p, k = xs
        return decoder_layer(h, p, cfg, k), None

    x, _ = nm.scan(body, x, (params["layers"], layer_keys(key, cfg.layers)), "layers")
    return output_logits(params, x, cfg)


def lm_loss(params: dict, batch: dict, cfg: Config, key=None) -> nm.Tensor:
    """Mean next-token cross-entropy (nats) over the weighted positions of `batch`
    ({"inputs", "targets", "weights"}: batch, length)."""
    logits = lm_logits(params, batch["inputs"], cfg, key)
    return cross_entropy(logits, batch["targets"], batch["weights"])
