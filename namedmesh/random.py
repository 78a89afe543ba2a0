"""Random numbers whose values depend on the key and the global sizes only.

Every element is a function of (key, its global position): a Threefry-2x32 counter
hash of the element's flat index in the tensor's dims order. A shard of a tensor can
therefore be generated alone (`random_values(..., offsets=...)`) and equals the same
slice of the whole, so values do not depend on how a layout later splits them.
A key is a Tensor of two uint32 words along the dim "key": `nm.random.key(seed)`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from namedmesh import elementwise as ew
from namedmesh.checks import fits_dtype, integer
from namedmesh.errors import DtypeError, ShapeError
from namedmesh.primitive import Aval, Cost, bind, is_inexact, primitive
from namedmesh.tensor import Tensor, native_dtype, parse_sizes

KEY_DIM = "key"
_U32 = np.dtype(np.uint32)
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def threefry2x32(k0, k1, x0, x1, xp=np):
    """Threefry-2x32 with 20 rounds (Salmon et al. 2011), on uint32 arrays of `xp`."""
    u32 = lambda v: xp.asarray(v, dtype=xp.uint32)
    k0, k1, x0, x1 = u32(k0), u32(k1), u32(x0), u32(x1)
    ks = (k0, k1, k0 ^ k1 ^ u32(0x1BD11BDA))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = (x1 << u32(r)) | (x1 >> u32(32 - r))
            x1 = x1 ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + u32(i + 1)
    return x0, x1


def _counters(shape, offsets, global_shape, xp):
    """Flat global index (uint32) of each element of a block at `offsets` of `global_shape`."""
    idx = xp.zeros(shape, dtype=xp.uint32)
    stride = 1
    for ax in reversed(range(len(shape))):
        pos = xp.arange(shape[ax], dtype=xp.uint32) + xp.asarray(offsets[ax], dtype=xp.uint32)
        bshape = [1] * len(shape)
        bshape[ax] = shape[ax]
        idx = idx + pos.reshape(bshape) * xp.asarray(stride % 2**32, dtype=xp.uint32)
        stride *= global_shape[ax]
    return idx


def _words(key, shape, offsets, global_shape, xp):
    """The two hash words of each element of the block: Threefry of its flat index."""
    with np.errstate(over="ignore"):
        return threefry2x32(key[0], key[1], _counters(shape, offsets, global_shape, xp), 0, xp)


# Eager jax (a concrete key, as a model's parameters are drawn): the hash's 130-odd
# uint32 ops as one program compiled per shape, where jax would compile each op for each
# new shape (seconds per parameter shape, in every process). Integer ops: the words are
# bit for bit the eager ones. The float ops after them stay eager (XLA may contract a
# fused multiply-add: uniform's values would move by an ulp). Traced, they are inlined.
_eager_words = jax.jit(functools.partial(_words, xp=jnp), static_argnums=(1, 2, 3))
_eager_fold = jax.jit(lambda key, data, stream: threefry2x32(key[0], key[1], data, stream, jnp))


def _concrete(*values) -> bool:
    return not any(isinstance(v, jax.core.Tracer) for v in values)


def random_values(key, global_shape, dist, dtype, args, xp=np, offsets=None, shape=None):
    """Values of `dist` for the block of `global_shape` at `offsets` with local `shape`.

    With the defaults the block is the whole tensor. `args` are the distribution's
    parameters: (minval, maxval) for uniform, (p,) for bernoulli, (low, high) for integers.
    """
    shape = tuple(global_shape) if shape is None else tuple(shape)
    offsets = (0,) * len(shape) if offsets is None else offsets
    if xp is jnp and _concrete(key, *offsets):
        offsets = tuple(int(o) for o in offsets)
        w0, w1 = _eager_words(key, shape, offsets, tuple(global_shape))
    else:
        w0, w1 = _words(key, shape, offsets, global_shape, xp)
    f32 = xp.float32
    unit = lambda w: (w >> xp.asarray(8, dtype=xp.uint32)).astype(f32) * f32(2.0**-24)
    if dist == "uniform":
        lo, hi = args
        out = (f32(lo) + unit(w0) * f32(hi - lo)).astype(dtype)
        # lo + u * (hi - lo) rounds to hi for u near 1 (bfloat16's 1.0, float32's [2, 3))
        return out if not hi > lo else xp.minimum(out, xp.asarray(_below(hi, dtype), dtype))
    if dist == "normal":
        r = xp.sqrt(f32(-2.0) * xp.log(f32(1.0) - unit(w0)))
        return (r * xp.cos(f32(2 * np.pi) * unit(w1))).astype(dtype)
    if dist == "bernoulli":
        return unit(w0) < f32(args[0])
    if dist == "integers":
        return _integers(w0, w1, *args, np.dtype(dtype), xp)
    raise ValueError(f"unknown distribution {dist!r}")


def _below(hi: float, dtype) -> np.ndarray:
    """The largest value of the float `dtype` below `hi`."""
    b = np.asarray(hi, dtype)
    while float(b) >= hi:
        b = np.nextafter(b, np.asarray(-np.inf, dtype))
    return b


def _mulhi(a, b, xp):
    """The high 32 bits of the 64-bit product of uint32 arrays a and b, in 16-bit halves
    (jax has no 64-bit integers unless x64 is on)."""
    m16, s16 = xp.asarray(0xFFFF, xp.uint32), xp.asarray(16, xp.uint32)
    al, ah, bl, bh = a & m16, a >> s16, b & m16, b >> s16
    hl = ah * bl
    cross = ((al * bl) >> s16) + (hl & m16) + al * bh  # < 2**32: no carry lost
    return ah * bh + (hl >> s16) + (cross >> s16)


def _integers(w0, w1, lo: int, hi: int, dtype: np.dtype, xp):
    """lo + floor(w * (hi - lo) / 2**64), w the two words as one 64-bit fraction: every
    value of [lo, hi) within 2**-32 of equally likely (one word modulo hi - lo favoured
    the low values up to twice, and its sum wrapped past int32's top)."""
    u32 = lambda v: xp.asarray(v, dtype=xp.uint32)
    span = hi - lo
    if span == 2**32:
        r = w1
    else:
        low_word = w1 * u32(span)  # (wraps: the low 32 bits)
        carry = (low_word + _mulhi(w0, u32(span), xp)) < low_word
        r = _mulhi(w1, u32(span), xp) + carry.astype(xp.uint32)
    if dtype.itemsize > 4:
        return xp.asarray(lo, dtype) + r.astype(dtype)
    out = u32(lo % 2**32) + r  # lo + r, in [lo, hi): exact once wrapped to 32 bits
    return (out.astype(xp.int32) if dtype.kind == "i" else out).astype(dtype)


def _check_key(key, op):
    if key.dims != (KEY_DIM,) or key.shape != (2,) or key.dtype != _U32:
        raise ShapeError(
            f"{op}: a key is a uint32 Tensor with dims ({KEY_DIM!r},) of size 2 made by "
            f"nm.random.key(seed), got {key.dtype} {key.dims} of shape {key.shape}"
        )


def _random_rule(key, dims, shape, dist, dtype, args):
    _check_key(key, dist)
    return Aval(dims, shape, dtype)


def _random_cost(in_avals, out_avals, params) -> Cost:
    n = math.prod(out_avals[0].shape)
    return Cost(60 * n, out_avals[0].nbytes)  # 20 rounds of 3 uint32 ops per element


_random = primitive(
    "random",
    _random_rule,
    lambda key, dims, shape, dist, dtype, args: random_values(key, shape, dist, dtype, args),
    lambda key, dims, shape, dist, dtype, args: random_values(key, shape, dist, dtype, args, jnp),
    cost_rule=_random_cost,
    backward_reads="nothing",
)


def _fold_in(key, data, stream, xp):
    if xp is jnp and _concrete(key):  # one compile per process, not one per op (above)
        w0, w1 = _eager_fold(key, np.uint32(data % 2**32), np.uint32(stream))
        return xp.stack([w0, w1])
    with np.errstate(over="ignore"):
        w0, w1 = threefry2x32(key[0], key[1], data % 2**32, stream, xp)
    return xp.stack([w0, w1])


_fold_in_prim = primitive(
    "random_fold_in",
    lambda key, data, stream: (_check_key(key, "fold_in"), Aval(key.dims, key.shape, _U32))[1],
    lambda key, data, stream: _fold_in(key, data, stream, np),
    lambda key, data, stream: _fold_in(key, data, stream, jnp),
    cost_rule=lambda i, o, p: Cost(60, 16),
    backward_reads="nothing",
)


def key(seed: int) -> Tensor:
    """A key from an integer seed."""
    seed = integer("key", "seed", seed)
    if not -(2**63) <= seed < 2**64:  # (its low 64 bits alone: key(2**64) was key(0))
        raise ShapeError(f"key: seed {seed} does not fit 64 bits")
    words = np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], dtype=_U32)
    return Tensor._make(words, (KEY_DIM,))


