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


@pytest.fixture(scope="module")
def peaked():
    """A tiny zoo LM with peaked predictions, its Decoder, and its log-probabilities
    by the full forward pass (test_decode's oracle)."""
    from models import transformer
    from models.architecture import Config
    from models.inference.decoding import Decoder
    from tests.test_decode import full_logits

    cfg = Config(vocab=32, d_model=16, heads=4, d_kv=4, d_ff=32, layers=2, length=8, batch=2)
    params = transformer.init(transformer.lm_shapes(cfg), 0)
    params["embed"] = params["embed"] * 3.0

    def logp(rows):
        x = full_logits(params, cfg, np.asarray(rows))[:, -1].astype(np.float64)
        return (
            x
            - x.max(-1, keepdims=True)
            - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
        )

    return cfg, Decoder(params, cfg), logp


def test_a_beam_ends_a_hypothesis_at_an_end_id(peaked):
    """A beam as wide as the vocabulary over 2 tokens with an end id finds the likeliest
    of the one-token continuations that end (the end id) and the two-token ones: it once
    went on past the end id, scoring the tokens after it, and returned a two-token path
    cut at the end id, or another path, where ending at once was likelier."""
    cfg, dec, logp = peaked
    prompt = [7, 2, 9]
    first = logp([prompt])[0]
    second = logp([prompt + [a] for a in range(cfg.vocab)])
    for eos in np.argsort(-first)[:4].tolist():
        paths = {(eos,): first[eos]}
        paths |= {(a, b): first[a] + second[a][b] for a in range(cfg.vocab) if a != eos
                  for b in range(cfg.vocab)}  # fmt: skip
        best = max(paths, key=paths.get)
        seq, score = dec.beam(prompt, 2, beams=cfg.vocab, eos=[eos])
        assert tuple(seq) == best, eos
        assert score == pytest.approx(paths[best], abs=1e-4)
        assert dec.generate(prompt, 2, beams=cfg.vocab, eos=eos) == list(best)


@pytest.mark.parametrize("stops", [5, [b"\n"], [""], {"a": 1}])
def test_stops_that_are_not_strings_are_parameter_errors(stops):
    """`stop=5` was a raw TypeError from list(5); bytes never match decoded text."""
    from models.inference.continuations import check_stops

    with pytest.raises(ParameterError, match=r"stop \(--stop\)"):
        check_stops(stops)
