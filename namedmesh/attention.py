"""`dot_product_attention`: softmax(scale * q.k + bias) v as one primitive, with its
causal mask and local window, so the (length, memory) logits never appear in the
program as separate ops. Dims are matched by name: q (..., length, d_kv), k and v (...,
memory, d_kv) whose other dims are some of q's (grouped query heads: q's dims k lacks,
e.g. q_per_kv, share k's heads). The three names are the caller's (`length=`,
`memory=`, `features=`, the zoo's by default) and travel in the primitive's `names`
param, which the local kernels, the cost rule and the lowering read: no other code
knows them. The lowering (lowering/rules/attention.py) keeps those three whole on each
device; the other dims (batch, heads, any) may be split.

Its local kernel comes from KERNELS: "xla", `jax.nn.dot_product_attention` (cuDNN's
fused kernel on GPU; on CPU XLA's, which makes the whole logits), and "flash",
namedmesh.flash's row blocks (memory linear in length, its own backward pass), which
`choose_kernel` picks for long self-attention on CPU.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from namedmesh import flash
from namedmesh.checks import boolean, integer
from namedmesh.contract import custom_gradients
from namedmesh.errors import ArgumentError, ParameterError, ShapeError, fmt_dims
from namedmesh.primitive import Aval, Cost, bind, float_result, primitive
from namedmesh.structural import rename
from namedmesh.tensor import Tensor

NEG = -1e9  # a masked logit, as models.layers.common.NEG


NAMES = ("length", "memory", "features")  # the keyword parameters naming the dims


def _groups(q_dims, k_dims, names):
    """(q's dims shared with k, q's dims k lacks), q's heads in that order: a query
    head's index over both is its key head's index over the shared dims times the
    group size plus its place in the group, as jax.nn.dot_product_attention groups."""
    length, _, features = names
    shared = [d for d in q_dims if d in k_dims and d not in (length, features)]
    only = [d for d in q_dims if d not in k_dims and d not in (length, features)]
    return shared, only


def _check_dims(q, k, v, names) -> None:
    """Each of q, k and v has the dims `names` says it must (the parameter that named a
    missing one said too)."""
    length, memory, features = names
    need = {"q": (q, (length, features)), "k": (k, (memory, features))}
    need["v"] = (v, (memory, features))
    for what, (t, dims) in need.items():
        for d in dims:
            if d not in t.dims:
                param = NAMES[names.index(d)]
                raise ShapeError(
                    f"dot_product_attention: {what} {tuple(t.dims)} has no dim {d!r} "
                    f"(named by {param}={d!r})"
                )


def _shape_rule(q, k, v, *bias, scale, causal, window, kernel, names):
    name = "dot_product_attention"
    _check_dims(q, k, v, names)
    _, memory, features = names
    if k.dims != v.dims or tuple(k.shape) != tuple(v.shape):
        raise ShapeError(
            f"{name}: k {k.dims}{tuple(k.shape)} and v {v.dims}{tuple(v.shape)} differ"
        )
    if extra := [d for d in k.dims if d not in q.dims and d != memory]:
        raise ShapeError(f"{name}: k's dim(s) {extra} are not dims of q {q.dims}")
    qs, ks = dict(zip(q.dims, q.shape, strict=True)), dict(zip(k.dims, k.shape, strict=True))
    if bad := [d for d in ks if d in qs and ks[d] != qs[d]]:
        raise ShapeError(f"{name}: q and k disagree on the size of {bad}")
    if bias:
        logits = {*q.dims, memory} - {features}
        if stray := [d for d in bias[0].dims if d not in logits]:
            raise ShapeError(
                f"{name}: bias dim(s) {stray} are none of the logits' {sorted(logits)}"
            )
    return Aval(tuple(q.dims), tuple(q.shape), float_result(v.dtype))  # ints: float32


def _arrange(xp, q, k, v, bias, dims, names):
    """q, k, v as (1, length, heads, d_kv) and (1, memory, kv heads, d_kv), the bias as
    (1, heads or 1, length or 1, memory or 1), from arrays over `dims` (q's, k's,
    bias's), the three dims named by `names`, every other dim of q one of the heads;
    and how to put the result back over q's dims."""
    q_dims, k_dims, b_dims = dims
    length, memory, features = names
    shared, only = _groups(q_dims, k_dims, names)
    qo = [*shared, *only]
    qa = xp.transpose(q, [q_dims.index(d) for d in (length, *qo, features)])
    heads = qa.shape[1 : 1 + len(qo)]
    qa = qa.reshape(1, qa.shape[0], math.prod(heads), qa.shape[-1])
    ka, va = (
        xp.transpose(x, [k_dims.index(d) for d in (memory, *shared, features)]) for x in (k, v)
    )
    # the heads counted, not -1: a reshape cannot infer a dim where another is empty
    ka, va = (x.reshape(1, x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1]) for x in (ka, va))
    ba = None
    if bias is not None:
        axes = (*qo, length, memory)
        have = [d for d in axes if d in b_dims]
        ba = xp.transpose(bias, [b_dims.index(d) for d in have])
        full = [heads[qo.index(d)] if d in qo else 1 for d in axes]
        shape = [ba.shape[have.index(d)] if d in have else 1 for d in axes]
        ba = xp.broadcast_to(ba.reshape(shape), [*full[: len(qo)], *shape[len(qo) :]])
        ba = ba.reshape(1, math.prod(heads), *shape[len(qo) :])

    def back(out):  # (1, length, heads, d_kv) -> q's dims
        out = out.reshape(out.shape[1], *heads, out.shape[-1])
        order = (length, *qo, features)
        return xp.transpose(out, [order.index(d) for d in q_dims])

    return qa, ka, va, ba, back


