"""The Transformers: decoder-only LM, BERT-style encoder, encoder-decoder; their
shapes, initial values, logits and losses.

Layers are stacked along a `layers` dim and run with `nm.scan`, so the traced program
(and the compile time) does not grow with depth. Pre-norm residual blocks:
h += attention(norm(h)); [h += cross_attention(norm(h), encoder)]; h += ffn(norm(h)),
where the FFN is a top-2 mixture of experts when the config has experts.
"""

from __future__ import annotations

import jax
import numpy as np

import namedmesh as nm
from models.config import Config
from models.layers import (
    NEG,
    Param,
    attention,
    attention_params,
    cast,
    compute_dtype,
    cross_entropy,
    dropout,
    embed,
    ffn,
    ffn_params,
    norm,
    norm_params,
    padding_bias,
    relative_bias,
)
from models.moe import moe, moe_params


def stacked(shapes, n: int):
    """`shapes` with a leading `layers` dim of size n on every Param."""
    if isinstance(shapes, Param):
        return Param({"layers": n, **shapes.sizes}, shapes.init)
    return {k: stacked(v, n) for k, v in shapes.items()}


def layer_shapes(cfg: Config, cross: bool = False) -> dict:
    """One block: self-attention, cross-attention over an encoder's output if `cross`,
    and the FFN (a mixture of experts when cfg.experts > 0)."""
    shapes = {"attn_norm": norm_params(cfg), "attn": attention_params(cfg)}
    if cross:
        shapes["cross_norm"] = norm_params(cfg)
        shapes["cross"] = attention_params(cfg.replace(relative_bias=0))
    shapes["ffn_norm"] = norm_params(cfg)
    shapes["ffn"] = moe_params(cfg) if cfg.experts else ffn_params(cfg)
    return shapes


def embedding_shapes(cfg: Config) -> dict:
    d, v = cfg.d_model, cfg.vocab
    shapes = {"embed": Param({"vocab": v, "d_model": d}, 1.0), "final_norm": norm_params(cfg)}
    if not cfg.relative_bias:
        shapes["pos"] = Param({"length": cfg.length, "d_model": d}, 0.1)
    if not cfg.shared_embedding:
        shapes["softmax"] = Param({"d_model": d, "vocab": v}, d**-0.5)
    return shapes


def lm_shapes(cfg: Config) -> dict:
    """The decoder-only LM's (or BERT's) parameters as a nested dict of Params."""
    return {**embedding_shapes(cfg), "layers": stacked(layer_shapes(cfg), cfg.layers)}


def encdec_shapes(cfg: Config) -> dict:
    """The encoder-decoder's parameters: embeddings shared by both stacks, the encoder's
    layers and final norm, and decoder layers with cross-attention."""
    return {
        **embedding_shapes(cfg),
        "encoder": stacked(layer_shapes(cfg), cfg.encoder_layers or cfg.layers),
        "encoder_norm": norm_params(cfg),
        "layers": stacked(layer_shapes(cfg, cross=True), cfg.layers),
    }


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


def self_attention_bias(p: dict, cfg: Config, queries, memory, causal: bool, extra=None):
    """The additive self-attention bias of one layer for query and memory positions (int
    Tensors over length and memory): causal mask, relative positions, and `extra` (a
    padding bias)."""
    bias = nm.where(memory <= queries, 0.0, NEG) if causal else None
    if cfg.relative_bias:
        rel = relative_bias(p["rel"], queries, memory, cfg.relative_bias)
        bias = rel if bias is None else bias + rel
    if extra is not None:
        bias = extra if bias is None else bias + extra
    return bias


def block(
    h,
    p,
    cfg: Config,
    key,
    causal: bool,
    bias=None,
    memory=None,
    memory_bias=None,
    cache=None,
    position=None,
):
    """(h, aux) after one pre-norm block: self-attention, cross-attention over `memory`
    (batch, memory, d_model) when given, then the FFN, each added to the residual; aux
    is the MoE load-balancing loss (None without experts).

    With a KV `cache` ({"k", "v"}: batch, memory, heads, d_kv), h holds the one new
    position `position` (a 0-d int Tensor) and (h, aux, new_cache) is returned."""
    keys = [None] * 3 if key is None else [nm.random.fold_in(key, i) for i in (1, 2, 3)]
    x = norm(h, p["attn_norm"], cfg.norm)
    if cache is None:
        # a function of the positions: blockwise attention builds it block by block
        bias_fn = lambda queries, slots: self_attention_bias(p["attn"], cfg, queries, slots, causal)
        x = attention(x, p["attn"], cfg, bias=bias, bias_fn=bias_fn)
    else:
        slots = nm.arange("memory", cache["k"].size_of("memory"))
        bias = self_attention_bias(p["attn"], cfg, position, slots, causal, bias)
        x, cache = attention(x, p["attn"], cfg, bias=bias, cache=cache, position=position)
    h = h + dropout(x, cfg.dropout, keys[0])
    if memory is not None:
        x = norm(h, p["cross_norm"], cfg.norm)
        x = attention(x, p["cross"], cfg, memory=memory, bias=memory_bias)
        h = h + dropout(x, cfg.dropout, keys[1])
    x = norm(h, p["ffn_norm"], cfg.norm)
    x, aux = moe(x, p["ffn"], cfg) if cfg.experts else (ffn(x, p["ffn"], cfg), None)
    h = h + dropout(x, cfg.dropout, keys[2])
    return (h, aux) if cache is None else (h, aux, cache)


