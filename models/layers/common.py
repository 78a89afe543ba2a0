"""Transformer building blocks on named dims, written only in the namedmesh language.

Each block is a function of Tensors and a dict of parameter Tensors; parameters are
declared as `Param(sizes, init)` so a model's shapes exist before (or without) its
values. Activations have dims batch, length (queries), memory (attended positions),
d_model, heads, d_kv, d_ff, vocab: a layout maps any of them to mesh axes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

import namedmesh as nm
from models.architecture import Config, ConfigError
from models.layers import lora
from models.layers.kernels import AUTO, KERNELS, Options, choose
from models.layers.rope import Rope, depends_on_length, frequencies, rotary_dims
from models.params import Param as Param  # re-exported: its home was here
from namedmesh.uneven import splits_of

NEG = -1e9  # the attention logit of a masked position
DEFAULT_ROPE = Rope()


def compute_dtype(cfg: Config) -> np.dtype:
    """The dtype of cfg's matmuls and activations (parameters and statistics stay float32;
    Config refuses a dtype not in DTYPES when it is made)."""
    return np.dtype(cfg.dtype)


def cast(params, dtype: np.dtype):
    """The floating Tensors of a (nested dict or tuple of) parameters converted to
    `dtype`; the conversion's transpose brings their gradients back in their own dtype."""
    if isinstance(params, dict):
        return {k: cast(v, dtype) for k, v in params.items()}
    if isinstance(params, tuple):  # a stack's layers, unstacked (models/inference/decoding.py)
        return tuple(cast(v, dtype) for v in params)
    floating = np.issubdtype(params.dtype, np.floating) or params.dtype == np.dtype("bfloat16")
    return nm.astype(params, dtype) if floating and params.dtype != dtype else params


# --- norms -------------------------------------------------------------------------
def norm_params(cfg: Config) -> dict:
    p = {"scale": Param({"d_model": cfg.d_model}, norm_init(cfg))}
    if cfg.norm == "layer":
        p["bias"] = Param({"d_model": cfg.d_model}, "zeros")
    return p


def norm_init(cfg: Config) -> str:
    """A norm scale's initial value: ones, or zeros where the norm adds 1 (rms_offset)."""
    return "zeros" if cfg.norm == "rms_offset" else "ones"


def norm(x: nm.Tensor, p: dict, kind: str, eps: float = 1e-6, dim: str = "d_model"):
    """LayerNorm (mean and variance over `dim`, then scale and bias), RMSNorm, or
    RMSNorm scaled by 1 + scale (rms_offset, Gemma's: the product taken in float32 as
    transformers does). The statistics are float32 whatever x's dtype; the result has
    x's dtype."""
    dtype = x.dtype
    x = nm.astype(x, np.float32) if dtype != np.float32 else x
    if kind == "layer":
        centered = x - nm.mean(x, dim)
        y = centered * nm.rsqrt(nm.mean(centered * centered, dim) + eps)
    else:
        y = x * nm.rsqrt(nm.mean(x * x, dim) + eps)
    if kind == "rms_offset":  # x * (1 + w) in float32, then x's dtype
        scale = p["scale"] if p["scale"].dtype == np.float32 else nm.astype(p["scale"], np.float32)
        y = y * (scale + 1.0)
        return nm.astype(y, dtype) if dtype != np.float32 else y
    y = nm.astype(y, dtype) if dtype != np.float32 else y
    return y * p["scale"] + p["bias"] if kind == "layer" else y * p["scale"]


def head_norm_kind(cfg: Config) -> str:
    """The kind of the q/k norms over d_kv (qk_norm): an RMSNorm, offset as cfg's is."""
    return "rms_offset" if cfg.norm == "rms_offset" else "rms"


# --- attention ---------------------------------------------------------------------
def head_sizes(cfg: Config, kv: bool = False) -> dict:
    """The head dims of queries (kv=False) or of keys and values: `heads`, or under
    grouped-query attention `kv_heads` and, for queries, `q_per_kv` (the query heads
    that share one key/value head), so a layout rule on kv_heads splits the KV heads."""
    if not cfg.kv_heads:
        return {"heads": cfg.heads}
    return (
        {"kv_heads": cfg.kv_heads} if kv else {"kv_heads": cfg.kv_heads, "q_per_kv": cfg.q_per_kv}
    )


