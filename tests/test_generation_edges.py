"""Generation at its edges, found by fuzzing sampling, batched decoding and model I/O
against independent oracles (NumPy's argmax, transformers' processors and generate)."""

import jax
import numpy as np
import pytest

from models.inference.sampling import Sampling, choose, filter_logits
from namedmesh.errors import ParameterError

LOGITS = np.random.default_rng(0).normal(0, 3, (4, 50)).astype(np.float32)


@pytest.mark.parametrize("temperature", [1e-3, 1e-30, 2e-38])
@pytest.mark.parametrize("k,p", [(0, 1.0), (5, 1.0), (0, 0.9), (5, 0.5)])
def test_a_cold_temperature_draws_the_likeliest_token(temperature, k, p):
    """As the temperature goes to 0 a draw is the argmax (NumPy's): logits / 2e-38 once
    overflowed to inf (NaN in the softmax) and every row drew token 0 or 1."""
    got = choose(LOGITS, jax.random.key(0), Sampling(temperature, k, p))
    np.testing.assert_array_equal(np.asarray(got), LOGITS.argmax(-1))
    kept = np.isfinite(np.asarray(filter_logits(LOGITS, Sampling(temperature, k, p))))
    assert (kept.sum(-1) >= 1).all()


@pytest.mark.parametrize("temperature", [1e-40, 1e-50])
def test_a_temperature_xla_flushes_to_zero_is_refused(temperature):
    with pytest.raises(ParameterError, match=rf"temperature \(--temperature\) {temperature}"):
        Sampling(temperature)


def draws(seed: int) -> list[int]:
    """32 tokens drawn by `Sampling(seed=seed)` from one flat distribution."""
    logits = np.zeros((32, 1000), np.float32)
    return np.asarray(choose(logits, Sampling(seed=seed).key(), Sampling(seed=seed))).tolist()


def test_seeds_that_differ_past_32_bits_draw_differently():
    """x64 off, jax.random.key(2**32) is key(0): seeds 0, 2**32 and 2**40 drew the
    same tokens (and -1 drew 2**32 - 1's). Small seeds keep their keys."""
    seeds = [0, 2**32, 2**40, 2**64 - 1, -1, 2**32 - 1, 7]
    got = {s: tuple(draws(s)) for s in seeds}
    assert got[-1] == got[2**64 - 1]  # the seed modulo 2**64, as torch.manual_seed
    assert len({got[s] for s in seeds if s != -1}) == len(seeds) - 1
    np.testing.assert_array_equal(
        jax.random.key_data(Sampling(seed=7).key()), jax.random.key_data(jax.random.key(7))
    )


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(temperature="0.7"), r"temperature \(--temperature\) must be a number"),
        (dict(top_p="0.9"), r"top_p \(--top-p\) must be a number"),
        (dict(temperature=None), r"temperature \(--temperature\) must be a number"),
        (dict(seed=2**64), r"seed \(--seed\) must be an int in \[-2\*\*63, 2\*\*64\)"),
    ],
)
def test_sampling_options_of_the_wrong_type_are_parameter_errors(options, match):
    """Once a raw TypeError from `0 < '0.7'`, and an OverflowError at the first draw."""
    with pytest.raises(ParameterError, match=match):
        Sampling(**options)
