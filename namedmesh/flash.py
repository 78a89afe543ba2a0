"""A FlashAttention-2-style attention kernel in plain jax.numpy, with its own backward
pass (`jax.custom_vjp`), for XLA:CPU where jax.nn.dot_product_attention's XLA
implementation makes the whole (length, memory) logits.

Queries go in row blocks of `block` (a static Python loop), each against the keys any
of its rows can see (under a causal mask the keys up to the block's end, under a window
none before the band), so the logits are never whole. Under a causal mask a row's
softmax is shifted by its logit against its own key, known before the keys are seen,
so a block's keys go in tiles (`_tiles`) whose sums just add up; without one, a block
meets all its keys at once, shifted by each row's max. Either way the softmax is exact
(no online rescaling): a block whose sums or products the shift may have spoiled
(`_trusted`, with its proof) is computed again, normalized as XLA's softmax. The
forward pass keeps the output and each row's shift and log-sum, the backward pass
recomputes the probabilities tile by tile as exp(logit - lse) (FlashAttention-2's
recurrence, dd = rowsum(dO * O)), accumulating dk and dv; a causal call whose exp tiles
fit in KEEP_BUDGET keeps them from the forward pass instead (`keeps`): no second logits
product or exp, memory quadratic in length up to that budget, linear past it. Masks are
aligned at the first query and key when length != memory, as jax's are.

Layouts: q (kv_heads, group, length, d), k and v (kv_heads, memory, d): grouped query
heads share their k and v without repeating them. bias (kv_heads, group, length or 1,
memory), its gradient computed too (T5's learned relative bias). Everything is float32
(callers cast). The shapes of the products follow XLA:CPU (jaxlib 0.10, dots by
YNNPACK): each dot is its own YNNPACK kernel and each exp an elementwise loop between
two of them (no flag fuses them faster), so the kernel's time is its dots' and two
passes over each tile (docs/benchmarks.md "The fused kernel's speed"); a batched dot
that contracts the row dim of both operands ("gqm,gqd->gmd") runs 2x slower than the
same product with its output transposed ("gmd,gmq->gdq"), so the backward pass works
on transposed logits (keys, rows), where dk and dv are plain products and dq the fast
transposed one; from kept tiles (rows, keys) it makes dk and dv transposed, (d, keys),
and dq plain. benchmarks/attention_kernels.py times it against PyTorch's SDPA.
"""

from __future__ import annotations

from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np

NEG = -1e30  # a hidden logit: exp(NEG - max) is 0 for any row that sees a key