def _mask(n: int, m: int, causal: bool, window: int) -> np.ndarray:
    """(n, m) bools: the keys each query sees (on or below the diagonal when causal,
    within `window - 1` below it when window > 0)."""
    ok = np.ones((n, m), bool)
    ok = np.tril(ok) if causal else ok
    return np.triu(ok, 1 - window) if window else ok


def _numpy(q, k, v, *bias, scale, causal, window, kernel, dims, names):
    if not q.size:  # no query (an empty head dim too: no group of heads to divide)
        return np.zeros(q.shape, v.dtype)
    qa, ka, va, ba, back = _arrange(np, q, k, v, bias[0] if bias else None, dims, names)
    # summed in float32 at least (NumPy's einsum has no bfloat16 loop), rounded once
    acc = np.promote_types(v.dtype, np.float32)
    return back(_plain(np, qa, ka, va, ba, scale, causal, window, acc).astype(v.dtype))


def _plain(xp, qa, ka, va, ba, scale, causal, window, acc):
    """softmax(scale * q.k + bias, masked) v in `acc`, the whole logits made: NumPy's
    reference, and jax's float64 (jax.nn.dot_product_attention's softmax is float32)."""
    g = qa.shape[2] // ka.shape[2]
    qa, ka, va = (xp.repeat(x, r, axis=2).astype(acc) for x, r in ((qa, 1), (ka, g), (va, g)))
    s = xp.einsum("bthd,bshd->bhts", qa, ka) * acc.type(scale)
    if ba is not None:
        s = s + ba
    s = xp.where(_mask(s.shape[2], s.shape[3], causal, window), s, acc.type(NEG))
    w = xp.exp(s - s.max(-1, keepdims=True))
    return xp.einsum("bhts,bshd->bthd", w / w.sum(-1, keepdims=True), va)