def attention_params(cfg: Config) -> dict:
    d, k = cfg.d_model, cfg.d_kv
    qh, kvh = head_sizes(cfg), head_sizes(cfg, kv=True)
    p = {
        "q": Param({"d_model": d, **qh, "d_kv": k}, d**-0.5),
        "k": Param({"d_model": d, **kvh, "d_kv": k}, d**-0.5),
        "v": Param({"d_model": d, **kvh, "d_kv": k}, d**-0.5),
        "o": Param({**qh, "d_kv": k, "d_model": d}, (cfg.heads * k) ** -0.5),
    }
    if cfg.bias or cfg.qkv_bias:
        p["q_bias"] = Param({**qh, "d_kv": k}, "zeros")
        p["k_bias"] = Param({**kvh, "d_kv": k}, "zeros")
        p["v_bias"] = Param({**kvh, "d_kv": k}, "zeros")
    if cfg.bias:
        p["o_bias"] = Param({"d_model": d}, "zeros")
    if cfg.qk_norm:
        p["q_norm"] = {"scale": Param({"d_kv": k}, norm_init(cfg))}
        p["k_norm"] = {"scale": Param({"d_kv": k}, norm_init(cfg))}
    if cfg.relative_bias:
        p["rel"] = Param({"heads": cfg.heads, "distance": 2 * cfg.relative_bias + 1}, "zeros")
    return p


def padding_bias(memory_weights: nm.Tensor) -> nm.Tensor:
    """0 for real memory positions (weight 1), NEG for padding: dims batch, memory."""
    return (1.0 - memory_weights) * NEG


def segment_bias(segments: nm.Tensor) -> nm.Tensor:
    """0 where a query's and a key's segment ids (int, batch, length: the examples packed
    into a row) agree, NEG elsewhere: dims batch, length, memory. A dense bias, so every
    attention kernel honours it as it honours padding (models/layers/kernels.py)."""
    return nm.where(segments == segments.rename(length="memory"), 0.0, NEG)


def relative_bias(rel: nm.Tensor, queries, memory, max_distance: int) -> nm.Tensor:
    """The learned bias of each head for (memory - query) position, clipped to
    +-max_distance: dims heads, length, memory. `queries` and `memory` are the
    positions (int Tensors over length and memory)."""
    distance = nm.clip(memory - queries, -max_distance, max_distance) + max_distance
    return nm.gather(rel, "distance", distance)


def rotary(x: nm.Tensor, positions: nm.Tensor, rope: Rope = DEFAULT_ROPE, seq_len: int = 0):
    """Rotary position embedding (RoFormer; Llama's "rotate half" form) of x over d_kv at
    integer `positions` (a Tensor over length or memory, or 0-d): the halves (a, b) of
    d_kv become (a cos - b sin, b cos + a sin), angle position * inv_freq, inv_freq
    rope.theta**(-2i/d_kv) scaled as `rope` says (models/layers/rope.py; `seq_len`: the positions
    of the pass, which dynamic and longrope scaling read); with rope.fraction < 1 only
    the first int(d_kv * fraction) dims rotate (GPT-NeoX, Phi-4-mini). Every step is on
    named dims, so a layout splitting length, heads or d_kv gives the same values."""
    d = x.size_of("d_kv")
    n = rotary_dims(rope, d)
    if n < d:  # partial rotary: the first n dims rotate, the rest pass through
        rotated, rest = nm.split(x, "d_kv", (n, d - n))
        return nm.concat([_rotate_pairs(rotated, positions, rope, seq_len), rest], "d_kv")
    return _rotate_pairs(x, positions, rope, seq_len)


def _rotate_pairs(x: nm.Tensor, positions: nm.Tensor, rope: Rope, seq_len: int):
    """Every dim of x's d_kv rotated (the halves are the pairs), as `rotary` says."""
    inv, factor = frequencies(rope, x.size_of("d_kv"), seq_len)
    return rotate(x, positions, nm.tensor(np.concatenate([inv, inv]), ("d_kv",)), factor)


