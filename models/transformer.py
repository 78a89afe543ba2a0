"""The Transformers: decoder-only LM, BERT-style encoder, encoder-decoder; their
shapes, initial values, logits and losses.

Layers are stacked along a `layers` dim and run with `nm.scan`, so the traced program
(and the compile time) does not grow with depth. Each layer is a block built from
parts (models/blocks.py: attention, cross-attention over an encoder, the MLP or a
mixture of experts) composed as the config's `block` says (models/residual.py:
pre-norm, post-norm, sandwich, parallel). T5's bucketed relative bias is one table per
stack, computed once and added in every layer.
"""

from __future__ import annotations

import jax
import numpy as np

import namedmesh as nm
from models.architecture import Config
from models.blocks import ATTENTIONS as ATTENTIONS  # re-exported: their home was here
from models.blocks import Attention as Attention
from models.blocks import Context, Cross, block, layer_shapes
from models.blocks import decode_block as decode_block
from models.blocks import self_attention_bias as self_attention_bias
from models.layers.common import (
    Param,
    activation,
    cast,
    compute_dtype,
    cross_entropy,
    embed,
    layer_constants,
    norm,
    norm_params,
    padding_bias,
    segment_bias,
)
from models.layers.moe import merged, over_layers
from models.params import abstract as abstract  # re-exported: their home was here
from models.params import init as init
from models.residual import COMPOSITIONS

# The dim every layer stack scans over (`run_stack`): a `layers:stage` layout pipelines it,
# in uneven stages too, where the stack is placed whole (lowering.distributed.place).
STACK_DIMS = ("layers",)
# the stacks of a params dict that `run_layers` chains (nm.scan_chain, in this order):
# the trainer pads them by the chain's deal (namedmesh.uneven.pad_stacks' `chain`)
CHAIN = ("dense", "layers")


def stack_names(cfg: Config) -> list[str]:
    """The names of the decoder's stacks in order (`CHAIN`'s where it has dense layers
    first), as `namedmesh plan` and the pipeline's report give each stage's layers."""
    return ["dense", "MoE"] if cfg.dense_layers else ["MoE" if cfg.experts else "dense"]


def slots_of(cache: dict) -> int:
    """The positions a KV cache holds (the size of its entries' `memory`)."""
    return next(t for t in cache.values()).size_of("memory")


def stacked(shapes, n: int):
    """`shapes` with a leading `layers` dim of size n on every Param."""
    if isinstance(shapes, Param):
        return Param({"layers": n, **shapes.sizes}, shapes.init)
    return {k: stacked(v, n) for k, v in shapes.items()}


def embedding_shapes(cfg: Config) -> dict:
    """Input embeddings (tokens, learned positions, the family's own: BERT's token types,
    their norm), the final
    norm of a pre-norm stack, T5's relative bias table of the decoder (or LM) stack, and
    the output side: an unshared softmax, BERT's MLM head."""
    d, v = cfg.d_model, cfg.vocab
    shapes = {"embed": Param({"vocab": v, "d_model": d}, 1.0)}
    if e := cfg.embed_dim:  # narrower embeddings, projected in and out
        shapes["embed"] = Param({"vocab": v, "d_embed": e}, 1.0)
        shapes["project_in"] = Param({"d_embed": e, "d_model": d}, e**-0.5)
        shapes["project_out"] = Param({"d_model": d, "d_embed": e}, d**-0.5)
    if COMPOSITIONS[cfg.block].final_norm:
        shapes["final_norm"] = norm_params(cfg)
    if cfg.learned_positions:
        rows = cfg.learned_positions + cfg.parts.position_offset
        shapes["pos"] = Param({"length": rows, "d_model": d}, 0.1)
    shapes |= cfg.parts.embedding_shapes(cfg)
    if cfg.embed_norm:
        shapes["embed_norm"] = norm_params(cfg)
    if cfg.relative_buckets:
        shapes["relative"] = relative_shapes(cfg)
    if not cfg.shared_embedding:
        width = {"d_embed": cfg.embed_dim} if cfg.embed_dim else {"d_model": d}
        shapes["softmax"] = Param({**width, "vocab": v}, d**-0.5)
    if cfg.mlm_head:
        shapes["mlm"] = {
            "dense": Param({"d_model": d, "d_model_out": d}, d**-0.5),
            "dense_bias": Param({"d_model": d}, "zeros"),
            "norm": norm_params(cfg),
            "vocab_bias": Param({"vocab": v}, "zeros"),
        }
    return shapes


