"""Multi-head latent attention (DeepSeek-V2/V3, arXiv 2405.04434): an attention variant
the shared block takes from Config.mla (models/layers/latent.py has its sizes).

Queries come from a low-rank latent (q_a, its RMSNorm, q_b) or one projection; keys and
values from one `latent` per position (kv_a, its RMSNorm) that kv_b expands into every
head's key without positions (`nope` dims) and value (`v` dims), beside a rotated key
part (`k_rope`, d_kv dims) that all heads share. A head's logit is q.k over its nope and
rotated dims, scaled by (nope + d_kv)**-0.5 times YaRN's mscale squared
(models.layers.rope.softmax_mscale).

The KV cache holds what the keys and values are made from, the normed latent and the
rotated shared key, (kv_rank + d_kv) numbers per position and layer, not
heads x (nope + d_kv + v). A pass or a prefill runs cfg.attention's kernel
(models/layers/kernels.py) on the expanded keys and values (the narrower of queries and
keys or values padded with zeros to the other's width, the padding cut from the
result, as transformers does for its fused kernels); a decoding step attends in the
latent space (`absorbed`), never expanding the cache.
"""

from __future__ import annotations

import numpy as np

import namedmesh as nm
from models.architecture import Config, ConfigError
from models.layers.blockwise import softcap
from models.layers.common import PLAIN, Param, kernel_for, norm, options, rotate_qk, write_slots
from models.layers.kernels import Options
from models.layers.rope import softmax_mscale

BTH = ("batch", "length", "heads")


def params(cfg: Config) -> dict:
    """q (or q_a, q_a_norm, q_b), kv_a, k_rope, kv_norm, kv_b and o. The per-head dims
    `d_qk` (nope then rotated) and `d_kvb` (the key's nope then the value) are one dim
    each, as the files fuse them per head."""
    m, d, h, r = cfg.mla, cfg.d_model, cfg.heads, cfg.d_kv
    qk = {"heads": h, "d_qk": m.nope + r}
    p = {
        "kv_a": Param({"d_model": d, "latent": m.kv_rank}, d**-0.5),
        "k_rope": Param({"d_model": d, "d_kv": r}, d**-0.5),
        "kv_norm": {"scale": Param({"latent": m.kv_rank}, "ones")},
        "kv_b": Param({"latent": m.kv_rank, "heads": h, "d_kvb": m.nope + m.v}, m.kv_rank**-0.5),
        "o": Param({"heads": h, "d_v": m.v, "d_model": d}, (h * m.v) ** -0.5),
    }
    if not m.q_rank:
        return {**p, "q": Param({"d_model": d, **qk}, d**-0.5)}
    return {
        **p,
        "q_a": Param({"d_model": d, "q_latent": m.q_rank}, d**-0.5),
        "q_a_norm": {"scale": Param({"q_latent": m.q_rank}, "ones")},
        "q_b": Param({"q_latent": m.q_rank, **qk}, m.q_rank**-0.5),
    }


def cache(cfg: Config) -> dict:
    """One position's cached sizes besides layers, batch and memory: the normed latent
    and the rotated key all heads share."""
    return {"latent": {"latent": cfg.mla.kv_rank}, "k_rope": {"d_kv": cfg.d_kv}}


def scale(cfg: Config) -> float:
    """The softmax scale: (nope + rotated dims)**-0.5, times YaRN's mscale squared."""
    return (cfg.mla.nope + cfg.d_kv) ** -0.5 * softmax_mscale(cfg.rope)


