"""Choosing the next token from next-token logits: the likeliest (greedy), or a draw
from softmax(logits / temperature) restricted to the `top_k` likeliest tokens and to
the nucleus (`top_p`): the fewest likeliest tokens whose probability adds up to at
least top_p (Holtzman et al. 2019). Filters apply in that order (temperature, top-k,
top-p, the nucleus measured on the top-k's renormalised distribution), as in
`transformers`' sampling processors.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from namedmesh.errors import ParameterError

TINY = float(np.finfo(np.float32).tiny)  # the coldest temperature the logits divide by


@dataclass(frozen=True)
class Sampling:
    """How a token is drawn: `temperature` > 0 divides the logits; `top_k` >= 0 keeps
    the k likeliest tokens (0: all; ties with the k-th are kept); `top_p` in (0, 1]
    keeps the nucleus (1: all); `seed` (an int in [-2**63, 2**64), all its bits used:
    `key`) seeds the draws (the same seed, the same tokens).
    A bad value raises ParameterError naming the parameter and its command-line flag.
    Two Samplings that differ in their seed alone are equal (and hash alike): a
    decoder's compiled programs are kept per Sampling, and the seed is their input."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = field(default=0, compare=False)

    def __post_init__(self):
        for name, flag in (("temperature", "--temperature"), ("top_p", "--top-p")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ParameterError(f"{name} ({flag}) must be a number, got {value!r}")
        if not 0 < self.temperature < math.inf:  # also refuses NaN; inf samples uniformly
            raise ParameterError(
                f"temperature (--temperature) must be > 0 and finite, got {self.temperature!r}"
            )
        if self.temperature < TINY:  # XLA flushes float32's subnormals to 0: x / 0
            raise ParameterError(
                f"temperature (--temperature) {self.temperature!r} is below float32's "
                f"smallest normal {TINY:.2e} (0 to XLA): use --mode greedy"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ParameterError(
                f"top_k (--top-k) must be an int >= 0 (0: off), got {self.top_k!r}"
            )
        if not 0 < self.top_p <= 1:
            raise ParameterError(f"top_p (--top-p) must be in (0, 1] (1: off), got {self.top_p!r}")
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64:
            raise ParameterError(f"seed (--seed) must be an int in [-2**63, 2**64), got {seed!r}")

    def key(self) -> jax.Array:
        """The random key of the seed, all 64 bits of it (modulo 2**64, as
        torch.manual_seed): with x64 off, jax.random.key(seed) keeps its low 32 bits
        alone, so seeds 0 and 2**32 drew alike. A seed in [0, 2**32) has
        jax.random.key(seed)'s key."""
        seed = self.seed % 2**64
        return jax.random.wrap_key_data(np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32))


def filter_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """logits (..., vocab) less their row's largest, divided by the temperature, in
    float32, with every token outside the top-k and outside the nucleus set to -inf: the
    logits of the distribution `choose` draws from."""
    x = logits.astype(jnp.float32)
    # shifted first (the distribution is the same): the likeliest is then 0 at any
    # temperature, and a cold one sends the others to -inf, where logits / 1e-40 sent the
    # likeliest to inf, a NaN softmax and a draw of token 0
    x = (x - x.max(-1, keepdims=True)) / jnp.float32(sampling.temperature)
    if 0 < sampling.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, sampling.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if sampling.top_p < 1:
        order = jnp.argsort(-x, axis=-1, stable=True)  # likeliest first, ties by index
        probs = jax.nn.softmax(jnp.take_along_axis(x, order, -1), -1)
        above = jnp.cumsum(probs, -1) - probs  # the mass of the tokens ranked before
        keep = jnp.take_along_axis(above < sampling.top_p, jnp.argsort(order, -1), -1)
        x = jnp.where(keep, x, -jnp.inf)
    return x


def choose(logits: jax.Array, key: jax.Array | None, sampling: Sampling | None) -> jax.Array:
    """The next token (int32) of each row of logits (batch, vocab): the likeliest when
    `sampling` is None (greedy; the first on ties), else a draw with `key`."""
    if sampling is None:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits, sampling), -1).astype(jnp.int32)