def relative_shapes(cfg: Config) -> Param:
    """T5's relative bias: one learned value per head and distance bucket."""
    return Param({"heads": cfg.heads, "buckets": cfg.relative_buckets}, 0.1)


def lm_shapes(cfg: Config) -> dict:
    """The decoder-only LM's (or BERT's) parameters as a nested dict of Params: the
    `layers` stack, after a `dense` one of cfg.dense_layers layers where it has them."""
    k = cfg.dense_layers
    shapes = {**embedding_shapes(cfg), "layers": stacked(layer_shapes(cfg), cfg.layers - k)}
    return {**shapes, "dense": stacked(layer_shapes(dense_config(cfg)), k)} if k else shapes


def dense_config(cfg: Config) -> Config:
    """The Config of the dense stack before the mixture-of-experts layers (dense_layers)."""
    return cfg.replace(experts=0, dense_layers=0, shared_ff=0, parts=cfg.parts.dense())


def encdec_shapes(cfg: Config) -> dict:
    """The encoder-decoder's parameters: embeddings shared by both stacks, the encoder's
    layers and final norm, and decoder layers with cross-attention."""
    return {
        **embedding_shapes(cfg),
        "encoder": stacked(layer_shapes(cfg), cfg.encoder_layers or cfg.layers),
        "encoder_norm": norm_params(cfg),
        "layers": stacked(layer_shapes(cfg, cross=True), cfg.layers),
        **({"encoder_relative": relative_shapes(cfg)} if cfg.relative_buckets else {}),
    }


def _leaves(shapes, prefix=""):
    if isinstance(shapes, Param):
        yield prefix, shapes
        return
    for k in sorted(shapes):
        yield from _leaves(shapes[k], f"{prefix}/{k}" if prefix else k)


def layer_keys(key, n: int):
    """One dropout key per layer, stacked along `layers` (None without a key)."""
    if key is None:
        return None
    return nm.stack([nm.random.fold_in(key, i) for i in range(n)], "layers")


def relative_buckets(queries, memory, bidirectional: bool, buckets: int, max_distance: int):
    """T5's bucket (an int array of shape (queries, memory)) of each relative position
    memory - query: exact distances below buckets/2 (per direction when bidirectional),
    then logarithmically wider buckets up to max_distance. Positions are NumPy ints."""
    rel = np.asarray(memory)[None, :] - np.asarray(queries)[:, None]
    out = np.zeros(rel.shape, np.int64)
    if bidirectional:
        buckets //= 2
        out += (rel > 0) * buckets
        rel = np.abs(rel)
    else:
        rel = -np.minimum(rel, 0)
    exact = buckets // 2
    with np.errstate(divide="ignore"):  # log(0) of the small distances, not used
        scaled = np.log(rel.astype(np.float32) / np.float32(exact)) / np.float32(
            np.log(max_distance / exact)
        )
    large = exact + np.nan_to_num(scaled * np.float32(buckets - exact), neginf=0).astype(np.int64)
    return (out + np.where(rel < exact, rel, np.minimum(large, buckets - 1))).astype(np.int32)


def bucket_bias(table: nm.Tensor, cfg: Config, n: int, bidirectional: bool, position=None):
    """T5's relative position bias (heads, length, memory) of n positions attending to
    each other; with `position` (an int Tensor: 0-d, over batch, or a prefill's 0..k-1
    over length), those queries' rows over n cache slots. Computed once per stack and
    added in every layer."""
    at = np.arange(n)
    rb, rd = cfg.relative_buckets, cfg.relative_max_distance
    index = nm.tensor(relative_buckets(at, at, bidirectional, rb, rd), ("length", "memory"))
    if position is not None:  # a traced position: gather from a jax array, not NumPy's
        queries = "length" in position.dims  # a prefill's positions 0..k-1 over length
        at = position.rename(length="queries") if queries else position
        index = nm.gather(nm.tensor(jax.numpy.asarray(index.data), index.dims), "length", at)
        index = index.rename(queries="length") if queries else index
    return nm.gather(table, "buckets", index)