def queries(x: nm.Tensor, p: dict, cfg: Config) -> tuple[nm.Tensor, nm.Tensor]:
    """(q without positions (.., d_qk=nope), q to rotate (.., d_kv)) of x."""
    if "q" in p:
        q = nm.einsum(x, p["q"], out=(*BTH, "d_qk"))
    else:
        a = nm.einsum(x, p["q_a"], out=("batch", "length", "q_latent"))
        a = norm(a, p["q_a_norm"], "rms", cfg.mla.eps, "q_latent")
        q = nm.einsum(a, p["q_b"], out=(*BTH, "d_qk"))
    nope, rot = nm.split(q, "d_qk", (cfg.mla.nope, cfg.d_kv))
    return nope, rot.rename(d_qk="d_kv")


def deinterleave(x: nm.Tensor) -> nm.Tensor:
    """x's d_kv reordered from pairs (0, 1), (2, 3), ... to the evens then the odds, so
    that rotating halves rotates DeepSeek's interleaved pairs; a dot product over d_kv
    of two tensors so reordered is unchanged."""
    n = x.size_of("d_kv")
    pairs = nm.reshape(x, {"pair": n // 2, "two": 2}, from_="d_kv")
    at = pairs.dims.index("pair")
    order = (*pairs.dims[:at], "two", "pair", *pairs.dims[at + 2 :])
    return nm.reshape(pairs.transpose(*order), {"d_kv": n}, from_="two pair")


def latents(x: nm.Tensor, p: dict, cfg: Config) -> tuple[nm.Tensor, nm.Tensor]:
    """(normed latent (batch, memory, latent), unrotated shared key (batch, memory, d_kv))
    of x's positions."""
    src = x.rename(length="memory")
    latent = nm.einsum(src, p["kv_a"], out=("batch", "memory", "latent"))
    latent = norm(latent, p["kv_norm"], "rms", cfg.mla.eps, "latent")
    return latent, nm.einsum(src, p["k_rope"], out=("batch", "memory", "d_kv"))


def keys_values(latent: nm.Tensor, k_rope: nm.Tensor, p: dict, cfg: Config):
    """(keys (batch, memory, heads, d_kv=nope+rotated), values (.., d_kv=v)) expanded
    from the latents, the narrower padded with zeros to the other's width (kernels take
    keys and values of one width; zeros change neither q.k nor the values' dims)."""
    m = cfg.mla
    kvb = nm.einsum(latent, p["kv_b"], out=("batch", "memory", "heads", "d_kvb"))
    k_nope, v = nm.split(kvb, "d_kvb", (m.nope, m.v))
    shared = nm.expand_dims(k_rope, {"heads": cfg.heads}).transpose(*k_nope.dims[:-1], "d_kv")
    k = nm.concat([k_nope.rename(d_kvb="d_kv"), shared], "d_kv")
    return widened(k, m.v), widened(v.rename(d_kvb="d_kv"), m.nope + cfg.d_kv)


def widened(t: nm.Tensor, width: int) -> nm.Tensor:
    """t padded with zeros along d_kv up to `width` (t itself when as wide or wider)."""
    extra = width - t.size_of("d_kv")
    return nm.pad(t, {"d_kv": (0, extra)}) if extra > 0 else t


def projected(x: nm.Tensor, p: dict, cfg: Config) -> tuple:
    """(q without positions, q to rotate, normed latent, shared key to rotate) of x, the
    rotated parts' pairs de-interleaved where the checkpoint interleaves them."""
    q_nope, q_rot = queries(x, p, cfg)
    latent, k_rot = latents(x, p, cfg)
    if cfg.mla.interleave:
        q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
    return q_nope, q_rot, latent, k_rot


def attention(x: nm.Tensor, p: dict, cfg: Config, bias=None, how=PLAIN, source=None):
    """Latent self-attention of x (batch, length, d_model) with models.layers.common.attention's
    signature and contract (no cross-attention: `source` must be None)."""
    if source is not None:
        raise ConfigError("Config.mla: latent attention is self-attention (no cross-attention)")
    q_nope, q_rot, latent, k_rot = projected(x, p, cfg)
    q_rot, k_rot = rotate_qk(q_rot, k_rot, cfg, None, how.position, how.layer)
    o = expanded((q_nope, q_rot), (latent, k_rot), p, cfg, options(cfg, bias, how, False))
    return nm.einsum(o, p["o"], out=("batch", "length", "d_model"))


def cached_attention(x: nm.Tensor, p: dict, cfg: Config, bias, how, cache: dict):
    """(out, {"latent", "k_rope"}): models.layers.common.cached_attention's contract, the cache
    holding each position's normed latent and rotated shared key (batch, memory, ...).
    A step attends in the latent space (`absorbed`); a prefill expands the keys."""
    q_nope, q_rot, latent, k_rot = projected(x, p, cfg)
    slots, position = cache["latent"].size_of("memory"), how.position
    q_rot, k_rot = rotate_qk(q_rot, k_rot, cfg, slots, position, how.layer)
    latent = write_slots(cache["latent"], latent, position)
    k_rot = write_slots(cache["k_rope"], k_rot, position)
    if "length" not in position.dims:  # a step: in the latent space
        o = absorbed((q_nope, q_rot), (latent, k_rot), p, cfg, bias)
    else:
        o = expanded((q_nope, q_rot), (latent, k_rot), p, cfg, options(cfg, bias, how, True))
    out = nm.einsum(o, p["o"], out=("batch", "length", "d_model"))
    return out, {"latent": latent, "k_rope": k_rot}


def expanded(q: tuple, kv: tuple, p: dict, cfg: Config, opts: Options):
    """Attention (batch, length, heads, d_v) of the queries (without positions, rotated)
    over the keys and values kv_b makes of the (latents, rotated shared keys), by
    cfg.attention's kernel (a pass, or a prefill) with `opts`."""
    (q_nope, q_rot), (latent, k_rot) = q, kv
    k, v = keys_values(latent, k_rot, p, cfg)
    q = widened(nm.concat([q_nope.rename(d_qk="d_kv"), q_rot], "d_kv"), cfg.mla.v)
    opts = opts._replace(scale=scale(cfg))
    o = kernel_for(cfg, opts, q.size_of("length"))(q, k, v, opts)
    if cfg.mla.v < o.size_of("d_kv"):
        o = nm.slice(o, "d_kv", 0, cfg.mla.v)
    return o.rename(d_kv="d_v")


def absorbed(q: tuple, kv: tuple, p: dict, cfg: Config, bias):
    """A decoding step's attention (batch, length, heads, d_v) without expanding the
    cache: kv_b's key part is applied to the query instead of to every cached latent
    (q_nope.k_nope = (q_nope W_k).latent), the weights average the latents, and kv_b's
    value part is applied once to that average (DeepSeek-V2's absorbed form): per step
    heads x (kv_rank + d_kv) per cached position, not kv_rank x heads x (nope + v).
    Logits and softmax in float32, soft-capped as the kernels do."""
    m, (q_nope, q_rot), (latent, k_rot) = cfg.mla, q, kv
    w_k, w_v = nm.split(p["kv_b"], "d_kvb", (m.nope, m.v))
    q_latent = nm.einsum(q_nope, w_k.rename(d_kvb="d_qk"), out=(*BTH, "latent"))
    f32, logit_dims = np.float32, ("batch", "heads", "length", "memory")
    logits = nm.einsum(q_latent, latent, out=logit_dims, preferred_element_type=f32)
    logits = logits + nm.einsum(q_rot, k_rot, out=logit_dims, preferred_element_type=f32)
    logits = logits * scale(cfg)
    if cfg.parts.attention_softcap:
        logits = softcap(logits, cfg.parts.attention_softcap)
    if bias is not None:
        logits = logits + bias
    weights = nm.astype(nm.softmax(logits, "memory"), latent.dtype)
    average = nm.einsum(weights, latent, out=(*BTH, "latent"))
    return nm.einsum(average, w_v.rename(d_kvb="d_v"), out=(*BTH, "d_v"))