def rotate(x: nm.Tensor, positions: nm.Tensor, inv: nm.Tensor, factor=1.0) -> nm.Tensor:
    """`rotary` with the inverse frequency of each d_kv entry given (`inv`, float32
    over d_kv: each pair's twice) and the factor on cos and sin (a float, or a 0-d
    Tensor: one layer's, in a stack whose layers rotate differently)."""
    cos, sin = _cos_sin(positions, inv, factor)
    # each half written from x's halves, (a cos - b sin, b cos + a sin): the same
    # products and sums as x cos + concat(-b, a) sin, whose concat XLA wrote out as an
    # array of x's size before the rotation read it (forward and backward, q and k)
    a, b = nm.split(x, "d_kv", 2)
    (ca, cb), (sa, sb) = nm.split(cos, "d_kv", 2), nm.split(sin, "d_kv", 2)
    return nm.concat([a * ca - b * sa, b * cb + a * sb], "d_kv")


def _cos_sin(positions: nm.Tensor, inv: nm.Tensor, factor) -> tuple[nm.Tensor, nm.Tensor]:
    """cos and sin of positions * inv (float32, as transformers rounds the angle), times
    `factor`: a NumPy table (positions' dims, d_kv) where all three are known when the
    program is traced (a pass's positions 0..n-1), so that it is a constant the program
    reads; traced ops otherwise (XLA fuses those into each consumer, one cos and sin per
    element of q and k)."""
    f = factor.data if isinstance(factor, nm.Tensor) else factor
    known = isinstance(positions.data, np.ndarray) and isinstance(inv.data, np.ndarray)
    known &= isinstance(f, int | float | np.number | np.ndarray) and np.ndim(f) == 0
    if known and not set(positions.dims) & set(inv.dims):
        f = float(f)
        at, inv_ = positions.data.astype(np.float32), inv.data.astype(np.float32)
        tables = _tables(at.tobytes(), at.shape, inv_.tobytes(), f)
        return tuple(nm.tensor(t, (*positions.dims, *inv.dims)) for t in tables)
    return traced_cos_sin(positions, inv, factor)


def traced_cos_sin(positions: nm.Tensor, inv: nm.Tensor, factor) -> tuple[nm.Tensor, nm.Tensor]:
    """`_cos_sin` as ops of the program (positions or factor traced; and what
    benchmarks.beside_dots puts back to time the tables against)."""
    angle = nm.astype(positions, np.float32) * inv
    cos, sin = nm.cos(angle), nm.sin(angle)
    if isinstance(factor, nm.Tensor) or factor != 1.0:
        f = factor if isinstance(factor, nm.Tensor) else np.float32(factor)
        cos, sin = cos * f, sin * f
    return cos, sin


@functools.lru_cache(maxsize=64)
def _tables(positions: bytes, shape: tuple, inv: bytes, factor: float):
    """cos and sin (float32, positions' shape + inv's) of the float32 angles positions *
    inv (float32 bytes), each rounded once from float64, times `factor`. Cached: every
    layer, q and k read the same arrays, so the program holds one constant of each, not
    one a call (an unrolled 8k-token stack would hold megabytes of copies)."""
    at = np.frombuffer(positions, np.float32).reshape(shape)
    angle = np.multiply.outer(at, np.frombuffer(inv, np.float32))
    cos, sin = np.cos(angle, dtype=np.float64), np.sin(angle, dtype=np.float64)
    tables = (cos * factor).astype(np.float32), (sin * factor).astype(np.float32)
    for t in tables:  # shared by every caller
        t.flags.writeable = False
    return tables


GLOBAL_WINDOW = 2**30  # a global layer's window among sliding ones: past every position


def layer_constants(cfg: Config, seq_len: int) -> dict | None:
    """What differs between the layers of a stack besides their parameters, as Tensors
    over `layers` that the layer scan carries beside them (one traced block for every
    layer, not one per kind of layer): with cfg.sliding_layers, each layer's `window`
    (GLOBAL_WINDOW on the global ones), and what the family's parts add (Gemma 3's
    per-layer rotary `inv_freq` and `rope_factor`: models.parts.Parts.layer_constants).
    None when the layers are alike."""
    if not cfg.sliding_layers:
        return None
    sliding = np.asarray(cfg.sliding_layers, bool)
    windows = np.where(sliding, cfg.sliding_window, GLOBAL_WINDOW).astype(np.int32)
    return {"window": nm.tensor(windows, ("layers",)), **cfg.parts.layer_constants(cfg, seq_len)}