def run_stack(x, layers: dict, cfg: Config, key, **block_args):
    """(x, aux): `block` for each index of the `layers` dim, in one nm.scan; aux is the
    router's statistics over the layers (moe.over_layers; None without experts).
    `block_args`: Context's causal, bias and stats, and `memory` with its `memory_bias`
    (an encoder's output for cross-attention)."""
    body, xs = stack_step(x, layers, cfg, key, **block_args)
    x, aux = nm.scan(body, x, xs, "layers", remat=cfg.remat, unroll=_unroll(cfg))
    return x, None if aux is None else over_layers(aux)


def stack_step(x, layers: dict, cfg: Config, key, **block_args):
    """(body, xs): the scan of `run_stack` over the `layers` dim, for nm.scan or one
    stack of nm.scan_chain."""
    is_tensor = lambda t: isinstance(t, nm.Tensor)
    n = jax.tree_util.tree_leaves(layers, is_leaf=is_tensor)[0].size_of("layers")
    consts = layer_constants(cfg, x.size_of("length"))
    memory, memory_bias = block_args.pop("memory", None), block_args.pop("memory_bias", None)
    cross = None if memory is None else Cross(memory, memory_bias)

    def body(h, xs):
        p, k, c = xs
        return block(h, p, Context(cfg, key=k, layer=c, **block_args), cross)

    return body, (layers, layer_keys(key, n), consts)


def _unroll(cfg: Config):
    return "auto" if cfg.scan_layers == "auto" else not cfg.scan_layers


def run_layers(x, params: dict, cfg: Config, key, **block_args):
    """(x, aux): params' dense stack (cfg.dense_layers; none for most models) then its
    `layers`, as `run_stack` runs each, the two chained (nm.scan_chain: pipelined, one
    pipeline whose stages hold consecutive layers of both); aux is the layers' router
    statistics."""
    if "dense" not in params:
        return run_stack(x, params["layers"], cfg, key, **block_args)
    k = None if key is None else nm.random.fold_in(key, 11)
    steps = [stack_step(x, params["dense"], dense_config(cfg), k, **dict(block_args)),
             stack_step(x, params["layers"], cfg, key, **block_args)]  # fmt: skip
    x, (_, aux) = nm.scan_chain(steps, x, "layers", remat=cfg.remat, unroll=_unroll(cfg),
                                names=stack_names(cfg))  # fmt: skip
    return x, None if aux is None else over_layers(aux)


def embed_inputs(
    params: dict, tokens: nm.Tensor, cfg: Config, token_types=None, positions=None
) -> nm.Tensor:
    """Token embeddings (batch, length, d_model), plus the learned positions 0..length-1
    (or `positions`, ints like tokens: packed examples' own) as the family's parts read
    them, the family's extras (BERT's token types: `token_types`, ints like tokens),
    then the embedding norm (BERT)."""
    x = embed_tokens(params, tokens, cfg)
    if "pos" in params:
        x = x + cfg.parts.positions(params["pos"], tokens, positions)
    return embed_extras(params, x, cfg, token_types)


def embed_tokens(params: dict, tokens: nm.Tensor, cfg: Config) -> nm.Tensor:
    """The rows of the embedding at `tokens` (batch, length, d_model): times sqrt(d_model)
    where cfg.embed_scale (Gemma), the factor rounded to the compute dtype first as
    transformers rounds it; as the family's parts take them (Granite's multiplier);
    projected in from d_embed where the model's embeddings are narrower (OPT-350m's
    project_in)."""
    x = embed(tokens, params["embed"])
    if cfg.embed_scale:
        x = x * nm.astype(nm.tensor(np.float32(cfg.d_model**0.5), ()), x.dtype)
    x = cfg.parts.embed(x)
    if "project_in" in params:
        x = nm.einsum(x, params["project_in"], out=(*x.dims[:-1], "d_model"))
    return x


def embed_extras(params: dict, x: nm.Tensor, cfg: Config, token_types=None) -> nm.Tensor:
    """x with the family's extras (BERT's token types: type 0 when `token_types` is None),
    then the embedding norm where the model has one."""
    x = cfg.parts.embed_extras(params, x, token_types)
    if "embed_norm" in params:
        x = norm(x, params["embed_norm"], cfg.norm, cfg.norm_eps)
    return x


