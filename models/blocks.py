"""One Transformer block, built from parts: self-attention (multi-head, or DeepSeek's
latent: ATTENTIONS), cross-attention over an encoder, and the MLP (dense, or a mixture
of experts: MLPS), put on the residual stream by the config's composition
(models/residual.py: pre-norm, post-norm, Gemma 2's sandwich, GPT-NeoX's parallel).

Two functions, one per mode: `block` (a training or evaluation pass over whole
sequences) and `decode_block` (positions written into a KV cache: a prefill or a
decoding step). Both read a `Context`, what one layer's call needs besides its input
and parameters, alike in both modes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import namedmesh as nm
from models.architecture import Config
from models.layers import mla
from models.layers.common import (
    NEG,
    Attend,
    attention,
    attention_params,
    cached_attention,
    dropout,
    ffn,
    ffn_params,
    kv_cache,
    norm,
    norm_params,
    relative_bias,
    write_slots,
)
from models.layers.moe import moe, moe_params, queued
from models.residual import COMPOSITIONS, Sublayer


class Attention(NamedTuple):
    """A self-attention part: its parameters of a Config, the pass (models.layers.common.
    attention's signature), the cached call (models.layers.common.cached_attention's), and the
    sizes of one position's KV cache entries."""

    params: Callable
    attend: Callable
    cached: Callable
    cache: Callable


# Config.attention_variant -> its attention: multi-head, or DeepSeek's latent (models/layers/mla.py)
ATTENTIONS = {
    "mha": Attention(attention_params, attention, cached_attention, kv_cache),
    "mla": Attention(mla.params, mla.attention, mla.cached_attention, mla.cache),
}


class MLP(NamedTuple):
    """An MLP part: its parameters of a Config, and `apply(x, p, cfg, stats)` -> (out,
    the router's statistics or None)."""

    params: Callable
    apply: Callable


def _dense(x, p, cfg, stats):
    return ffn(x, p, cfg), None


def _experts(x, p, cfg, stats):
    return moe(x, p, cfg, stats=stats)[:2]


# Config.mlp_variant -> its MLP: one FFN, or a mixture of experts (models/layers/moe.py)
MLPS = {"dense": MLP(ffn_params, _dense), "moe": MLP(moe_params, _experts)}


class Context(NamedTuple):
    """What one layer's block reads besides its input and parameters: the config,
    whether attention is causal, an additive attention `bias` (padding, T5's relative
    bias, packing; any of batch, heads, length, memory), the layer's dropout `key`
    (None: no dropout), its constants where the layers of a stack differ
    (models.layers.common.layer_constants: its window and rotary frequencies), whether the
    router reports all its statistics (`stats`) or its balancing loss alone, and, over
    whole sequences, the positions that rotary attention rotates by (`position`: ints
    over batch and length, packed examples' own, each from 0; None: 0..n-1)."""

    cfg: Config
    causal: bool = True
    bias: Any = None
    key: Any = None
    layer: dict | None = None
    stats: bool = False
    position: Any = None


class Cross(NamedTuple):
    """An encoder's output for a decoder's cross-attention: `source` (batch, memory,
    d_model), or its keys and values already projected for this layer (models.layers.common.
    project_kv: decoding projects them once per encoding), and its padding bias."""

    source: Any
    bias: Any = None


def layer_shapes(cfg: Config, cross: bool = False) -> dict:
    """One block's parameters: self-attention, cross-attention over an encoder's output
    if `cross`, the MLP, and each one's norms as the composition names them."""
    shapes = {"attn": ATTENTIONS[cfg.attention_variant].params(cfg)}
    if cross:
        shapes["cross"] = attention_params(cfg.replace(relative_bias=0))
    shapes["ffn"] = MLPS[cfg.mlp_variant].params(cfg)
    for name in list(shapes):
        for suffix in COMPOSITIONS[cfg.block].norms:
            shapes[name + suffix] = norm_params(cfg)
    return shapes


def self_attention_bias(p: dict, cfg: Config, queries, memory, causal: bool, window=None):
    """The additive self-attention bias of one layer for query and memory positions (int
    Tensors over length and memory): causal mask, sliding window (a query sees the
    last `window` positions: cfg.sliding_window, or this layer's of
    `layers.layer_constants`, a 0-d Tensor), and relative positions. A function of
    positions, so every attention kernel and the KV cache apply it block by block alike."""
    bias = nm.where(memory <= queries, 0.0, NEG) if causal else None
    if cfg.sliding_window:
        size = cfg.sliding_window if window is None else window
        window = nm.where(memory > queries - size, 0.0, NEG)
        bias = window if bias is None else bias + window
    if cfg.relative_bias:
        rel = relative_bias(p["rel"], queries, memory, cfg.relative_bias)
        bias = rel if bias is None else bias + rel
    return bias


def _window(ctx: Context):
    """This layer's window (a 0-d Tensor) where the layers' windows differ, else None."""
    return None if ctx.layer is None else ctx.layer["window"]