def rope_constants(ropes: tuple[Rope, Rope], sliding, d_kv: int, seq_len: int) -> dict:
    """Each layer's rotary `inv_freq` (layers, d_kv) and `rope_factor` (layers) for
    positions below `seq_len`: ropes[1] on the layers `sliding` flags, ropes[0] on the
    others (Gemma 3's local and global bases)."""
    tables = [frequencies(r, d_kv, seq_len) for r in ropes]
    inv = np.stack([tables[int(s)][0] for s in sliding])
    factors = np.asarray([tables[int(s)][1] for s in sliding], np.float32)
    return {
        "inv_freq": nm.tensor(np.concatenate([inv, inv], -1), ("layers", "d_kv")),
        "rope_factor": nm.tensor(factors, ("layers",)),
    }


def attend(q: nm.Tensor, k: nm.Tensor, v: nm.Tensor, bias=None, scale: float = 1.0):
    """The core of attention: softmax over `memory` of q.k * scale + bias, applied to v
    (models.layers.kernels.full). q has dims (..., length, d_kv), k and v (..., memory, d_kv);
    their other dims (batch, heads, kv_heads, q_per_kv, ...) are matched by name, and
    `bias` broadcasts by name over the logits."""
    return KERNELS["full"].fn(q, k, v, Options(bias=bias, scale=scale))


def kernel_for(cfg: Config, opts: Options, length: int):
    """cfg.attention's kernel function for `length` queries ("auto" resolved by
    models.layers.kernels.choose), after checking it implements what `opts` asks
    (ConfigError naming the kernel and the option it refuses)."""
    return KERNELS[kernel_name(cfg, opts, length)].fn


def kernel_name(cfg: Config, opts: Options, length: int) -> str:
    """The KERNELS name cfg.attention runs for `length` queries with `opts` (kernel_for)."""
    asked = {
        "softcap": bool(opts.softcap),
        "cached": opts.cached,
        "positional": opts.bias_fn is not None and not opts.masks_only,
        # a bias that differs by query and key (packed examples' segment_bias)
        "pairwise": opts.bias is not None and {"length", "memory"} <= set(opts.bias.dims),
        # the layout being lowered splits the queries (namedmesh.uneven.splits_of reads
        # the layout's splits while `lower` traces; 1 outside it)
        "split": splits_of("length") > 1,
    }
    name = cfg.attention
    if name == AUTO:
        return choose(length, asked)
    for option, why in KERNELS[name].refuses.items():
        if asked[option]:
            raise ConfigError(f"attention={name!r} with {option}: {why}")
    return name


def attention_kernel(cfg: Config, length: int | None = None) -> str:
    """What cfg.attention runs in a whole-sequence pass of `length` tokens (cfg.length
    by default), for the settings a run prints: the kernel itself, or "auto" and the
    kernel it picks for the model's self-attention (its soft-cap and positional biases
    read from cfg: Config.relative_bias, per-layer windows)."""
    if cfg.attention != AUTO:
        return cfg.attention
    length = cfg.length if length is None else length
    return f"auto ({_self_attention_kernel(cfg, length)} at {length} tokens)"


def attention_settings(cfg: Config, length: int | None = None, batch: int | None = None) -> str:
    """`attention_kernel` and the blocks its kernel works in, as a run's settings line
    names them: blockwise and ring attention's key blocks (cfg.attention_block); the
    fused kernel's row blocks on CPU from namedmesh.attention.FLASH_FROM tokens
    (namedmesh.flash.block_for, by length and the heads of `batch` sequences, cfg.batch
    by default, on one device: cfg.attention_block is not the fused kernel's); none
    for full attention."""
    length = cfg.length if length is None else length
    batch = cfg.batch if batch is None else batch
    kernel = _self_attention_kernel(cfg, length)
    if kernel in ("blockwise", "ring"):
        blocks = f", block {cfg.attention_block}"
    elif kernel == "fused" and length >= nm.attention.FLASH_FROM:
        blocks = f", rows of {nm.flash.block_for(length, cfg.heads * batch)} on CPU"
    else:
        blocks = ""
    return f"attention {attention_kernel(cfg, length)}{blocks}"


