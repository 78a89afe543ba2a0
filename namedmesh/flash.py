"""A FlashAttention-2-style attention kernel in plain jax.numpy, with its own backward
pass (`jax.custom_vjp`), for XLA:CPU where jax.nn.dot_product_attention's XLA
implementation makes the whole (length, memory) logits.

Queries go in row blocks of `block` (a static Python loop); each block meets at once
all the keys any of its rows can see (under a causal mask the keys up to the block's
end, under a window none before the band), so the (block, memory) logits are the
largest array and memory grows linearly in length. The softmax of a row block is exact
(no online rescaling: its keys are all there); the forward pass keeps the output and
each row's logsumexp, the backward pass recomputes p = exp(s - lse) block by block
(FlashAttention-2's recurrence, dd = rowsum(dO * O)), accumulating dk and dv.

Layouts: q (kv_heads, group, length, d), k and v (kv_heads, memory, d): grouped query
heads share their k and v without repeating them. bias (kv_heads, group, length or 1,
memory), its gradient computed too (T5's learned relative bias). Everything is float32
(callers cast). Why the shapes of the products are as they are: XLA:CPU runs a batched
dot that contracts the row dim of both operands ("gqm,gqd->gmd", dk's and dv's natural
form) 2-4x slower than the same product with its output transposed ("gqm,gqd->gdm"),
so dk and dv are accumulated transposed, (kv_heads, d, memory), and swapped once.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

NEG = -1e30  # a hidden logit: exp(NEG - max) is 0 for any row that sees a key


def block_for(length: int) -> int:
    """Rows per block, measured single-threaded on CPU (benchmarks/attention_kernels.py):
    256 up to 4k keys; beyond, fewer rows, so a (block, memory) row block stays near
    4 MiB per head."""
    return min(256, max(64, 2**20 // max(length, 1)))


def _blocks(n: int, m: int, block: int, causal: bool, window: int):
    """(row start, row end, key start, key end) of each row block: the keys some row of
    it can see (query i sees keys i - window + 1 .. i when causal and windowed)."""
    out = []
    for s in range(0, n, block):
        e = min(n, s + block)
        k0 = max(0, s - window + 1) if window else 0
        k1 = e if causal else m
        out.append((s, e, k0, k1))
    return out


def _masked(sc, s, e, k0, k1, causal, window):
    """The logits of rows s..e over keys k0..k1 with the keys a row cannot see set to
    NEG; only the columns where some row of the block is cut are touched (the diagonal
    square, the window's lower edge)."""
    spans = []
    if causal:
        spans.append((max(s, k0), k1))
    if window:
        spans.append((k0, min(k1, max(k0, e - window + 1))))
    for a, b in spans:
        if a >= b:
            continue
        i, j = np.arange(s, e)[:, None], np.arange(a, b)[None, :]
        ok = np.ones((e - s, b - a), bool)
        if causal:
            ok &= j <= i
        if window:
            ok &= j > i - window
        if ok.all():
            continue
        part = sc[..., a - k0 : b - k0]
        sc = sc.at[..., a - k0 : b - k0].set(jnp.where(ok, part, NEG))
    return sc


def _logits(qs, k, bias, blk, causal, window):
    """scale * q.k (+ bias), masked, of one row block: (kv_heads, group, rows, keys)."""
    s, e, k0, k1 = blk
    sc = jnp.einsum("hgqd,hmd->hgqm", qs[:, :, s:e], k[:, k0:k1])
    if bias is not None:
        rows = slice(s, e) if bias.shape[2] > 1 else slice(None)
        sc = sc + bias[:, :, rows, k0:k1]
    return _masked(sc, s, e, k0, k1, causal, window)


def _forward(q, k, v, bias, scale, causal, window, block):
    """The output (kv_heads, group, length, d) and each row's logsumexp."""
    qs = q * scale
    outs, lses = [], []
    for blk in _blocks(q.shape[2], k.shape[1], block, causal, window):
        sc = _logits(qs, k, bias, blk, causal, window)
        mx = sc.max(-1, keepdims=True)
        p = jnp.exp(sc - mx)
        total = p.sum(-1, keepdims=True)
        outs.append(jnp.einsum("hgqm,hmd->hgqd", p, v[:, blk[2] : blk[3]]) / total)
        lses.append(mx + jnp.log(total))
    return jnp.concatenate(outs, 2), jnp.concatenate(lses, 2)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def attention(q, k, v, bias, scale: float, causal: bool, window: int, block: int):
    """softmax(scale * q.k + bias, masked) v: q (kv_heads, group, length, d), k and v
    (kv_heads, memory, d), bias None or (kv_heads, group, length or 1, memory); float32."""
    return _forward(q, k, v, bias, scale, causal, window, block)[0]


def _attention_fwd(q, k, v, bias, scale, causal, window, block):
    out, lse = _forward(q, k, v, bias, scale, causal, window, block)
    return out, (q, k, v, bias, out, lse)


def _attention_bwd(scale, causal, window, block, res, dout):
    q, k, v, bias, out, lse = res
    qs = q * scale
    dd = (dout * out).sum(-1, keepdims=True)
    h, d, m = k.shape[0], k.shape[2], k.shape[1]
    dkt = jnp.zeros((h, d, m), k.dtype)  # transposed: see the module's docstring
    dvt = jnp.zeros((h, d, m), v.dtype)
    dq, dbias = [], None if bias is None else jnp.zeros(bias.shape, bias.dtype)
    for blk in _blocks(q.shape[2], m, block, causal, window):
        s, e, k0, k1 = blk
        p = jnp.exp(_logits(qs, k, bias, blk, causal, window) - lse[:, :, s:e])
        do = dout[:, :, s:e]
        dvt = dvt.at[:, :, k0:k1].add(jnp.einsum("hgqm,hgqd->hdm", p, do))
        dp = jnp.einsum("hgqd,hmd->hgqm", do, v[:, k0:k1])
        ds = p * (dp - dd[:, :, s:e])  # the logits' gradient
        dq.append(jnp.einsum("hgqm,hmd->hgqd", ds, k[:, k0:k1]) * scale)
        dkt = dkt.at[:, :, k0:k1].add(jnp.einsum("hgqm,hgqd->hdm", ds, qs[:, :, s:e]))
        if bias is not None:
            if bias.shape[2] > 1:
                dbias = dbias.at[:, :, s:e, k0:k1].set(ds)
            else:
                dbias = dbias.at[:, :, :, k0:k1].add(ds.sum(2, keepdims=True))
    dk, dv = jnp.swapaxes(dkt, 1, 2), jnp.swapaxes(dvt, 1, 2)
    return jnp.concatenate(dq, 2), dk, dv, dbias


attention.defvjp(_attention_fwd, _attention_bwd)