def _as_key(k) -> Tensor:
    return key(k) if isinstance(k, int | np.integer) else k


def fold_in(k: Tensor | int, data: int) -> Tensor:
    """A new key from `k` and an integer (a step number, a layer index)."""
    return bind(_fold_in_prim, _as_key(k), data=integer("fold_in", "data", data), stream=0)


def split(k: Tensor | int, n: int = 2) -> tuple[Tensor, ...]:
    """`n` independent keys from `k`."""
    k = _as_key(k)
    return tuple(bind(_fold_in_prim, k, data=i, stream=1) for i in range(n))


def _draw(k, sizes, dist, dtype, args):
    dims, shape = parse_sizes(sizes, dist)
    return bind(
        _random,
        _as_key(k),
        dims=dims,
        shape=shape,
        dist=dist,
        dtype=native_dtype(dtype),
        args=tuple(args),
    )


def _float_dtype(op: str, dtype) -> np.dtype:
    dt = native_dtype(dtype)
    if not is_inexact(dt):
        raise DtypeError(f"{op}: dtype must be a float dtype, got {dt.name}")
    return dt


def uniform(k, sizes: Mapping[str, int], minval=0.0, maxval=1.0, dtype=np.float32) -> Tensor:
    """Uniform values in [minval, maxval)."""
    dtype = _float_dtype("uniform", dtype)
    return _draw(k, sizes, "uniform", dtype, (float(minval), float(maxval)))