def _xla(qa, ka, va, ba, *, scale, causal, window):
    """jax.nn.dot_product_attention: cuDNN's fused kernel on GPU; on CPU XLA's, which
    makes the whole (length, memory) logits."""
    # jax's window: a query sees keys left..right of itself; ours: the last `window`
    local = None if not window else (window - 1, 0 if causal else ka.shape[1])
    dtype = va.dtype
    # one dtype for q, k and v, as jax's kernel takes them (rotary q and k are float32
    # beside bfloat16 values in the zoo): their promotion, float32 for float16 on CPU
    common = jax.numpy.result_type(qa, ka, va)
    if common == np.float16 and jax.default_backend() == "cpu":  # XLA:CPU has no float16
        common = np.dtype(np.float32)  # dot summed in float32
        ba = None if ba is None else ba.astype(common)
    if common == np.float64:  # jax's kernel would round its softmax to float32
        return _plain(jax.numpy, qa, ka, va, ba, scale, causal, window, common).astype(dtype)
    qa, ka, va = (x.astype(common) for x in (qa, ka, va))
    out = jax.nn.dot_product_attention(
        qa, ka, va, ba, scale=scale, is_causal=causal, local_window_size=local
    )
    return out.astype(dtype)


def _flash(qa, ka, va, ba, *, scale, causal, window):
    """namedmesh.flash's row-block kernel (memory linear in length), in float32: heads
    as (kv heads, group), so grouped heads share k and v unrepeated."""
    n, heads, d = qa.shape[1:]
    kv = ka.shape[2]
    f32 = np.float32
    q = qa[0].astype(f32).reshape(n, kv, heads // kv, d).transpose(1, 2, 0, 3)
    k, v = (x[0].astype(f32).transpose(1, 0, 2) for x in (ka, va))
    b = None
    if ba is not None:
        b = ba[0].astype(f32).reshape(kv, heads // kv, *ba.shape[2:])
        b = jax.numpy.broadcast_to(b, (*b.shape[:3], k.shape[1]))
    block = flash.block_for(k.shape[1], q.shape[0] * q.shape[1])
    out = flash.attention(q, k, v, b, scale, causal, window, block)
    return out.transpose(2, 0, 1, 3).reshape(1, n, heads, d).astype(va.dtype)


# The local kernels `_jax` picks from (`kernel=`, or `choose_kernel` for "auto")
KERNELS = {"xla": _xla, "flash": _flash}
FLASH_FROM = 512  # self-attention this long runs flash on CPU (benchmarks/attention_kernels.py)


def choose_kernel(length: int, memory: int, backend: str) -> str:
    """The kernel "auto" runs: on CPU, flash for self-attention (length == memory) of
    FLASH_FROM positions or more, where XLA's whole logits cost more than flash's Python
    loop of row blocks; XLA's kernel otherwise (GPU's cuDNN, short sequences, decoding
    steps over a cache, and inside `jax_gradients()`: flash's custom vjp has no forward
    mode)."""
    if backend == "cpu" and length == memory >= FLASH_FROM and custom_gradients():
        return "flash"
    return "xla"


def _resolved(kernel: str, length: int, memory: int, dtypes) -> str:
    """The kernel `kernel` runs: "auto" is xla's exact path for float64 (x64; flash's is
    float32), else `choose_kernel`'s."""
    if kernel != "auto":
        return kernel
    if np.float64 in dtypes:
        return "xla"
    return choose_kernel(length, memory, jax.default_backend())


def _jax(q, k, v, *bias, scale, causal, window, kernel, dims, names):
    if not q.size:  # (as `_numpy`)
        return jax.numpy.zeros(q.shape, v.dtype)
    n, m = q.shape[dims[0].index(names[0])], k.shape[dims[1].index(names[1])]
    kernel = _resolved(kernel, n, m, (q.dtype, k.dtype, v.dtype))
    b = bias[0] if bias else None
    if kernel == "flash":  # straight to its heads-first layout: one move per operand
        qh, kh, vh, bh, back = _heads_first(q, k, v, b, dims, names)
        block = flash.block_for(kh.shape[1], qh.shape[0] * qh.shape[1])
        return back(flash.attention(qh, kh, vh, bh, scale, causal, window, block), v.dtype)
    qa, ka, va, ba, back = _arrange(jax.numpy, q, k, v, b, dims, names)
    return back(KERNELS[kernel](qa, ka, va, ba, scale=scale, causal=causal, window=window))


def _heads_first(q, k, v, bias, dims, names):
    """q as (kv heads, group, length, d_kv), k and v as (kv heads, memory, d_kv) and the
    bias as (kv heads, group, length or 1, memory), float32: namedmesh.flash's layout,
    each one transpose from its own dims (kv heads: the dims q shares with k, batch
    included; group: q's dims k lacks); and how to put flash's output back over q's
    dims in `dtype`. Not through `_arrange`'s length-first order: XLA kept q in that
    order as the backward pass's residual and copied it heads-first again there."""
    xp, f32 = jax.numpy, np.float32
    q_dims, k_dims, b_dims = dims
    length, memory, features = names
    shared, only = _groups(q_dims, k_dims, names)
    size = dict(zip(q_dims, q.shape, strict=True)) | dict(zip(k_dims, k.shape, strict=True))
    kv, g = math.prod(size[d] for d in shared), math.prod(size[d] for d in only)
    qo = (*shared, *only, length, features)
    qh = xp.transpose(q, [q_dims.index(d) for d in qo]).astype(f32)
    qh = qh.reshape(kv, g, size[length], size[features])
    kh, vh = (
        xp.transpose(x, [k_dims.index(d) for d in (*shared, memory, features)])
        .astype(f32).reshape(kv, size[memory], size[features])
        for x in (k, v)
    )  # fmt: skip
    bh = None
    if bias is not None:
        axes = (*shared, *only, length, memory)
        have = [d for d in axes if d in b_dims]
        bh = xp.transpose(bias, [b_dims.index(d) for d in have]).astype(f32)
        own = dict(zip(b_dims, bias.shape, strict=True))
        bh = bh.reshape([own[d] if d in have else 1 for d in axes])
        heads = [size[d] for d in (*shared, *only)]
        bh = xp.broadcast_to(bh, (*heads, *bh.shape[len(heads) : -1], size[memory]))
        bh = bh.reshape(kv, g, bh.shape[-2], size[memory])

    def back(out, dtype):  # (kv heads, group, length, d_kv) -> q's dims
        out = out.reshape([size[d] for d in qo])
        return xp.transpose(out, [qo.index(d) for d in q_dims]).astype(dtype)

    return qh, kh, vh, bh, back


def _cost(in_avals, out_avals, params) -> Cost:
    q, k = in_avals[0], in_avals[1]
    length, memory, features = params["names"]
    n, m, d = q.sizes[length], k.sizes[memory], q.sizes[features]
    heads = math.prod(q.shape) // (n * d)
    pairs = n * m / (2 if params["causal"] else 1)
    flops = 4 * pairs * heads * d
    return Cost(flops, sum(a.nbytes for a in in_avals) + sum(a.nbytes for a in out_avals))


def _kept_saves(ins, params) -> float:
    """The exp tiles the CPU kernel keeps for its backward pass (namedmesh.flash's
    `kept_logits`), in values of q's size; none where another kernel runs (decided by
    the shapes given and this process's backend: the memory estimate gives a device's
    local op's, where the plan has them, else the whole's: lowering.memory.Made)."""
    q, k = ins[0], ins[1]
    length, memory, features = params["names"]
    size = dict(zip(q.dims, q.shape, strict=True)) | dict(zip(k.dims, k.shape, strict=True))
    n, m = size[length], size[memory]
    kernel = _resolved(params["kernel"], n, m, tuple(x.dtype for x in ins[:3]))
    if kernel != "flash" or not n * m:
        return 0.0
    heads = math.prod(q.shape) // (n * size[features])
    kept = flash.kept_logits(n, m, heads, params["causal"], params["window"])
    return kept * 4 / (math.prod(q.shape) * np.dtype(q.dtype).itemsize)


_attention = primitive(
    "dot_product_attention",
    lambda q, k, v, *bias, dims, **kw: _shape_rule(q, k, v, *bias, **kw),
    _numpy,
    _jax,
    cost_rule=_cost,
    backward_reads="both",  # q, k, v and the output (FlashAttention's backward pass)
    backward_saves=_kept_saves,  # and on CPU the exp tiles flash keeps, if it keeps them
    float_valued=True,  # a softmax: integer q, k, v are computed as float32
)


def dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    *,
    scale: float = 1.0,
    causal: bool = False,
    window: int = 0,
    kernel: str = "auto",
    length: str = "length",
    memory: str = "memory",
    features: str = "d_kv",
) -> Tensor:
    """softmax over memory of scale * q.k + bias (masked where a key is after its query
    when `causal`, or `window` or more positions before it), times v, in one fused
    kernel: q (..., length, features), k and v (..., memory, features), other dims
    matched by name (grouped heads: q's dims k lacks); `bias` over any of the logits'
    dims. `length`, `memory` and `features` name those three dims (the zoo's names by
    default); every other dim is a batch of heads. The result has q's dims and v's
    dtype. `kernel`: the local kernel under jax, one of KERNELS ("xla":
    jax.nn.dot_product_attention; "flash": namedmesh.flash's row blocks, memory linear
    in length) or "auto" (`choose_kernel`: by backend and shape)."""
    name = "dot_product_attention"
    if kernel != "auto" and kernel not in KERNELS:
        raise ParameterError(
            f"{name}: kernel={kernel!r} is none of {', '.join(map(repr, ('auto', *KERNELS)))}"
        )
    if isinstance(scale, bool) or not isinstance(scale, int | float | np.integer | np.floating):
        raise ArgumentError(f"{name}: scale must be a number, got {scale!r}")
    causal = boolean(name, "causal", causal)
    window = integer(name, "window", window, 0)
    names = _names(length, memory, features)
    if k.sizes.get(memory) == 0:  # (NumPy: a bare ValueError)
        raise ShapeError(
            f"{name}: the keys {fmt_dims(k.dims, k.shape)} have no position along {memory!r}, "
            "and a softmax over no keys has no value"
        )
    args = (q, k, v) if bias is None else (q, k, v, bias)
    dims = (tuple(q.dims), tuple(k.dims), () if bias is None else tuple(bias.dims))
    return bind(
        _attention,
        *args,
        scale=float(scale),
        causal=causal,
        window=window,
        kernel=kernel,
        dims=dims,
        names=names,
    )


def _names(*names) -> tuple[str, str, str]:
    """(length, memory, features) as given, each a dim name and no two alike."""
    for param, d in zip(NAMES, names, strict=True):
        if not isinstance(d, str) or not d:
            raise ArgumentError(
                f"dot_product_attention: {param}= must be a dim name (a non-empty str), got {d!r}"
            )
    for i, a in enumerate(names):
        for j in range(i + 1, len(names)):
            if names[j] == a:
                raise ParameterError(
                    f"dot_product_attention: {NAMES[i]}= and {NAMES[j]}= both name dim "
                    f"{a!r}; the three dims must differ"
                )
    return tuple(names)


def _example(a, b, d, k):
    """Random programs' step (namedmesh/testing/strategies.py): self-attention over a's
    dims whatever their names: `d` the queries' positions, another of a's dims (by k)
    the features, every other dim a head; the keys a's values with `d` renamed (their
    positions), by k with one head fewer (grouped heads), a bias over heads and keys,
    causal, a window."""
    others = [x for x in a.dims if x != d]
    if not others:
        return None
    features = others[k % len(others)]
    heads = [x for x in others if x != features]
    memory = d + "_m"
    keys = rename(a * 0.5, {d: memory})
    if heads and k % 5 == 0:
        keys = keys.sum(heads[0])
    bias = rename(a.sum(features), {d: memory}) if k % 3 == 0 else None
    return dot_product_attention(
        a,
        keys,
        keys + 0.25,
        bias,
        scale=0.5,
        causal=bool(k % 2),
        window=k % 4,
        length=d,
        memory=memory,
        features=features,
    )


_attention.example = _example