def _self_attention_kernel(cfg: Config, length: int) -> str:
    """The kernel cfg.attention runs for `length` tokens of the model's self-attention."""
    if cfg.attention != AUTO:
        return cfg.attention
    asks = {
        "softcap": bool(cfg.parts.attention_softcap),
        "positional": bool(cfg.relative_bias or cfg.sliding_layers),
    }
    return choose(length, asks)


def _as_memory(position: nm.Tensor) -> nm.Tensor:
    """Query positions as key positions: a prefill's `length` becomes `memory`."""
    return position.rename(length="memory") if "length" in position.dims else position


def kv_cache(cfg: Config) -> dict:
    """The sizes of one position's cached keys and values ({"k", "v"}), besides layers,
    batch and memory: heads (or kv_heads) and d_kv."""
    sizes = {**head_sizes(cfg, kv=True), "d_kv": cfg.d_kv}
    return {"k": sizes, "v": sizes}


def write_cache(cache: dict, k: nm.Tensor, v: nm.Tensor, position: nm.Tensor):
    """(keys, values) of the cache ({"k", "v"}: batch, memory=slots, ...) with the new
    k and v (batch, memory=n, ...) written at `position`: one slot per row (n = 1,
    position 0-d or over batch; `nm.update_slice`, one traced program for every
    position), or the first n slots of an empty cache (position over length: prefill).
    The cache keeps its dtype (the compute dtype)."""
    return write_slots(cache["k"], k, position), write_slots(cache["v"], v, position)


def write_slots(cache: nm.Tensor, new: nm.Tensor, position: nm.Tensor) -> nm.Tensor:
    """`cache` (batch, memory=slots, ...) with `new` (batch, memory=n or length=n, ...)
    written at `position` as `write_cache` writes keys, in the cache's dtype."""
    slots, dtype = cache.size_of("memory"), cache.dtype
    new = new if new.dtype == dtype else nm.astype(new, dtype)
    new = new.rename(length="memory") if "length" in new.dims else new
    if "length" in position.dims:  # prefill: slots n.. stay empty (the causal mask hides them)
        fill = {"memory": (0, slots - new.size_of("memory"))}
        return nm.pad(new, fill).transpose(*cache.dims)
    # a step: the one slot per row written in place (a one-hot blend rewrote every slot)
    return nm.update_slice(cache, "memory", position, new)


def rotate_qk(q: nm.Tensor, k: nm.Tensor, cfg: Config, slots, position, layer=None):
    """q and k rotated at their positions: 0..n-1 of a pass (or `position` over batch and
    length: the positions of packed examples, each from 0), or `position` in a cache of
    `slots` positions (None: no cache); by this layer's frequencies where `layer` (of
    `layer_constants`) has them."""
    n = x_len = q.size_of("length")
    if slots is not None:
        n = slots
        for rope in (cfg.rope, *cfg.parts.ropes):
            if depends_on_length(rope) and n > rope.original_positions:
                raise ConfigError(
                    f"rope kind {rope.kind!r} with a KV cache of {n} slots "
                    f"past original_positions={rope.original_positions}: its "
                    "frequencies change with the sequence, so cached keys would be stale"
                )
    if slots is None:  # a pass: 0..n-1, or each packed example's own (position over length)
        # 0..n-1 as NumPy values, so that the rotation's cos and sin tables (length,
        # d_kv) are constants (`_cos_sin`): from a traced iota XLA fused cos and sin into
        # each consumer and evaluated them per element of q and k, forward and backward
        # (batch x heads times over; the realistic Llama step took 1.06x as long)
        if position is None:
            at = np.arange(x_len, dtype=np.int32)
            q_at, k_at = nm.tensor(at, ("length",)), nm.tensor(at, ("memory",))
        else:
            q_at, k_at = position, _as_memory(position)
    else:
        q_at, k_at = position, _as_memory(position)
    if layer is not None and "inv_freq" in layer:
        inv, factor = layer["inv_freq"], layer["rope_factor"]
        return rotate(q, q_at, inv, factor), rotate(k, k_at, inv, factor)
    return rotary(q, q_at, cfg.rope, n), rotary(k, k_at, cfg.rope, n)