def run_stack(x, layers: dict, cfg: Config, key, **block_args):
    """(x, aux): `block` for each index of the `layers` dim, in one nm.scan; aux is the
    sum of the layers' load-balancing losses (None without experts)."""
    is_tensor = lambda t: isinstance(t, nm.Tensor)
    n = jax.tree_util.tree_leaves(layers, is_leaf=is_tensor)[0].size_of("layers")

    def body(h, xs):
        p, k = xs
        return block(h, p, cfg, k, **block_args)

    x, aux = nm.scan(body, x, (layers, layer_keys(key, n)), "layers", remat=cfg.remat)
    return x, None if aux is None else aux.sum("layers")


def embed_inputs(params: dict, tokens: nm.Tensor, cfg: Config) -> nm.Tensor:
    x = embed(tokens, params["embed"])
    if "pos" in params:
        n = tokens.size_of("length")
        pos = params["pos"] if n == cfg.length else nm.slice(params["pos"], "length", 0, n)
        x = x + pos
    return x


def output_logits(params: dict, x: nm.Tensor, cfg: Config) -> nm.Tensor:
    """Logits (float32 whatever the compute dtype: the loss's statistics) over vocab."""
    x = norm(x, params["final_norm"], cfg.norm)
    out, f32 = x.dims[:-1] + ("vocab",), np.float32
    if "softmax" in params:
        return nm.einsum(x, params["softmax"], out=out, preferred_element_type=f32)
    logits = nm.einsum(x, params["embed"], out=out, preferred_element_type=f32)
    return logits * cfg.d_model**-0.5


def compute_params(params: dict, cfg: Config) -> dict:
    """`params` in cfg's compute dtype (float32 parameters, bfloat16 matmuls)."""
    return cast(params, compute_dtype(cfg))


def _with_aux(loss: nm.Tensor, aux, cfg: Config) -> nm.Tensor:
    return loss if aux is None else loss + aux * cfg.moe_loss


def lm_forward(params: dict, tokens: nm.Tensor, cfg: Config, key=None, causal: bool = True):
    """(logits, aux): logits (batch, length, vocab) for int tokens (batch, length) after
    the stack of `params["layers"]`, causal (the LM) or bidirectional (BERT)."""
    params = compute_params(params, cfg)
    x = embed_inputs(params, tokens, cfg)
    x, aux = run_stack(x, params["layers"], cfg, key, causal=causal)
    return output_logits(params, x, cfg), aux


def lm_logits(params: dict, tokens: nm.Tensor, cfg: Config, key=None) -> nm.Tensor:
    """Next-token logits (batch, length, vocab) for int tokens (batch, length)."""
    return lm_forward(params, tokens, cfg, key)[0]


def lm_loss(params: dict, batch: dict, cfg: Config, key=None) -> nm.Tensor:
    """Mean next-token cross-entropy (nats) over the weighted positions of `batch`
    ({"inputs", "targets", "weights"}: batch, length), plus the MoE balancing loss."""
    logits, aux = lm_forward(params, batch["inputs"], cfg, key)
    return _with_aux(cross_entropy(logits, batch["targets"], batch["weights"]), aux, cfg)


def mlm_loss(params: dict, batch: dict, cfg: Config, key=None) -> nm.Tensor:
    """BERT's masked-LM loss: bidirectional attention over the (partly masked) inputs,
    cross-entropy against the original tokens at the positions of weight 1."""
    logits, aux = lm_forward(params, batch["inputs"], cfg, key, causal=False)
    return _with_aux(cross_entropy(logits, batch["targets"], batch["weights"]), aux, cfg)


def encode(params: dict, batch: dict, cfg: Config, key=None):
    """(memory, memory_bias, aux): the encoder's output (batch, memory, d_model) over
    batch["inputs"], and the padding bias that hides its padded positions."""
    params = compute_params(params, cfg)
    pad = padding_bias(batch["input_weights"].rename(length="memory"))
    x = embed_inputs(params, batch["inputs"], cfg)
    k = None if key is None else nm.random.fold_in(key, 7)
    x, aux = run_stack(x, params["encoder"], cfg, k, causal=False, bias=pad)
    memory = norm(x, params["encoder_norm"], cfg.norm).rename(length="memory")
    return memory, pad, aux


def encdec_logits(params: dict, batch: dict, cfg: Config, key=None):
    """(logits, aux): the decoder's next-token logits over batch["decoder_inputs"],
    attending to the encoding of batch["inputs"]."""
    params = compute_params(params, cfg)
    memory, pad, aux_enc = encode(params, batch, cfg, key)
    x = embed_inputs(params, batch["decoder_inputs"], cfg)
    x, aux = run_stack(x, params["layers"], cfg, key, causal=True, memory=memory, memory_bias=pad)
    aux = aux_enc if aux is None else aux + aux_enc
    return output_logits(params, x, cfg), aux


def encdec_loss(params: dict, batch: dict, cfg: Config, key=None) -> nm.Tensor:
    """Span corruption: cross-entropy of the decoder's targets (the dropped spans, each
    after its sentinel) given the corrupted inputs."""
    logits, aux = encdec_logits(params, batch, cfg, key)
    return _with_aux(cross_entropy(logits, batch["targets"], batch["weights"]), aux, cfg)