def output_logits(params: dict, x: nm.Tensor, cfg: Config) -> nm.Tensor:
    """Logits over `vocab` of the last hidden state, float32 whatever the compute dtype
    (the loss's statistics): the final norm (pre-norm stacks), BERT's MLM transform, the
    projection out to narrower embeddings (project_out), then the unshared softmax or
    the tied embedding (its input scaled by d_model**-0.5 when cfg.scale_tied_logits),
    as the family's parts take them (Gemma 2's soft-cap), plus the MLM head's bias."""
    if "final_norm" in params:
        x = norm(x, params["final_norm"], cfg.norm, cfg.norm_eps)
    if "mlm" in params:
        m = params["mlm"]
        x = nm.einsum(x, m["dense"], out=x.dims[:-1] + ("d_model_out",))
        x = activation(cfg.ffn)[0](x.rename(d_model_out="d_model") + m["dense_bias"])
        x = norm(x, m["norm"], cfg.norm, cfg.norm_eps)
    if "project_out" in params:  # to the embeddings' width
        x = nm.einsum(x, params["project_out"], out=(*x.dims[:-1], "d_embed"))
    out, f32 = x.dims[:-1] + ("vocab",), np.float32
    if "softmax" in params:
        logits = nm.einsum(x, params["softmax"], out=out, preferred_element_type=f32)
    else:
        logits = nm.einsum(x, params["embed"], out=out, preferred_element_type=f32)
        if cfg.scale_tied_logits:
            logits = logits * cfg.d_model**-0.5
    logits = cfg.parts.logits(logits)
    return logits + params["mlm"]["vocab_bias"] if "mlm" in params else logits


def compute_params(params: dict, cfg: Config) -> dict:
    """`params` in cfg's compute dtype (float32 parameters, bfloat16 matmuls)."""
    return cast(params, compute_dtype(cfg))


def _with_aux(loss: nm.Tensor, aux, cfg: Config, stats: bool = False):
    """The loss plus the weighted balancing loss; with `stats`, (that, the router's
    statistics: {} without experts)."""
    total = loss if aux is None else loss + aux["balance"] * cfg.moe_loss
    return (total, aux or {}) if stats else total


def lm_forward(params: dict, batch: dict, cfg: Config, key=None, causal=True, stats=False):
    """(logits, aux): logits (batch, length, vocab) for the int tokens batch["inputs"]
    (batch, length) after the stack of `params["layers"]`, causal (the LM) or
    bidirectional (BERT). What else `batch` may hold: "weights" (batch, length; 1 real,
    0 padding) hides padded positions from attention; "token_types" (ints like tokens)
    select token-type embeddings. Packed rows (models/training/chat.py): "segments" (ints like
    tokens) hides the keys of other examples, "positions" (ints like tokens) are each
    example's, from 0. aux: the MoE's balancing loss, and with `stats` its other
    statistics (None without experts)."""
    params = compute_params(params, cfg)
    tokens, weights, segments = batch["inputs"], batch.get("weights"), batch.get("segments")
    positions = batch.get("positions")
    x = embed_inputs(params, tokens, cfg, batch.get("token_types"), positions)
    bias = None if weights is None else padding_bias(weights.rename(length="memory"))
    if segments is not None:
        bias = segment_bias(segments) if bias is None else bias + segment_bias(segments)
    if "relative" in params:
        rel = bucket_bias(params["relative"], cfg, tokens.size_of("length"), not causal)
        bias = rel if bias is None else rel + bias
    x, aux = run_layers(
        x, params, cfg, key, causal=causal, bias=bias, position=positions, stats=stats
    )
    return output_logits(params, x, cfg), aux


def lm_logits(params: dict, tokens: nm.Tensor, cfg: Config, key=None) -> nm.Tensor:
    """Next-token logits (batch, length, vocab) for int tokens (batch, length)."""
    return lm_forward(params, {"inputs": tokens}, cfg, key)[0]


def batch_logits(params: dict, batch: dict, cfg: Config) -> nm.Tensor:
    """The LM's logits for a batch of inputs and, optionally, weights (padding) and
    token_types."""
    return lm_forward(params, _forward_inputs(batch), cfg)[0]


