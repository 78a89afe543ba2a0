"""Blockwise attention: softmax(scale * q.k + bias) v over key blocks with an online
softmax (Milakov & Gimelshein 2018; Rabe & Staats 2021), so the (length, memory) logits
are never whole: one `nm.scan` over `kblocks`, each step holding (length, block).

Written only in the namedmesh language: memory is reshaped into (kblocks, memory=block)
and scanned; the running maximum, sum and weighted values are the scan's carry, in
float32 whatever the compute dtype. The running maximum only steadies the exponentials
(the result does not depend on it), so it carries no gradient. As in FlashAttention,
the backward pass recomputes each block's logits (the scan's remat="full").
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

import namedmesh as nm
from namedmesh.errors import ShapeError

_FLOOR = -1e30  # the running maximum before any key: exp(_FLOOR - m) is 0 for finite m


def _check(q: nm.Tensor, k: nm.Tensor, v: nm.Tensor, bias, block: int) -> int:
    """The key block size (at most the memory), after checking dims and sizes."""
    for name, t, need in (("q", q, ("length", "d_kv")), ("k", k, ("memory", "d_kv"))):
        if missing := [d for d in need if d not in t.dims]:
            raise ShapeError(f"blockwise_attend: {name} {t.dims} lacks dim(s) {missing}")
    if k.dims != v.dims or k.shape != v.shape:
        raise ShapeError(f"blockwise_attend: k {k.sizes} and v {v.sizes} differ")
    extra = [d for d in k.dims if d not in q.dims and d != "memory"]
    if extra:
        raise ShapeError(f"blockwise_attend: k's dim(s) {extra} are not dims of q {q.dims}")
    logit_dims = {d for d in q.dims if d != "d_kv"} | {"memory"}
    if bias is not None and (stray := [d for d in bias.dims if d not in logit_dims]):
        raise ShapeError(
            f"blockwise_attend: bias dim(s) {stray} are none of the logits' {sorted(logit_dims)}"
        )
    n, block = k.size_of("memory"), min(int(block), k.size_of("memory"))
    if block < 1 or n % block:
        raise ShapeError(
            f"blockwise_attend: block {block} must be positive and divide memory={n} "
            "(attention_block in the config)"
        )
    return block


def _blocks(t: nm.Tensor, nblocks: int, block: int) -> nm.Tensor:
    """t with memory split into (kblocks, memory=block)."""
    return nm.reshape(t, {"kblocks": nblocks, "memory": block}, from_="memory")


def blockwise_attend(
    q: nm.Tensor,
    k: nm.Tensor,
    v: nm.Tensor,
    bias=None,
    scale: float = 1.0,
    block: int = 128,
    bias_fn: Callable[[nm.Tensor], nm.Tensor] | None = None,
) -> nm.Tensor:
    """softmax over memory of scale * q.k + bias, times v, a block of `block` keys at a
    time: q (..., length, d_kv), k and v (..., memory, d_kv), other dims matched by name;
    `bias` has any of the logits' dims (q's other dims, length, memory). Equal to full
    attention (models.layers.attend); the result has q's dims and v's dtype.

    `bias_fn(slots)`, given the memory positions of one block (an int Tensor over
    memory), returns more bias for that block (or None) (a causal mask, relative positions), so
    that no (length, memory) bias is ever whole either."""
    block = _check(q, k, v, bias, block)
    nblocks = k.size_of("memory") // block
    f32 = np.float32
    stat_dims = tuple(d for d in q.dims if d != "d_kv")
    logit_dims = stat_dims + ("memory",)
    xs = {"k": _blocks(k, nblocks, block), "v": _blocks(v, nblocks, block)}
    if bias_fn is not None:
        xs["slots"] = _blocks(nm.arange("memory", k.size_of("memory")), nblocks, block)
    if bias is not None and "memory" in bias.dims:
        xs["bias"] = _blocks(bias, nblocks, block)
    fixed_bias = bias if bias is not None and "memory" not in bias.dims else None
    sizes = {d: q.size_of(d) for d in stat_dims}
    init = (
        nm.full(sizes, _FLOOR, f32),
        nm.zeros(sizes, f32),
        nm.zeros(q.sizes, f32),
    )

    def step(carry, x):
        m, total, acc = carry
        s = nm.einsum(q, x["k"], out=logit_dims, preferred_element_type=f32) * scale
        s = s + x["bias"] if "bias" in x else s
        s = s + fixed_bias if fixed_bias is not None else s
        more = None if bias_fn is None else bias_fn(x["slots"])
        s = s if more is None else s + more
        m_new = nm.maximum(m, nm.stop_gradient(nm.max(s, "memory")))
        p = nm.exp(s - m_new)
        fade = nm.exp(m - m_new)
        total = total * fade + p.sum("memory")
        pv = nm.einsum(nm.astype(p, v.dtype), x["v"], out=q.dims, preferred_element_type=f32)
        return (m_new, total, acc * fade + pv), None

    # each block's logits are recomputed in the backward pass, not kept: else the
    # backward pass would hold all of them, the (length, memory) matrix again
    (_, total, acc), _ = nm.scan(step, init, xs, "kblocks", remat="full")
    out = acc / total
    return out if v.dtype == f32 else nm.astype(out, v.dtype)