def block_for(length: int, heads: int) -> int:
    """Rows per block for `length` keys and `heads` heads (kv heads x group, batch
    included: every head of a call goes through each product at once): the most, up to
    256 and at least 64 (fewer would make many small products and a long program),
    whose square tile of logits (heads x rows x rows) is at most ROW_TILE, so that a
    tile stays in a core's cache between its dot, its exp and the next dot; and fewer
    where a row block's logits pass 4M values per head (16k keys), so the backward
    pass's few live blocks stay within about 100 MiB per head."""
    rows = 256
    while rows > 64 and heads * rows * rows > ROW_TILE:
        rows //= 2
    return min(rows, max(64, 2**22 // max(length, 1)))


# Logits in a row block's square tile (heads x rows x rows) at most (block_for): 256
# rows up to 8 heads, 128 for 32 heads (the realistic step's 4 sequences of 8 heads at
# 512 tokens, where rows of 64 and 128 ran the kernel at 0.83-0.84 of the time of 256,
# and 128 compiles the step in 10.9 CPU seconds against 64's 15.6: docs/benchmarks.md
# "Attention's tiles by heads, kept for the backward pass")
ROW_TILE = 2**19


def _blocks(n: int, m: int, block: int, causal: bool, window: int):
    """(row start, row end, key start, key end) of each row block: the keys some row of
    it can see (query i sees keys i - window + 1 .. i when causal and windowed; the
    mask is top-left aligned, as jax's, when length != memory). A block with a row that
    sees no key (more queries than keys, past memory + window - 1) meets every key,
    all masked: such a row's softmax is uniform, as XLA's and NumPy's are."""
    out = []
    for s in range(0, n, block):
        e = min(n, s + block)
        if window and e - window >= m:
            out.append((s, e, 0, m))
            continue
        k0 = max(0, s - window + 1) if window else 0
        k1 = min(e, m) if causal else m
        out.append((s, e, k0, k1))
    return out


def _anchored(blk, m: int, causal: bool, window: int) -> bool:
    """Whether every row of a block sees its anchor key (`_own_logits`: its own, or the
    last key for rows past memory), the key a causal row's softmax is shifted by."""
    return causal and not (window and blk[1] - window >= m)


# Logits per tile (kv_heads x group x rows x keys) at most: 2 MB of float32, 512 keys
# for a row block of 256 queries and 4 heads, the fastest of 1-16 MB on CPU at 2k and
# 8k tokens (the whole row of 8k keys, 32 MB, ran XLA:CPU's dots at about a third of
# the matmul rate); and at most TILE_BUDGET tiles per call, so that the program stays
# small at 16k-32k tokens (wider tiles there: 8 per row block at 16k, 2 at 32k).
TILE = 2**19
TILE_BUDGET = 512


def _tiles(blk, heads: int, causal: bool, window: int, blocks: int):
    """A row block's keys in tiles of at most TILE logits, and no more tiles than the
    call's TILE_BUDGET shared by its `blocks` row blocks allows (a multiple of its rows
    wide), each with whether the mask hides any of it: ((row start, row end, key
    start, key end), masked). Under a causal mask each row's shift is known before its
    keys are seen (`_forward`), so tiles just add up: no rescaling as in
    FlashAttention's online softmax."""
    s, e, k0, k1 = blk
    r = e - s
    most = max(1, TILE_BUDGET // blocks)
    width = max(r, TILE // (heads * r) // r * r, -(-(k1 - k0) // most // r) * r)
    out = []
    for a in range(k0, k1, width):
        b = min(k1, a + width)
        hidden = causal and b - 1 > s  # a key after the block's first row
        hidden |= bool(window) and a <= e - 1 - window  # a key before the last row's window
        out.append(((s, e, a, b), hidden))
    return out


# A call whose kept exp tiles (`keeps`) are at most this many floats (128 MiB) keeps
# them for the backward pass, which then needs neither the logits' product nor their
# exp again: 0.84-0.95 of the kernel's time at 2048 tokens (4 heads); at 512 (32 heads)
# 0.95-0.96 in one run and 1.04 in another, within the load's noise;
# the 2048-token step of 4 heads keeps 38 MiB a layer, about what full attention
# keeps at 1450 tokens. Past it the backward pass computes them again: memory linear
# in length.
KEEP_BUDGET = 2**25


def keeps(blocks, heads: int, causal: bool, window: int, m: int) -> bool:
    """Whether the forward pass keeps its exp tiles for the backward pass (`_kept`)."""
    return _kept(blocks, heads, causal, window, m) > 0


def _kept(blocks, heads: int, causal: bool, window: int, m: int) -> int:
    """The logits, all heads', in the exp tiles the forward pass keeps: those of the
    causal row blocks that see their anchor key (`_anchored`) where they hold at most
    KEEP_BUDGET in all, else 0."""
    if not causal:
        return 0
    kept = heads * sum(
        (e - s) * (b - a)
        for blk in blocks
        if _anchored(blk, m, causal, window)
        for (s, e, a, b), _ in _tiles(blk, heads, causal, window, len(blocks))
    )
    return kept if kept <= KEEP_BUDGET else 0


@cache  # the planner asks it of every candidate's attention calls
def kept_logits(n: int, m: int, heads: int, causal: bool, window: int) -> int:
    """The float32 logits a call of `heads` heads, `n` queries and `m` keys keeps for
    its backward pass (0 where it computes them again): what the memory estimate adds
    for it (namedmesh.attention's `backward_saves`)."""
    blocks = _blocks(n, m, block_for(m, heads), causal, window)
    return _kept(blocks, heads, causal, window, m)


def _mask_table(blocks, causal: bool, window: int):
    """Additive masks of every row block as slices of one array: what query i may see of
    key j depends on j - i alone, so table[r, c] masks offset c - r - c0 and block
    (s, e, k0, k1)'s mask is table[:e - s, c0 - s + k0 : c0 - s + k1] (`_block_mask`);
    (rows, about memory) in size. Added to the logits rather than selected: XLA:CPU fuses
    a row block's dot, add, max, exp and second dot into one kernel, which a select
    breaks up (the mask as `where` made the forward pass 1.5x slower). None when
    nothing is masked."""
    if not causal and not window:
        return None, 0
    c0 = max(s - k0 for s, _, k0, _ in blocks)
    rows = max(e - s for s, e, _, _ in blocks)
    width = c0 + max(k1 - s for s, _, _, k1 in blocks)
    r = jax.lax.broadcasted_iota(np.int32, (rows, width), 0)
    offset = jax.lax.broadcasted_iota(np.int32, (rows, width), 1) - r - c0  # j - i
    ok = offset <= 0 if causal else jnp.ones((rows, width), bool)
    if window:
        ok &= offset > -window
    return jnp.where(ok, np.float32(0), np.float32(NEG)), c0


def _cut(x, at, spans: dict):
    """x[spans] ({axis: (start, end)}) as a dynamic slice whose starts are offset by
    `at`, a block's link to the one before (`_after`: always 0)."""
    starts, sizes = [0] * x.ndim, list(x.shape)
    for axis, (a, b) in spans.items():
        starts[axis], sizes[axis] = a + at, b - a
    return jax.lax.dynamic_slice(x, starts, sizes)


def _after(x):
    """0 as an int32 XLA cannot know in advance ((one value of x) * 0 > 1 is false for
    every x, NaN too), offsetting the next block's slices: each block's slices wait on
    the block before. Without it XLA's scheduler made every block's slices of q, k, v
    and the mask first and kept them all alive: memory quadratic in length."""
    return (x.reshape(-1)[0] * 0 > 1).astype(np.int32)


def _logits(qs, k, bias, table, blk, at):
    """scale * q.k (+ bias) + mask of one row block: (kv_heads, group * rows, keys), the
    group and rows merged, so that each product is a dot with one free dim on each side
    (two on one side made XLA:CPU copy the logits out of its fused kernel)."""
    s, e, k0, k1 = blk
    h, g = qs.shape[:2]
    q = _cut(qs, at, {2: (s, e)}).reshape(h, g * (e - s), qs.shape[3])
    sc = jnp.einsum("hqd,hmd->hqm", q, _cut(k, at, {1: (k0, k1)}))
    sc = sc.reshape(h, g, e - s, k1 - k0)
    if bias is not None:
        rows = {2: (s, e)} if bias.shape[2] > 1 else {}
        sc = sc + _cut(bias, at, {**rows, 3: (k0, k1)})
    if table[0] is not None:
        mask, c0 = table
        sc = sc + _cut(mask, at, {0: (0, e - s), 1: (c0 - s + k0, c0 - s + k1)})
    return sc.reshape(h, g * (e - s), k1 - k0)


def _rows(x, g):
    """(kv_heads, group * rows, ...) as (kv_heads, group, rows, ...)."""
    return x.reshape(x.shape[0], g, x.shape[1] // g, *x.shape[2:])


def _own_logits(qs, k, bias):
    """Each row's logit against its anchor key, (kv_heads, group, length): the shift of
    a causal row's softmax (`_forward`). The anchor is the row's own key, or the last
    key for rows past memory (more queries than keys): a key every causal row sees
    (`_anchored` says which blocks' rows may not, under a window)."""
    n, m = qs.shape[2], k.shape[1]
    if n <= m:
        own = jnp.einsum("hgnd,hnd->hgn", qs, k[:, :n])
        if bias is None:
            return own
        if bias.shape[2] == 1:  # one row of bias for every query
            return own + bias[:, :, 0, :n]
        return own + jnp.diagonal(bias[:, :, :, :n], axis1=2, axis2=3)
    anchor = np.minimum(np.arange(n), m - 1)
    own = jnp.einsum("hgnd,hnd->hgn", qs, k[:, anchor])
    if bias is None:
        return own
    rows = np.zeros(n, int) if bias.shape[2] == 1 else np.arange(n)
    return own + bias[:, :, rows, anchor]


# The largest sum of a row's shifted terms its shift is trusted with (`_trusted`): far
# below float32's overflow (2**128), and its reciprocal 2**-100 far above the smallest
# normal float (2**-126), which XLA's x / y as x * (1 / y) would flush to zero.
SUM_MAX = 2.0**100


def _trusted(o, sums):
    """Whether a row block's products with its rows' own-key shift, o = exp(logits -
    shift) @ v and the row sums of exp(logits - shift), are exact (else it is computed
    again, `_normalized`). Proof: the terms exp(x) are >= 0, and a
    float sum of non-negative terms is at least each of them; so a sum in [1/2,
    SUM_MAX] means no term overflowed or reached the top of exp's range (an overflow
    is inf, and inf never turns finite again under + and *), and the largest term is at
    least 1 / (2 * keys), so the terms that matter are normal floats, as under a max
    shift; the products with v are finite when every column is (an overflow or inf * 0
    leaves inf or NaN there); dividing by the sum multiplies by a normal 1 / sum. The
    backward pass's probabilities exp(logit - shift - log(sum)) are at most about 1
    whatever the shift. A sum that is not in range (a row's key more than about 69
    above its own) is no error, only a block computed twice. The test of the sums
    alone missed the band where they were finite but above 2**126 (a zero reciprocal,
    rows of zeros) or the products infinite (issue 38)."""
    return jnp.isfinite(o).all() & ((sums >= 0.5) & (sums <= SUM_MAX)).all()


def _forward(q, k, v, bias, scale, causal, window, block, keep=False):
    """The output (kv_heads, group, length, d) and each row's shift and log of its sum
    of exp(logit - shift), which the backward pass's probabilities are exp(logit -
    shift - log-sum) of (kept apart: a row whose keys are all masked has a shift of
    about -1e30, which its log-sum would not change in float32).

    Under a causal mask each row's softmax is shifted by the row's logit against its own
    key (`_own_logits`, outside the tiles' products) rather than by its max: the row's
    sum is then at least 1 (its own key's term), so nothing underflows, the key tiles
    need no max pass over their logits and just add up. A block whose sums `_trusted`
    does not trust (some row's logit far above its own) is computed again with each
    row's max, normalized before the product with v (`_normalized`); every block
    without a causal mask is shifted by its max (`_shifted_by_max`), and computed
    again so only when its products overflow."""
    blocks = _blocks(q.shape[2], k.shape[1], block, causal, window)
    table = _mask_table(blocks, causal, window)
    qs = q * scale
    g, m = q.shape[1], k.shape[1]
    own = _own_logits(qs, k, bias) if causal else None
    outs, shifts, logsums, saved, at = [], [], [], [], 0
    for blk in blocks:
        exact = lambda blk=blk, at=at: _normalized(qs, k, bias, table, blk, at, v)
        if _anchored(blk, m, causal, window):
            c = _cut(own, at, {2: blk[:2]}).reshape(q.shape[0], -1, 1)
            o = sums = None
            kept_tiles = []
            for tile, hidden in _tiles(blk, g * q.shape[0], causal, window, len(blocks)):
                sc = _logits(qs, k, bias, table if hidden else (None, 0), tile, at)
                p = jnp.exp(sc - c)
                t, ts = _products(p, _cut(v, at, {1: tile[2:]}))
                o, sums = (t, ts) if o is None else (o + t, sums + ts)
                kept_tiles.append(p)
                at = _after(t)
            ok = _trusted(o, sums)
            saved.append((ok, sums, tuple(kept_tiles)) if keep else None)
        else:
            o, sums, c = _shifted_by_max(qs, k, bias, table, blk, at, v)
            ok = jnp.isfinite(o).all()  # the max's term is 1: the sums are in [1, keys]
            saved.append(None)
        kept = lambda o=o, sums=sums, c=c: (o / sums, c, jnp.log(sums))
        o, c, ls = jax.lax.cond(ok, kept, exact)
        at = _after(o)
        outs.append(_rows(o, g))
        shifts.append(_rows(c[..., 0], g))
        logsums.append(_rows(ls[..., 0], g))
    return (*(jnp.concatenate(x, 2) for x in (outs, shifts, logsums)), saved)


def _products(p, v):
    """p @ v and p's row sums, (kv_heads, rows, d) and (kv_heads, rows, 1). Two
    products of one exp: XLA:CPU's YNNPACK dots run a 65-column product (v with a
    column of ones, the sums inside the dot) 20% slower than the 64-column one, more
    than the separate sum costs (flash2k's profile, docs/benchmarks.md "The fused
    kernel's speed")."""
    return jnp.einsum("hqm,hmd->hqd", p, v), p.sum(-1, keepdims=True)


def _shifted_by_max(qs, k, bias, table, blk, at, v):
    """One row block's (p @ v, row sums, shift) with each row's softmax shifted by its
    max logit, all its keys at once: exact unless the products with v overflow."""
    sc = _logits(qs, k, bias, table, blk, at)
    c = sc.max(-1, keepdims=True)
    return *_products(jnp.exp(sc - c), _cut(v, at, {1: blk[2:]})), c


def _normalized(qs, k, bias, table, blk, at, v):
    """One row block's (output, shift, log-sum) with each row's softmax shifted by its
    max and divided by its sum before the product with v, as XLA's softmax: exact for
    any finite logits and values (the weights are in [0, 1] and sum to 1, so no partial
    sum of the product exceeds the largest |v|)."""
    sc = _logits(qs, k, bias, table, blk, at)
    c = sc.max(-1, keepdims=True)
    p = jnp.exp(sc - c)
    sums = p.sum(-1, keepdims=True)
    out = jnp.einsum("hqm,hmd->hqd", p / sums, _cut(v, at, {1: blk[2:]}))
    return out, c, jnp.log(sums)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def attention(q, k, v, bias, scale: float, causal: bool, window: int, block: int):
    """softmax(scale * q.k + bias, masked) v: q (kv_heads, group, length, d), k and v
    (kv_heads, memory, d), bias None or (kv_heads, group, length or 1, memory); float32."""
    return _forward(q, k, v, bias, scale, causal, window, block)[0]


def _attention_fwd(q, k, v, bias, scale, causal, window, block):
    blocks = _blocks(q.shape[2], k.shape[1], block, causal, window)
    keep = keeps(blocks, q.shape[0] * q.shape[1], causal, window, k.shape[1])
    out, shifts, logsums, saved = _forward(q, k, v, bias, scale, causal, window, block, keep)
    return out, (q, k, v, bias, out, shifts, logsums, saved)


def _attention_bwd(scale, causal, window, block, res, dout):
    """Row block by row block: from the forward pass's kept exp tiles where it kept them
    (`keeps`) and its shift was trusted (`_from_kept`), else from the logits computed
    again (`_recomputed`). dk and dv are accumulated transposed, (kv_heads, d, memory),
    where any block is kept: the kept tiles' products are fast in that orientation
    (the module's docstring), the recomputed ones are transposed to it."""
    q, k, v, bias, out, shifts, logsums, saved = res
    qs = q * scale
    h, g, n, d = q.shape
    m = k.shape[1]
    dd = (dout * out).sum(-1)
    flip = any(x is not None for x in saved)  # dk, dv as (h, d, m)
    dk, dv = (jnp.zeros((h, d, m) if flip else (h, m, d), np.float32) for _ in "kv")
    dq, dbias = [], None if bias is None else jnp.zeros(bias.shape, bias.dtype)
    blocks = _blocks(n, m, block, causal, window)
    table = _mask_table(blocks, causal, window)
    at = 0  # each block's slices after the block before (`_after`)
    for blk, kept in zip(blocks, saved, strict=True):
        s, e = blk[:2]
        r = e - s
        qb, do = (_cut(x, at, {2: (s, e)}).reshape(h, g * r, d) for x in (qs, dout))
        shift, logsum, ddb = (
            _cut(x, at, {2: (s, e)}).reshape(h, g * r, 1) for x in (shifts, logsums, dd)
        )
        tiles = _tiles(blk, h * g, causal, window, len(blocks))
        again = partial(
            _recomputed, qb, do, shift, logsum, ddb, k, v, bias, table, tiles, window, flip, at
        )
        if kept is None:
            dq_rows, pieces = again()
        else:
            ok, sums, ps = kept
            fast = partial(_from_kept, qb, do, ddb, sums, ps, k, v, bias, tiles, at)
            dq_rows, pieces = jax.lax.cond(ok, fast, again)
        for ((_, _, k0, k1), _), (dk_t, dv_t, ds) in zip(tiles, pieces, strict=True):
            if flip:
                dk, dv = dk.at[:, :, k0:k1].add(dk_t), dv.at[:, :, k0:k1].add(dv_t)
            else:
                dk, dv = dk.at[:, k0:k1].add(dk_t), dv.at[:, k0:k1].add(dv_t)
            if bias is not None:
                if bias.shape[2] > 1:
                    dbias = dbias.at[:, :, s:e, k0:k1].set(ds)
                else:
                    dbias = dbias.at[:, :, :, k0:k1].add(ds.sum(2, keepdims=True))
        at = _after(dq_rows)
        dq.append(_rows(dq_rows, g) * scale)
    if flip:
        dk, dv = dk.transpose(0, 2, 1), dv.transpose(0, 2, 1)
    return jnp.concatenate(dq, 2), dk, dv, dbias


def _from_kept(qb, do, ddb, sums, ps, k, v, bias, tiles, at):
    """One row block's gradients from the forward pass's exp tiles `ps` (exp(logit -
    shift), the row sums `sums` trusted by `_trusted`): the probabilities are ps / sums,
    whose 1 / sums goes into dout and dd (one per row) rather than into every logit.
    (dq rows (kv_heads, group * rows, d), [(dk, dv, dbias piece) per tile]), dk and dv
    transposed, (kv_heads, d, keys)."""
    h, gr, _ = qb.shape
    inv = 1 / sums
    do, ddb = do * inv, ddb * inv
    dq, pieces = None, []
    for p, ((s, e, k0, k1), _) in zip(ps, tiles, strict=True):
        kb, vb = (_cut(x, at, {1: (k0, k1)}) for x in (k, v))
        dv = jnp.einsum("hqd,hqm->hdm", do, p)
        ds = p * (jnp.einsum("hqd,hmd->hqm", do, vb) - ddb)  # the logits' gradient
        dk = jnp.einsum("hqd,hqm->hdm", qb, ds)
        t = jnp.einsum("hqm,hmd->hqd", ds, kb)
        dq = t if dq is None else dq + t
        at = _after(t)
        piece = None if bias is None else ds.reshape(h, gr // (e - s), e - s, k1 - k0)
        pieces.append((dk, dv, piece))
    return dq, pieces


def _recomputed(qb, do, shift, logsum, ddb, k, v, bias, table, tiles, window, flip, at):
    """One row block's gradients with its logits computed again, transposed, (kv_heads,
    keys, group * rows): a product XLA cannot merge with the forward pass's (common
    subexpressions would keep every block's logits alive from one pass to the other,
    memory quadratic in length), and in which every product is one XLA:CPU runs fast
    (see the module's docstring). (dq rows (kv_heads, group * rows, d), [(dk, dv,
    dbias piece) per tile]), dk and dv (kv_heads, keys, d), or (kv_heads, d, keys)
    where `flip`."""
    h, gr, d = qb.shape
    mask, c0 = table
    m = k.shape[1]
    # exp(logit - lse) with lse = shift + log-sum rounded, times what the rounding
    # took (exp(lse - shift - log-sum), 1 but for far larger shifts: a row whose
    # keys are all masked, about -1e30 + log(keys)) is exact: that factor, one per
    # row, goes into dout and dd rather than a second subtraction into every logit
    lse = shift + logsum
    fix = jnp.exp(lse - shift - logsum)
    do, ddb = do * fix, (ddb * fix).reshape(h, 1, gr)
    lse = lse.reshape(h, 1, gr)
    dq, pieces = None, []
    for (s, e, k0, k1), hidden in tiles:
        r, keys = e - s, k1 - k0
        g = gr // r
        kb, vb = (_cut(x, at, {1: (k0, k1)}) for x in (k, v))
        sc = jnp.einsum("hmd,hqd->hmq", kb, qb).reshape(h, keys, g, r)
        if bias is not None:
            rows = {2: (s, e)} if bias.shape[2] > 1 else {}
            sc = sc + _cut(bias, at, {**rows, 3: (k0, k1)}).transpose(0, 3, 1, 2)
        if mask is not None and hidden:
            cut = _cut(mask, at, {0: (0, r), 1: (c0 - s + k0, c0 - s + k1)})
            sc = sc + cut.T[:, None, :]
        # no max over the keys again: the forward's shift and log-sum
        p = jnp.exp(sc.reshape(h, keys, gr) - lse)
        dv = jnp.einsum("hmq,hqd->hmd", p, do)
        dp = jnp.einsum("hmd,hqd->hmq", vb, do)
        ds = p * (dp - ddb)  # the logits' gradient
        if window and e - window >= m:
            # rows that see no key are uniform whatever their logits (as XLA's and
            # NumPy's masks, which replace the logits): none of the gradient
            ds = ds * np.tile(np.arange(s, e) - window + 1 < m, g).astype(np.float32)
        dk = jnp.einsum("hmq,hqd->hmd", ds, qb)
        t = jnp.einsum("hmd,hmq->hdq", kb, ds)
        dq = t if dq is None else dq + t
        at = _after(t)
        if flip:
            dk, dv = dk.transpose(0, 2, 1), dv.transpose(0, 2, 1)
        piece = None if bias is None else ds.reshape(h, keys, g, r).transpose(0, 2, 3, 1)
        pieces.append((dk, dv, piece))
    return dq.transpose(0, 2, 1), pieces


attention.defvjp(_attention_fwd, _attention_bwd)
