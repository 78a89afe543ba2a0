"""Rotary position embeddings' frequencies: one function per scaling kind (the
`rope_type` of a Hugging Face config.json), each giving the inverse frequencies of
d_kv's pairs and the factor on cos and sin (YaRN's attention factor). The formulas
are transformers' (modeling_rope_utils.py); the record `Rope` holds one kind's
parameters, so a Config stays hashable."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from models.errors import ConfigError


@dataclass(frozen=True)
class Rope:
    """Rotary positions' base `theta` and how their frequencies are scaled: `kind`
    (default, linear, dynamic, llama3, yarn, longrope) and its parameters;
    `original_positions` is the pretraining context (original_max_position_embeddings;
    dynamic: max_position_embeddings); `fraction` of d_kv is rotated."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_positions: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float = 0.0  # yarn, longrope: 0 = derived from factor (and mscale)
    mscale: float = 0.0  # yarn
    mscale_all_dim: float = 0.0  # yarn
    truncate: bool = True  # yarn
    fraction: float = 1.0  # the first int(d_kv * fraction) dims rotate (partial_rotary_factor)
    short_factor: tuple[float, ...] = ()  # longrope: per-pair divisors within original_positions
    long_factor: tuple[float, ...] = ()  # longrope: per-pair divisors past original_positions

    def __post_init__(self):
        for name in ("short_factor", "long_factor"):  # a list from --set: hashable
            object.__setattr__(self, name, tuple(float(f) for f in getattr(self, name)))
        if self.kind not in SCALINGS:
            raise ConfigError(f"Rope.kind must be one of {sorted(SCALINGS)}, got {self.kind!r}")
        if not 0 < self.fraction <= 1:
            raise ConfigError(
                f"Rope.fraction (partial_rotary_factor) must be in (0, 1], got {self.fraction}"
            )

    def check(self, dims: int) -> None:
        """ConfigError unless longrope's factors hold one value per pair of the `dims`
        rotated dims of d_kv."""
        for name in ("short_factor", "long_factor") if self.kind == "longrope" else ():
            if len(getattr(self, name)) != dims // 2:
                raise ConfigError(
                    f"Rope.{name} has {len(getattr(self, name))} values; the {dims} rotated "
                    f"dims of d_kv have {dims // 2} pairs"
                )


def base_frequencies(dim: int, theta: float) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)


def _default(rope: Rope, dim: int, seq_len: int):
    return base_frequencies(dim, rope.theta), 1.0


def _linear(rope: Rope, dim: int, seq_len: int):
    return base_frequencies(dim, rope.theta) / rope.factor, 1.0


def _dynamic(rope: Rope, dim: int, seq_len: int):
    """NTK-aware: the base grows with the sequence once it passes the original context
    (transformers recomputes it from the longest position a forward pass sees)."""
    n, f = max(seq_len, rope.original_positions), rope.factor
    base = rope.theta * ((f * n / rope.original_positions) - (f - 1)) ** (dim / (dim - 2))
    return base_frequencies(dim, base), 1.0


def _llama3(rope: Rope, dim: int, seq_len: int):
    inv = base_frequencies(dim, rope.theta)
    old, f = rope.original_positions, rope.factor
    low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / f, inv)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / f + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_mscale(rope: Rope) -> float:
    """The factor on attention's softmax scale that YaRN's mscale_all_dim asks of latent
    attention (DeepSeek's q.k scale times mscale squared: transformers'
    yarn_apply_mscale); 1 otherwise."""
    if rope.kind != "yarn" or not rope.mscale_all_dim:
        return 1.0
    return _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2


def _yarn(rope: Rope, dim: int, seq_len: int):
    f, theta = rope.factor, rope.theta
    factor = rope.attention_factor
    if not factor:
        factor = (
            _yarn_mscale(f, rope.mscale) / _yarn_mscale(f, rope.mscale_all_dim)
            if rope.mscale and rope.mscale_all_dim
            else _yarn_mscale(f)
        )

    def correction(rotations):
        return (dim * math.log(rope.original_positions / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction(rope.beta_fast), correction(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos = theta ** (np.arange(0, dim, 2).astype(np.float32) / dim)
    inv = (1 / (f * pos)) * (1 - extrapolation) + (1 / pos) * extrapolation
    return inv.astype(np.float32), float(factor)


def _longrope(rope: Rope, dim: int, seq_len: int):
    """LongRoPE (Phi-3): each pair's frequency divided by its short factor, or by its
    long factor once the pass is longer than original_positions; cos and sin scaled by
    sqrt(1 + log(factor) / log(original_positions)) unless attention_factor is given."""
    rope.check(dim)
    long = seq_len > rope.original_positions
    factors = np.asarray(rope.long_factor if long else rope.short_factor, np.float32)
    scale = rope.attention_factor
    if not scale:
        f = rope.factor
        scale = 1.0 if f <= 1 else math.sqrt(1 + math.log(f) / math.log(rope.original_positions))
    pos = rope.theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)
    return (1.0 / (factors * pos)).astype(np.float32), float(scale)


SCALINGS = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
}


def frequencies(rope: Rope, dim: int, seq_len: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies over dim // 2 pairs, factor on cos and sin) for positions
    below `seq_len` (only dynamic scaling depends on it)."""
    inv, factor = SCALINGS[rope.kind](rope, dim, seq_len)
    return np.asarray(inv, np.float32), factor


def depends_on_length(rope: Rope) -> bool:
    """Whether the frequencies change with the sequence (dynamic NTK; longrope past
    original_positions), so keys rotated for a KV cache would differ from a full
    forward pass's."""
    return rope.kind in ("dynamic", "longrope")


def rotary_dims(rope: Rope, d_kv: int) -> int:
    """How many of d_kv's dims are rotated (the rest pass through): int(d_kv * fraction),
    as transformers' partial_rotary_factor (GPT-NeoX's rotary_pct)."""
    return int(d_kv * rope.fraction)