def _project(x: nm.Tensor, p: dict, name: str, out: tuple) -> nm.Tensor:
    y = nm.einsum(x, p[name], out=out)
    if name + "_lora_a" in p:  # a LoRA adapter beside the weight (models/layers/lora.py)
        y = y + lora.update(x, p, name, out)
    return y + p[name + "_bias"] if name + "_bias" in p else y


def project_kv(src: nm.Tensor, p: dict, cfg: Config, lead: tuple = ()) -> dict:
    """{"k", "v"}: the keys and values (*lead, batch, memory, heads or kv_heads, d_kv)
    of `src` (batch, memory, d_model) under the attention parameters `p`; `lead` names
    the parameters' extra dims (("layers",) projects for every layer of a stack at once:
    an encoder-decoder's cross-attention memory, projected once per encoding)."""
    out = (*lead, "batch", "memory", *head_sizes(cfg, kv=True), "d_kv")
    return {name: _project(src, p, name, out) for name in ("k", "v")}


class Attend(NamedTuple):
    """How one attention call attends, beside its input, parameters, config and bias:
    `bias_fn(queries, slots)`, the bias for query and memory positions (int Tensors over
    length and memory), which kernels build block by block; `layer`, this layer's
    constants in a stack whose layers differ (`layer_constants`: its rotary
    frequencies); `masks` (causal, window, masks_only), what `bias_fn` is known to hide
    and whether it is nothing more (models.layers.kernels.Options); `position`, the query
    positions: a cached call's (an int Tensor: 0-d or over batch for one new position
    per row, or 0..n-1 over length for a prefill of an empty cache), or a pass's
    rotary positions where they are not 0..n-1 (None: they are)."""

    bias_fn: Callable | None = None
    layer: dict | None = None
    masks: tuple[bool, int, bool] = (False, 0, False)
    position: nm.Tensor | None = None


PLAIN = Attend()


def queries_keys_values(x: nm.Tensor, p: dict, cfg: Config, source=None) -> tuple:
    """(q, k, v) of x (batch, length, d_model): keys and values of x itself (source None),
    of an encoder's output `source` (batch, memory, d_model), or `source` itself when it
    holds them already projected (`project_kv`'s {"k", "v"}); each head's queries and
    keys normed over d_kv where p has q/k norms (Qwen3)."""
    q = _project(x, p, "q", ("batch", "length", *head_sizes(cfg), "d_kv"))
    if isinstance(source, dict):
        kv = source
    else:
        kv = project_kv(x.rename(length="memory") if source is None else source, p, cfg)
    k, v = kv["k"], kv["v"]
    if "q_norm" in p:  # Qwen3: each head's queries and keys normed over d_kv, before rotary
        q = norm(q, p["q_norm"], head_norm_kind(cfg), cfg.norm_eps, "d_kv")
        k = norm(k, p["k_norm"], head_norm_kind(cfg), cfg.norm_eps, "d_kv")
    return q, k, v


def attend_kernel(qkv: tuple, p: dict, cfg: Config, opts: Options) -> nm.Tensor:
    """cfg.attention's kernel over (q, k, v) with `opts`, projected out to d_model."""
    o = kernel_for(cfg, opts, qkv[0].size_of("length"))(*qkv, opts)
    return _project(o, p, "o", ("batch", "length", "d_model"))


def options(cfg: Config, bias, how: Attend, cached: bool) -> Options:
    """The kernel options of one attention call of cfg's."""
    return Options(
        bias, how.bias_fn, cfg.attention_factor, cfg.parts.attention_softcap, cfg.attention_block,
        cached, *how.masks,
    )  # fmt: skip