def normal(k, sizes: Mapping[str, int], dtype=np.float32) -> Tensor:
    """Standard normal values (Box-Muller on two words of the hash)."""
    dtype = _float_dtype("normal", dtype)
    return _draw(k, sizes, "normal", dtype, ())


def bernoulli(k, sizes: Mapping[str, int], p=0.5) -> Tensor:
    """Booleans, True with probability `p`."""
    if not 0.0 <= float(p) <= 1.0:
        raise ShapeError(f"bernoulli: p={p!r} must be in [0, 1]")
    return _draw(k, sizes, "bernoulli", bool, (float(p),))


def integers(k, sizes: Mapping[str, int], low: int, high: int, dtype=np.int32) -> Tensor:
    """Integers in [low, high)."""
    low, high = integer("integers", "low", low), integer("integers", "high", high)
    if not high > low:
        raise ShapeError(f"integers: high={high!r} must exceed low={low!r}")
    if int(high) - int(low) > 2**32:
        raise ShapeError(f"integers: the range [{low}, {high}) is wider than 2**32")
    dtype = native_dtype(dtype)
    if dtype.kind not in "iu":
        raise DtypeError(f"integers: dtype must be an integer dtype, got {dtype.name}")
    for what, bound in (("low", low), ("high - 1", high - 1)):
        fits_dtype("integers", what, bound, dtype)
    return _draw(k, sizes, "integers", dtype, (low, high))


def dropout(x: Tensor, rate: float, k) -> Tensor:
    """Zero each element with probability `rate` and scale the rest by 1 / (1 - rate).

    The mask is `bernoulli(k, x.sizes, 1 - rate)`: the same under every layout.
    """
    if not 0.0 <= float(rate) < 1.0:
        raise ShapeError(f"dropout: rate={rate!r} must be in [0, 1)")
    if rate == 0:
        return x
    keep = 1.0 - float(rate)
    return ew.where(bernoulli(k, x.sizes, keep), x / keep, 0)


# How the property strategies' random programs apply these (Primitive.example): noise and
# dropout's mask, each from a key folded from the choice
_random.example = lambda a, b, d, k: a + normal(fold_in(7, k), a.sizes) * 0.5
_fold_in_prim.example = lambda a, b, d, k: dropout(a, 0.5, fold_in(key(k), k + 1))