def self_attention(x, p: dict, ctx: Context):
    """The self-attention part over whole sequences: its mask a function of positions
    (kernels build it block by block), with the mask's static shape so kernels skip the
    blocks it hides whole (a window shared by every layer: per-layer windows are traced)."""
    cfg, window = ctx.cfg, _window(ctx)
    bias_fn = lambda queries, slots: self_attention_bias(p, cfg, queries, slots, ctx.causal, window)
    shared_window = cfg.sliding_window if window is None else 0
    masks = (ctx.causal, shared_window, window is None and not cfg.relative_bias)
    how = Attend(bias_fn, ctx.layer, masks, ctx.position)
    return ATTENTIONS[cfg.attention_variant].attend(x, p, cfg, ctx.bias, how)


def cached_self_attention(x, p: dict, ctx: Context, cache: dict, position):
    """(out, the attention's new cache entries): the self-attention part of positions
    `position` written into the layer's KV cache (`cache`) and attending over it."""
    cfg, variant = ctx.cfg, ATTENTIONS[ctx.cfg.attention_variant]
    slots = nm.arange("memory", next(iter(cache.values())).size_of("memory"))
    bias = self_attention_bias(p, cfg, position, slots, ctx.causal, _window(ctx))
    if ctx.bias is not None:
        bias = ctx.bias if bias is None else bias + ctx.bias
    kv = {name: cache[name] for name in variant.cache(cfg)}
    return variant.cached(x, p, cfg, bias, Attend(layer=ctx.layer, position=position), kv)


def mlp(x, p: dict, ctx: Context):
    """(out, the router's statistics or None): the MLP part."""
    return MLPS[ctx.cfg.mlp_variant].apply(x, p, ctx.cfg, ctx.stats)


def cached_mlp(x, p: dict, ctx: Context, cache: dict, position):
    """(out, (statistics, the cache's new entries)): the MLP part of positions written
    into a cache; capacity routing queues them behind the cached positions' choices."""
    if "route" not in cache:
        out, aux = mlp(x, p, ctx)
        return out, (aux, {})
    out, aux, chosen = moe(x, p, ctx.cfg, queued(cache["route"], position))
    return out, (aux, {"route": write_slots(cache["route"], chosen, position)})


def _drop(ctx: Context, i: int) -> Callable:
    """Sublayer i's output as it joins the residual stream: as the family's parts take
    it (Granite's residual_multiplier), then its dropout (keys 1, 2, 3: attention,
    cross-attention, MLP)."""
    key = None if ctx.key is None else nm.random.fold_in(ctx.key, i)
    return lambda y: dropout(ctx.cfg.parts.residual(y), ctx.cfg.dropout, key)


def _compose(h, p: dict, ctx: Context, sublayers: list):
    cfg = ctx.cfg
    by_name = lambda x, name: norm(x, p[name], cfg.norm, cfg.norm_eps)
    return COMPOSITIONS[cfg.block].apply(h, sublayers, by_name)


def _cross(p: dict, ctx: Context, cross: Cross) -> Sublayer:
    fn = lambda x: (attention(x, p["cross"], ctx.cfg, cross.bias, source=cross.source), None)
    return Sublayer("cross", fn, _drop(ctx, 2))


def block(h, p: dict, ctx: Context, cross: Cross | None = None):
    """(h, aux) after one block over whole sequences (batch, length, d_model):
    self-attention, cross-attention over `cross` when given, then the MLP, composed as
    cfg.block says; aux is the router's statistics (models/layers/moe.py `statistics`: its
    balancing loss, and with ctx.stats the rest; None without experts)."""
    subs = [Sublayer("attn", lambda x: (self_attention(x, p["attn"], ctx), None), _drop(ctx, 1))]
    if cross is not None:
        subs.append(_cross(p, ctx, cross))
    subs.append(Sublayer("ffn", lambda x: mlp(x, p["ffn"], ctx), _drop(ctx, 3)))
    h, extras = _compose(h, p, ctx, subs)
    return h, extras["ffn"]


def decode_block(h, p: dict, ctx: Context, cache: dict, position, cross: Cross | None = None):
    """(h, aux, new cache) after one block over positions written into the layer's KV
    cache (`cache`: models.inference.decoding.init_cache's entries of one layer): h holds the new
    position `position` (an int Tensor, 0-d or one per batch row) or a prefill's
    positions 0..n-1 (`position` over length)."""
    attend = lambda x: cached_self_attention(x, p["attn"], ctx, cache, position)
    subs = [Sublayer("attn", attend, _drop(ctx, 1))]
    if cross is not None:
        subs.append(_cross(p, ctx, cross))
    ffn_part = lambda x: cached_mlp(x, p["ffn"], ctx, cache, position)
    subs.append(Sublayer("ffn", ffn_part, _drop(ctx, 3)))
    h, extras = _compose(h, p, ctx, subs)
    aux, route = extras["ffn"]
    return h, aux, {**cache, **extras["attn"], **route}