def attention(
    x: nm.Tensor, p: dict, cfg: Config, bias=None, how: Attend = PLAIN, source=None
) -> nm.Tensor:
    """Multi-head attention of x (batch, length, d_model) over x itself, or over an
    encoder's `source` (cross-attention: its output (batch, memory, d_model), or its
    keys and values already projected by `project_kv`, as decoding keeps them), plus
    `bias` (any of batch, heads, length, memory) and `how`'s bias_fn and masks.
    Self-attention of a rotary config rotates queries and keys by their positions 0..n-1
    (by `how.layer`'s frequencies where it has them)."""
    q, k, v = queries_keys_values(x, p, cfg, source)
    if cfg.positions == "rotary" and source is None:
        q, k = rotate_qk(q, k, cfg, None, how.position, how.layer)
    return attend_kernel((q, k, v), p, cfg, options(cfg, bias, how, False))


def cached_attention(x: nm.Tensor, p: dict, cfg: Config, bias, how: Attend, cache: dict):
    """(out, {"k", "v"}): self-attention of x's positions `how.position` (`Attend`) over
    the KV cache ({"k", "v"}: batch, memory, heads or kv_heads, d_kv) after their keys
    and values are written into it there: attention runs over the whole cache."""
    q, k, v = queries_keys_values(x, p, cfg)
    if cfg.positions == "rotary":
        slots = cache["k"].size_of("memory")
        q, k = rotate_qk(q, k, cfg, slots, how.position, how.layer)
    k, v = write_cache(cache, k, v, how.position)
    return attend_kernel((q, k, v), p, cfg, options(cfg, bias, how, True)), {"k": k, "v": v}


# --- feed-forward ------------------------------------------------------------------
def gelu_exact(x: nm.Tensor) -> nm.Tensor:
    """GELU with the exact normal CDF, x * Phi(x) (BERT's "gelu"; nm.gelu is the tanh
    approximation, GPT-2's "gelu_new")."""
    return x * (0.5 + 0.5 * nm.erf(x * np.float32(0.5**0.5)))


_ACTIVATIONS = {"relu": nm.relu, "gelu": nm.gelu, "gelu_exact": gelu_exact, "silu": nm.silu}
_ALIASES = {"swiglu": "gated_silu", "geglu": "gated_gelu"}
FFN_KINDS = (*_ACTIVATIONS, *(f"gated_{a}" for a in _ACTIVATIONS), *_ALIASES)


def activation(ffn_kind: str):
    """(the activation function, whether the FFN is gated) of an `ffn` config value:
    relu, gelu (tanh approximation), gelu_exact, silu, or gated_<one of them> (a gated
    linear unit: act(x wi) * (x wg)); swiglu and geglu name gated_silu and gated_gelu."""
    name, gated = activation_name(ffn_kind)
    return _ACTIVATIONS[name], gated


def activation_name(ffn_kind: str) -> tuple[str, bool]:
    """(the activation's name, as `nm.grouped_ffn` takes it, whether the FFN is gated)
    of an `ffn` config value (`activation`)."""
    kind = _ALIASES.get(ffn_kind, ffn_kind)
    name = kind.removeprefix("gated_")
    if name not in _ACTIVATIONS:
        raise ConfigError(f"Config.ffn must be one of {', '.join(FFN_KINDS)}, got {ffn_kind!r}")
    return name, kind.startswith("gated_")


def ffn_params(cfg: Config) -> dict:
    d, f = cfg.d_model, cfg.d_ff
    _, gated = activation(cfg.ffn)
    p = {
        "wi": Param({"d_model": d, "d_ff": f}, d**-0.5),
        "wo": Param({"d_ff": f, "d_model": d}, f**-0.5),
    }
    if gated:
        p["wg"] = Param({"d_model": d, "d_ff": f}, d**-0.5)
    if cfg.bias:
        p["wi_bias"] = Param({"d_ff": f}, "zeros")
        p["wo_bias"] = Param({"d_model": d}, "zeros")
        if gated:
            p["wg_bias"] = Param({"d_ff": f}, "zeros")
    return p


def ffn(x: nm.Tensor, p: dict, cfg: Config) -> nm.Tensor:
    """d_model -> d_ff -> d_model with an activation, or a gated linear unit."""
    act, gated = activation(cfg.ffn)
    hidden = x.dims[:-1] + ("d_ff",)
    h = act(_project(x, p, "wi", hidden))
    if gated:
        h = h * _project(x, p, "wg", hidden)
    return _project(h, p, "wo", x.dims)


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
