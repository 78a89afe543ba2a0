"""Blockwise attention: softmax(scale * q.k + bias) v over key blocks with an online
softmax (Milakov & Gimelshein 2018; Rabe & Staats 2021), so the (length, memory) logits
are never whole: one `nm.scan` over `kblocks`, each step holding (length, block).

Written only in the namedmesh language: memory is reshaped into (kblocks, memory=block)
and scanned; the running maximum, sum and weighted values are the scan's carry, in
float32 whatever the compute dtype. The running maximum only steadies the exponentials
(the result does not depend on it), so it carries no gradient. As in FlashAttention,
the backward pass recomputes each block's logits (the scan's remat="full"). Under a
causal mask or a window, query blocks scan only the key blocks they see
(`visible_blocks`), skipping those the mask hides whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

import namedmesh as nm
from namedmesh.errors import ParameterError, ShapeError

_FLOOR = -1e30  # the running maximum before any key: exp(_FLOOR - m) is 0 for finite m
_MASK = -1e9  # the logit of a padded key slot, as models.layers.common.NEG masks positions


def _check(q: nm.Tensor, k: nm.Tensor, v: nm.Tensor, opts) -> int:
    """The key block size (opts.block, at most the memory), after checking opts, dims and
    sizes."""
    if not isinstance(opts, Options):
        raise ParameterError(
            f"attention's opts must be models.layers.blockwise.Options(bias, bias_fn, scale, ...), "
            f"got {type(opts).__name__}"
        )
    bias, block = opts.bias, opts.block
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
    block = min(int(block), k.size_of("memory"))
    if block < 1:
        raise ShapeError(
            f"blockwise_attend: block {block} must be positive "
            "(attention_block in the config, --attention-block)"
        )
    return block


def _pad_memory(k: nm.Tensor, v: nm.Tensor, bias, block: int):
    """(k, v, bias, hide) with memory padded up to a multiple of `block`: zero keys and
    values, and `hide` (over memory, None without padding) a mask bias on the padded
    slots, so a length that `block` does not divide gives the unpadded result."""
    n = k.size_of("memory")
    extra = -n % block
    if not extra:
        return k, v, bias, None
    fill = {"memory": (0, extra)}
    k, v = nm.pad(k, fill), nm.pad(v, fill)
    if bias is not None and "memory" in bias.dims:
        bias = nm.pad(bias, fill)
    hide = nm.where(nm.arange("memory", n + extra) < n, 0.0, np.float32(_MASK))
    return k, v, bias, hide


def _blocks(t: nm.Tensor, nblocks: int, block: int) -> nm.Tensor:
    """t with memory split into (kblocks, memory=block)."""
    return nm.reshape(t, {"kblocks": nblocks, "memory": block}, from_="memory")


def _key_blocks(k: nm.Tensor, v: nm.Tensor, bias, block: int, slots: bool, multiple: int = 0):
    """({"k", "v"; "slots": the key positions when `slots`; "bias": bias's memory part;
    "hide": the padding mask}, each split into (kblocks, memory=block), and the bias
    with memory padded to a multiple of `multiple` (of `block` by default, to which
    `multiple` must be a multiple)), the keys' side of a blockwise scan."""
    k, v, bias, hide = _pad_memory(k, v, bias, multiple or block)
    n = k.size_of("memory")
    xs = {"k": _blocks(k, n // block, block), "v": _blocks(v, n // block, block)}
    if slots:
        xs["slots"] = _blocks(nm.arange("memory", n), n // block, block)
    if bias is not None and "memory" in bias.dims:
        xs["bias"] = _blocks(bias, n // block, block)
    if hide is not None:
        xs["hide"] = _blocks(hide, n // block, block)
    return xs, bias


def _init(q: nm.Tensor, dims: tuple[str, ...]):
    """(running maximum, running sum, weighted values) before any key, in float32."""
    sizes = {d: q.size_of(d) for d in dims}
    return (
        nm.full(sizes, _FLOOR, np.float32),
        nm.zeros(sizes, np.float32),
        nm.zeros(q.sizes, np.float32),
    )


def _absorb(stats, q: nm.Tensor, kv: dict, biases, opts: Options):
    """The online softmax's statistics after the keys kv["k"] and values kv["v"] of one
    block, with the additive `biases` (Tensors or None) of that block; logits scaled by
    opts.scale and soft-capped to cap * tanh(logits / cap) before the biases when
    opts.softcap > 0."""
    m, total, acc = stats
    k, v, scale, cap = kv["k"], kv["v"], opts.scale, opts.softcap
    logit_dims = tuple(d for d in q.dims if d != "d_kv") + ("memory",)
    # the block's logits in the order their dot writes them (no transposed copy)
    logit_dims = nm.einsum_order(q, k, logit_dims)
    s = nm.einsum(q, k, out=logit_dims, preferred_element_type=np.float32) * scale
    if cap:
        s = softcap(s, cap)
    for b in biases:
        s = s if b is None else s + b
    m_new = nm.maximum(m, nm.stop_gradient(nm.max(s, "memory")))
    p = nm.exp(s - m_new)
    fade = nm.exp(m - m_new)
    pv = nm.einsum(nm.astype(p, v.dtype), v, out=q.dims, preferred_element_type=np.float32)
    return m_new, total * fade + p.sum("memory"), acc * fade + pv


def softcap(logits: nm.Tensor, cap: float) -> nm.Tensor:
    """cap * tanh(logits / cap): logits squashed into (-cap, cap) (Gemma 2)."""
    return nm.tanh(logits * np.float32(1 / cap)) * np.float32(cap)


def _result(stats, dtype) -> nm.Tensor:
    _, total, acc = stats
    out = acc / total
    return out if dtype == np.float32 else nm.astype(out, dtype)


BiasFn = Callable[[nm.Tensor, nm.Tensor], "nm.Tensor | None"]


class Options(NamedTuple):
    """What one attention call asks of its kernel (models/layers/kernels.py)."""

    bias: nm.Tensor | None = None
    bias_fn: BiasFn | None = None
    scale: float = 1.0
    softcap: float = 0.0
    block: int = 128
    cached: bool = False  # q attends over a KV cache (prefill or a decoding step)
    # what bias_fn's mask hides (self-attention): keys after each query, keys `window`
    # or more before it; kernels may skip what it hides whole, never apply it twice
    causal: bool = False
    window: int = 0
    masks_only: bool = False  # bias_fn is those masks and nothing more (no learned bias)


def blockwise_attend(q: nm.Tensor, k: nm.Tensor, v: nm.Tensor, opts: Options) -> nm.Tensor:
    """softmax over memory of scale * q.k (soft-capped: `opts.softcap` > 0) + bias, times
    v, a block of `opts.block` keys at a time (a memory that the block does not divide
    is padded with masked slots): q (..., length, d_kv), k and v (..., memory, d_kv),
    other dims matched by name; `opts.bias` has any of the logits' dims (q's other dims,
    length, memory). Equal to full attention (models.layers.common.attend); the result has q's
    dims and v's dtype.

    `bias_fn(queries, slots)`, given the query positions (an int Tensor over length) and
    the memory positions of one block (over memory), returns more bias for that block
    (or None): a causal mask or relative positions, never whole either.

    `causal` and `window` (self-attention: length == memory) say what `bias_fn`'s mask
    hides, keys after the query and keys `window` or more before it: then queries are
    cut into blocks too and each query block scans only the key blocks it can see
    (`visible_blocks`), the lower triangle of (query block, key block) pairs or its
    band. Skipped blocks are ones the mask hides whole, so the result is the same."""
    block = _check(q, k, v, opts)
    bias, bias_fn = opts.bias, opts.bias_fn
    if (opts.causal or opts.window) and q.size_of("length") == k.size_of("memory"):
        return _triangle(q, k, v, opts, block)
    xs, bias = _key_blocks(k, v, bias, block, bias_fn is not None)
    queries = nm.arange("length", q.size_of("length"))
    fixed = bias if bias is not None and "memory" not in bias.dims else None

    def step(stats, x):
        more = None if bias_fn is None else bias_fn(queries, x["slots"])
        biases = (x.get("bias"), fixed, more, x.get("hide"))
        return _absorb(stats, q, x, biases, opts), None

    # each block's logits are recomputed in the backward pass, not kept: else the
    # backward pass would hold all of them, the (length, memory) matrix again
    init = _init(q, tuple(d for d in q.dims if d != "d_kv"))
    stats, _ = nm.scan(step, init, xs, "kblocks", remat="full")
    return _result(stats, v.dtype)


# At most this many query blocks (each one scan in the program, so compile time grows
# with them): a long sequence's query blocks hold several key blocks each
QUERY_BLOCKS = 8


def visible_blocks(i: int, rows: int, block: int, nblocks: int, causal: bool, window: int):
    """The key blocks (of `block` keys, `nblocks` of them) that query block i (of `rows`
    queries) sees, as a range: those holding a key at or before its last query (causal)
    and after its first query less `window` (window > 0); the rest are hidden whole."""
    lo = max(0, (i * rows - window + 1) // block) if window else 0
    hi = min(nblocks, ((i + 1) * rows - 1) // block + 1) if causal else nblocks
    return range(lo, hi)


def _triangle(q, k, v, opts: Options, block: int) -> nm.Tensor:
    """blockwise_attend over the (query block, key block) pairs the mask does not hide
    whole: per query block one scan over its `visible_blocks`, so the work is the
    triangle (or band) of the (length, memory) square, not all of it. Query blocks hold
    `block` queries, or a multiple of it, so that there are at most QUERY_BLOCKS."""
    bias, bias_fn, causal, window = opts.bias, opts.bias_fn, opts.causal, opts.window
    n = q.size_of("length")
    rows = block * math.ceil(math.ceil(n / block) / QUERY_BLOCKS)
    if extra := -n % rows:  # queries padded as the keys are
        q = nm.pad(q, {"length": (0, extra)})
        if bias is not None and "length" in bias.dims:
            bias = nm.pad(bias, {"length": (0, extra)})
    xs, bias = _key_blocks(k, v, bias, block, bias_fn is not None, rows)
    nblocks = xs["k"].size_of("kblocks")
    stat_dims = tuple(d for d in q.dims if d != "d_kv")
    fixed = bias if bias is not None and "memory" not in bias.dims else None
    outs = []
    for i in range((n + extra) // rows):
        part = lambda t, i=i: _rows(t, i * rows, (i + 1) * rows)
        seen = visible_blocks(i, rows, block, nblocks, causal, window)
        xi = {name: part(nm.slice(t, "kblocks", seen.start, seen.stop)) for name, t in xs.items()}
        qi, queries, own = part(q), part(nm.arange("length", n + extra)), part(fixed)

        def step(stats, x, qi=qi, queries=queries, own=own):
            more = None if bias_fn is None else bias_fn(queries, x["slots"])
            biases = (x.get("bias"), own, more, x.get("hide"))
            return _absorb(stats, qi, x, biases, opts), None

        stats, _ = nm.scan(step, _init(qi, stat_dims), xi, "kblocks", remat="full")
        outs.append(_result(stats, v.dtype))
    out = nm.concat(outs, "length") if len(outs) > 1 else outs[0]
    return nm.slice(out, "length", 0, n) if extra else out


def _rows(t, start: int, stop: int):
    """t's queries start..stop-1 where t has length (None and others as they are)."""
    return nm.slice(t, "length", start, stop) if t is not None and "length" in t.dims else t


def ring_attend(
    q: nm.Tensor, k: nm.Tensor, v: nm.Tensor, opts: Options, ring: int = 2
) -> nm.Tensor:
    """Blockwise attention whose key/value blocks travel: q's length and k's and v's
    memory are cut into `ring` blocks along a new dim `ring`; at each of `ring` steps
    query block i attends to the key block it holds, then every key/value block moves
    one place along `ring` (`nm.shift(..., wrap=True)`). A layout that splits `ring`
    over a mesh axis of `ring` devices (`"ring:rows;length:rows;memory:rows"`) keeps
    each device's queries and sends its keys and values to the next device by one
    ppermute per step: (ring-1)/ring of them per device, never all of them at once.
    Same contract and result as `blockwise_attend` (`opts.block` aside: the blocks are
    the ring's); `opts.bias` must not hold both length and memory (pass `bias_fn`)."""
    # the ring's blocks are its own (`ring`): opts.block is not read here
    _check(q, k, v, opts if not isinstance(opts, Options) else opts._replace(block=1))
    bias, bias_fn = opts.bias, opts.bias_fn
    n_q, n_k = q.size_of("length"), k.size_of("memory")
    if ring < 1 or n_q % ring or n_k % ring:
        raise ShapeError(
            f"ring_attend: ring {ring} must divide length={n_q} and memory={n_k} (the model's "
            "ring is memory // attention_block: choose --attention-block so that it does)"
        )
    if bias is not None and {"length", "memory"} <= set(bias.dims):
        raise ShapeError("ring_attend: a bias over both length and memory: pass bias_fn")
    cut = lambda t, dim: nm.reshape(t, {"ring": ring, dim: t.size_of(dim) // ring}, from_=dim)
    qr = cut(q, "length")
    queries = cut(nm.arange("length", n_q), "length")
    moving = {
        "k": cut(k, "memory"),
        "v": cut(v, "memory"),
        "slots": cut(nm.arange("memory", n_k), "memory"),
    }
    if bias is not None and "memory" in bias.dims:
        moving["bias"] = cut(bias, "memory")
    fixed = None if bias is None or "memory" in bias.dims else bias
    if fixed is not None and "length" in fixed.dims:
        fixed = cut(fixed, "length")

    def absorb(stats, kv):
        more = None if bias_fn is None else bias_fn(queries, kv["slots"])
        biases = (kv.get("bias"), fixed, more)
        return _absorb(stats, qr, kv, biases, opts)

    def step(carry, _):
        stats, kv = carry
        stats = absorb(stats, kv)
        return (stats, {name: nm.shift(t, "ring", 1, wrap=True) for name, t in kv.items()}), None

    stats = _init(qr, tuple(d for d in qr.dims if d != "d_kv"))
    if ring > 1:  # ring - 1 moves: the last block is absorbed where it arrives
        (stats, moving), _ = nm.scan(step, (stats, moving), (), "ring_step", ring - 1, "full")
    out = _result(absorb(stats, moving), v.dtype)
    return nm.reshape(out, {"length": n_q}, from_="ring length").transpose(*q.dims)
