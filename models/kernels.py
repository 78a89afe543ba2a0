"""Attention kernels by name (Config.attention), MaxText style: each entry is one
function `kernel(q, k, v, opts) -> out` with one signature, and the options of
`Options` it does not implement, so asking for one is a ConfigError naming both
(models.layers.kernel_for), never a fallback to another kernel.

What every kernel honours through `opts`: an additive `bias` (padding masks, T5's
relative bias), `bias_fn(queries, slots)` (causal masks, sliding windows and learned
relative biases, built from positions block by block), the query `scale`, and grouped
query heads (kv_heads, q_per_kv are matched by name). `softcap` (logits ->
cap * tanh(logits / cap)) and running over a KV cache are declared per kernel.
A fused kernel (jax.nn.dot_product_attention where the dims are local) is one more row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

import namedmesh as nm
from models.attention import blockwise_attend, ring_attend


class Options(NamedTuple):
    """What one attention call asks of its kernel."""

    bias: nm.Tensor | None = None
    bias_fn: Callable | None = None
    scale: float = 1.0
    softcap: float = 0.0
    block: int = 128
    cached: bool = False  # q attends over a KV cache (prefill or a decoding step)


def full(q: nm.Tensor, k: nm.Tensor, v: nm.Tensor, opts: Options) -> nm.Tensor:
    """softmax over memory of (capped) scale * q.k + bias, applied to v: the whole
    (length, memory) logits at once. Logits and softmax are float32; the result has
    q's dims and v's dtype."""
    bias = opts.bias
    if opts.bias_fn is not None:
        slots = nm.arange("memory", k.size_of("memory"))
        more = opts.bias_fn(nm.arange("length", q.size_of("length")), slots)
        if more is not None:
            bias = more if bias is None else bias + more
    rest = [d for d in q.dims if d not in ("length", "d_kv")]
    rest += [d for d in k.dims if d not in rest and d not in ("memory", "d_kv")]
    logits = nm.einsum(q, k, out=(*rest, "length", "memory"), preferred_element_type=np.float32)
    if opts.scale != 1.0:
        logits = logits * opts.scale
    if opts.softcap:
        logits = nm.tanh(logits * np.float32(1 / opts.softcap)) * np.float32(opts.softcap)
    if bias is not None:
        logits = logits + bias
    weights = nm.astype(nm.softmax(logits, "memory"), v.dtype)
    return nm.einsum(weights, v, out=q.dims)


def blockwise(q: nm.Tensor, k: nm.Tensor, v: nm.Tensor, opts: Options) -> nm.Tensor:
    """models.attention.blockwise_attend: keys in blocks of `opts.block`, online softmax."""
    return blockwise_attend(q, k, v, opts.bias, opts.scale, opts.block, opts.bias_fn)


def ring(q: nm.Tensor, k: nm.Tensor, v: nm.Tensor, opts: Options) -> nm.Tensor:
    """models.attention.ring_attend over memory // block ring steps."""
    n = k.size_of("memory")
    steps = n // min(opts.block, n)
    return ring_attend(q, k, v, opts.bias, opts.scale, steps, opts.bias_fn)


class Kernel(NamedTuple):
    """An attention kernel and the options (fields of Options) it refuses, with why."""

    fn: Callable
    refuses: dict


_NO_SOFTCAP = "logit soft-capping (Config.attention_softcap) is not in its online softmax"
KERNELS: dict[str, Kernel] = {
    "full": Kernel(full, {}),
    "blockwise": Kernel(blockwise, {"softcap": _NO_SOFTCAP}),
    "ring": Kernel(
        ring,
        {
            "softcap": _NO_SOFTCAP,
            "cached": "a KV cache (decoding) has no sequence of keys to pass around the ring; "
            "decode with attention='full' or 'blockwise'",
        },
    ),
}
