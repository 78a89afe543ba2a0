"""Attention kernels by name (Config.attention), MaxText style: each entry is one
function `kernel(q, k, v, opts) -> out` with one signature, and the options of
`Options` it does not implement, so asking for one is a ConfigError naming both
(models.layers.common.kernel_for), never a fallback to another kernel.

What every kernel honours through `opts`: an additive `bias` (padding masks, T5's
relative bias; ring attention refuses one over both length and memory, the mask of
packed examples), `bias_fn(queries, slots)` (causal masks, sliding windows and learned
relative biases, built from positions block by block), the query `scale`, `softcap`
(logits -> cap * tanh(logits / cap), before the bias), and grouped query heads
(kv_heads, q_per_kv are matched by name). Running over a KV cache is declared per
kernel.
The fused kernel (nm.dot_product_attention, where length, memory and d_kv are local to a
device: cuDNN's kernel on GPU, namedmesh.flash's row blocks for long sequences on CPU)
applies the causal mask and window itself and refuses other positional biases and
soft-caps.

"auto" (Config.attention's default) is no kernel of its own: `choose` resolves it where
the length is known (models.layers.common.kernel_for) to the fused kernel for long
sequences, where it was measured faster than full attention and is linear in memory,
and to full attention otherwise (short sequences, decoding over a cache, options the
fused kernel refuses, a layout that splits the queries' length: the fused kernel's rule
would gather the whole sequence on every device, where full attention's einsums keep
the queries split). It is not in KERNELS, so plan search (models/cli/plan.py) never
searches the same kernel twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

import namedmesh as nm
from models.layers.blockwise import Options, blockwise_attend, ring_attend, softcap


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
    # the logits in the order their dot writes them (batch and kv heads, then q's length
    # and query heads, then memory): the mask, softmax and PV read them by name, and
    # (heads, length, memory) would be a transposed copy of the largest value here,
    # forward and backward
    order = nm.einsum_order(q, k, (*rest, "length", "memory"))
    logits = nm.einsum(q, k, out=order, preferred_element_type=np.float32)
    if opts.scale != 1.0:
        logits = logits * opts.scale
    if opts.softcap:
        logits = softcap(logits, opts.softcap)
    if bias is not None:
        logits = logits + bias
    weights = nm.astype(nm.softmax(logits, "memory"), v.dtype)
    # out in the weights' order, then q's: a plain batched matmul for XLA:CPU; with q's
    # order as the einsum's output it contracted both operands' row dims, about 10x the
    # time of a decoding step's attention at 8 rows
    order = nm.einsum_order(weights, v, (*rest, "length", "d_kv"))
    return nm.einsum(weights, v, out=order).transpose(*q.dims)


def blockwise(q: nm.Tensor, k: nm.Tensor, v: nm.Tensor, opts: Options) -> nm.Tensor:
    """models.layers.blockwise.blockwise_attend: keys in blocks of `opts.block`, online softmax;
    under a causal mask or a window, only the key blocks each query block sees."""
    return blockwise_attend(q, k, v, opts)


def ring(q: nm.Tensor, k: nm.Tensor, v: nm.Tensor, opts: Options) -> nm.Tensor:
    """models.layers.blockwise.ring_attend over memory // block ring steps."""
    n = k.size_of("memory")
    steps = n // min(opts.block, n)
    return ring_attend(q, k, v, opts, steps)


def fused(q: nm.Tensor, k: nm.Tensor, v: nm.Tensor, opts: Options) -> nm.Tensor:
    """nm.dot_product_attention (cuDNN's fused kernel on GPU; on CPU namedmesh.flash's
    row blocks from namedmesh.attention.FLASH_FROM tokens, memory linear in length, and
    XLA's below): it applies the causal mask and window of `opts` itself, so bias_fn
    must be those masks alone (`masks_only`); the lowering keeps length, memory and d_kv
    local to each device."""
    o = opts
    return nm.dot_product_attention(
        q, k, v, o.bias, scale=o.scale, causal=o.causal, window=o.window
    )


class Kernel(NamedTuple):
    """An attention kernel and the options (fields of Options) it refuses, with why."""

    fn: Callable
    refuses: dict


KERNELS: dict[str, Kernel] = {
    "full": Kernel(full, {}),
    "blockwise": Kernel(blockwise, {}),
    "ring": Kernel(
        ring,
        {
            "cached": "a KV cache (decoding) has no sequence of keys to pass around the ring; "
            "decode with attention='full' or 'blockwise'",
            "pairwise": "the ring passes each key block around with its memory bias alone, not "
            "a bias over queries and keys (packed examples' mask, models/training/chat.py); use "
            "attention='full', 'blockwise' or 'fused'",
        },
    ),
    "fused": Kernel(
        fused,
        {
            "softcap": "jax.nn.dot_product_attention has no soft-cap of the logits; "
            "use attention='full' or 'blockwise'",
            "positional": "a bias computed from positions beyond a causal mask and one "
            "window for every layer (Config.relative_bias's learned bias of distances, "
            "per-layer windows) is not one jax.nn.dot_product_attention takes; use "
            "attention='blockwise'",
        },
    ),
}


# The shortest self-attention "auto" runs the fused kernel at (namedmesh.flash's row
# blocks on CPU from namedmesh.attention.FLASH_FROM, 512, too): the GPT-2 training step
# of benchmarks/long_seq.py (4 layers, d_model 256, 4 heads, batch 1), single-threaded
# by CPU time on the suite's Xeon, took full / fused seconds 0.172 / 0.163 at 512
# tokens, 0.443 / 0.357 at 1024, 1.18 / 0.867 at 2048 (blockwise, 256-key blocks:
# 0.161, 0.393, 0.941); docs/benchmarks.md, "Long context: the kernel chosen by length"
FUSED_FROM = 512
AUTO = "auto"


def choose(length: int, asks: dict) -> str:
    """The kernel "auto" runs for `length` queries: "fused" from FUSED_FROM tokens of
    self-attention, unless the call asks for something the fused kernel refuses (`asks`:
    option name -> asked, as models.layers.common.kernel_for reads them from Options);
    else "full", which implements every option. Over a KV cache (a prefill) the keys are
    the cache's slots, not the queries, where the fused kernel on CPU makes the whole
    logits as full attention does: "full". Where the layout being lowered splits the
    queries' length (`asks["split"]`, sequence parallelism) the fused kernel would
    gather it whole on every device: "full"."""
    refused = any(asks.get(option) for option in (*KERNELS["fused"].refuses, "cached", "split"))
    return "fused" if length >= FUSED_FROM and not refused else "full"