def mlm_batch_logits(params: dict, batch: dict, cfg: Config) -> nm.Tensor:
    """BERT's masked-LM logits (bidirectional) for a batch as `batch_logits`'s."""
    return lm_forward(params, _forward_inputs(batch), cfg, causal=False)[0]


def _forward_inputs(batch: dict) -> dict:
    """The inputs, weights (padding) and token_types of a batch: what logits read."""
    return {k: batch[k] for k in ("inputs", "weights", "token_types") if k in batch}


def lm_loss(params: dict, batch: dict, cfg: Config, key=None, stats: bool = False):
    """Mean next-token cross-entropy (nats) over the weighted positions of `batch`
    ({"inputs", "targets", "weights"}: batch, length; packed rows add "segments" and
    "positions"), plus the MoE balancing loss; with `stats`, (loss, the router's
    statistics)."""
    packed = {k: batch[k] for k in ("inputs", "segments", "positions") if k in batch}
    logits, aux = lm_forward(params, packed, cfg, key, stats=stats)
    return _with_aux(cross_entropy(logits, batch["targets"], batch["weights"]), aux, cfg, stats)


def mlm_loss(params: dict, batch: dict, cfg: Config, key=None, stats: bool = False):
    """BERT's masked-LM loss: bidirectional attention over the (partly masked) inputs,
    cross-entropy against the original tokens at the positions of weight 1."""
    inputs = {"inputs": batch["inputs"]}
    logits, aux = lm_forward(params, inputs, cfg, key, causal=False, stats=stats)
    return _with_aux(cross_entropy(logits, batch["targets"], batch["weights"]), aux, cfg, stats)


def encode(params: dict, batch: dict, cfg: Config, key=None, stats: bool = False):
    """(memory, memory_bias, aux): the encoder's output (batch, memory, d_model) over
    batch["inputs"], and the padding bias that hides its padded positions."""
    params = compute_params(params, cfg)
    pad = padding_bias(batch["input_weights"].rename(length="memory"))
    x = embed_inputs(params, batch["inputs"], cfg)
    k = None if key is None else nm.random.fold_in(key, 7)
    bias = pad
    if "encoder_relative" in params:
        n = batch["inputs"].size_of("length")
        bias = bias + bucket_bias(params["encoder_relative"], cfg, n, bidirectional=True)
    x, aux = run_stack(x, params["encoder"], cfg, k, causal=False, bias=bias, stats=stats)
    memory = norm(x, params["encoder_norm"], cfg.norm, cfg.norm_eps).rename(length="memory")
    return memory, pad, aux


def encdec_logits(params: dict, batch: dict, cfg: Config, key=None, stats: bool = False):
    """(logits, aux): the decoder's next-token logits over batch["decoder_inputs"],
    attending to the encoding of batch["inputs"]."""
    params = compute_params(params, cfg)
    memory, pad, aux_enc = encode(params, batch, cfg, key, stats)
    x = embed_inputs(params, batch["decoder_inputs"], cfg)
    bias = None
    if "relative" in params:
        n = batch["decoder_inputs"].size_of("length")
        bias = bucket_bias(params["relative"], cfg, n, bidirectional=False)
    x, aux = run_stack(
        x, params["layers"], cfg, key, causal=True, bias=bias, memory=memory, memory_bias=pad,
        stats=stats,
    )  # fmt: skip
    aux = aux_enc if aux is None else merged(aux, aux_enc)
    return output_logits(params, x, cfg), aux


def encdec_batch_logits(params: dict, batch: dict, cfg: Config) -> nm.Tensor:
    """The decoder's logits over batch["decoder_inputs"] given batch["inputs"] and its
    padding `weights` (all ones when absent)."""
    inputs = batch["inputs"]
    weights = batch.get("weights")
    weights = nm.ones(inputs.sizes, np.float32) if weights is None else weights
    b = {"inputs": inputs, "input_weights": weights, "decoder_inputs": batch["decoder_inputs"]}
    return encdec_logits(params, b, cfg)[0]


def encdec_loss(params: dict, batch: dict, cfg: Config, key=None, stats: bool = False):
    """Span corruption: cross-entropy of the decoder's targets (the dropped spans, each
    after its sentinel) given the corrupted inputs."""
    logits, aux = encdec_logits(params, batch, cfg, key, stats)
    return _with_aux(cross_entropy(logits, batch["targets"], batch["weights"]), aux, cfg, stats)
