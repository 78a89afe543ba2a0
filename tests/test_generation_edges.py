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
