"""Decoding: the KV cache gives the logits of recomputing the whole prefix, beam search
finds the best continuation where it can be checked exhaustively, and the
`models.cli.generate` command line and `models.load` decode from a training run's checkpoint."""

import itertools

import numpy as np
import pytest

import models
from models import architecture as config
from models import transformer
from models.cli.generate import Decoder
from models.cli.generate import main as gen_main
from models.inference.api import LoadError
from models.inference.sampling import Sampling
from namedmesh.errors import ParameterError
from tests.test_decode import full_logits

CFG = config.Config(vocab=32, d_model=16, heads=4, d_kv=4, d_ff=32, layers=2, length=8, batch=2)


def recompute_logp(params, cfg, rows):
    """Log-probabilities of the next token after each row, from the full forward pass
    (test_decode's oracle: one jitted pass per config over rows padded to its length)."""
    x = full_logits(params, cfg, rows)[:, -1]
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module", params=["absolute", "relative"])
def model(request):
    cfg = CFG if request.param == "absolute" else CFG.replace(relative_bias=4)
    params = transformer.init(transformer.lm_shapes(cfg), 0)
    params["embed"] = params["embed"] * 3.0  # peaked predictions: decoding paths differ
    return params, cfg, Decoder(params, cfg)


def test_cached_decoding_equals_recomputation_at_every_position(model):
    params, cfg, dec = model
    rows = np.random.default_rng(0).integers(0, cfg.vocab, size=(2, cfg.length))
    logp, cache, _ = dec.prefill(rows[:, :1])
    for i in range(1, cfg.length + 1):
        np.testing.assert_allclose(logp, recompute_logp(params, cfg, rows[:, :i]), atol=1e-4)
        if i < cfg.length:
            logp, cache = dec.step(rows[:, i], i, cache)


def test_greedy_past_the_cache_refills_it_with_the_last_half(model):
    """The documented policy: a full cache is rebuilt from the last length/2 tokens."""
    params, cfg, dec = model
    prompt, n = [3, 1, 4], 14
    got = dec.generate(prompt, n)
    toks, start = list(prompt), 0
    for _ in range(n):
        if len(toks) - start > cfg.length:  # the window the cache holds after a refill
            start = len(toks) - cfg.length // 2
        toks.append(int(recompute_logp(params, cfg, [toks[start:]])[0].argmax()))
    assert got == toks[len(prompt) :]
    assert len(set(got)) > 1


def test_beam_of_one_is_greedy_and_scores_are_log_probabilities(model):
    params, cfg, dec = model
    prompt = [5, 6]
    seq, score = dec.beam(prompt, 4, beams=1)
    assert seq == dec.generate(prompt, 4)
    toks, want = list(prompt), 0.0
    for t in seq:
        want += recompute_logp(params, cfg, [toks])[0][t]
        toks.append(t)
    assert score == pytest.approx(want, abs=1e-4)


def test_a_beam_as_wide_as_the_vocabulary_finds_the_best_two_tokens(model):
    params, cfg, dec = model
    prompt = [7, 2, 9]
    seq, score = dec.beam(prompt, 2, beams=cfg.vocab)
    first = recompute_logp(params, cfg, [prompt])[0]
    pairs = list(itertools.product(range(cfg.vocab), repeat=2))
    rows = [prompt + [a] for a in range(cfg.vocab)]
    second = recompute_logp(params, cfg, rows)
    scores = {(a, b): first[a] + second[a][b] for a, b in pairs}
    best = max(scores, key=scores.get)
    assert tuple(seq) == best
    assert score == pytest.approx(scores[best], abs=1e-4)


def test_sampling_is_seeded_and_cold_sampling_is_greedy(model):
    _, _, dec = model
    greedy = dec.generate([1, 2], 6)
    assert dec.generate([1, 2], 6, sampling=Sampling(1e-3, seed=1)) == greedy
    a = dec.generate([1, 2], 6, sampling=Sampling(2.0, seed=1))
    assert a == dec.generate([1, 2], 6, sampling=Sampling(2.0, seed=1))
    draws = {tuple(dec.generate([1, 2], 6, sampling=Sampling(2.0, seed=s))) for s in range(4)}
    assert len(draws) > 1


def test_generate_command_decodes_from_a_training_run(tmp_path, capsys):
    """In process: main() as `python -m` runs it (test_train_cli and test_hub_cli run the
    two command lines as subprocesses); the mesh is 2 of this process's devices."""
    from models.cli.train import main as train_main

    out = tmp_path / "run"
    assert train_main(["--config", "tiny", "--mesh", "data=2", "--layout", "batch:data",
                       "--steps", "3", "--length", "16", "--batch", "4", "--out", str(out),
                       "--quiet", "--eval-batches", "1"]) == 0  # fmt: skip
    capsys.readouterr()
    assert gen_main([str(out), "--prompt", "The assert", "--mode", "beam", "--max-new", "20"]) == 0
    gen = capsys.readouterr()
    assert gen.out.startswith("The assert") and len(gen.out.strip()) > len("The assert"), gen.err
    assert gen_main([str(tmp_path / "nothing")]) == 2  # in this process: no jax to start
    err = capsys.readouterr().err
    assert "models.cli.generate: error:" in err and "nothing" in err
    # models.load of the run: each token of greedy generation with the KV cache is the
    # argmax of the full forward pass's logits over the text before it
    loaded = models.load(out)
    got = loaded.generate("The ", max_new_tokens=6, details=True)
    assert got["finish_reason"] == "length" and got["prompt"] == "The "
    assert got["text"] == loaded.tokenizer.decode(got["tokens"])
    ids = [*loaded.tokenizer.encode("The "), *got["tokens"]]
    assert len(ids) == 10 and (loaded.logits(ids)[3:-1].argmax(-1) == ids[4:]).all()
    with pytest.raises(LoadError, match="run"):
        models.load(out, step=99)
    with pytest.raises(ParameterError, match="sampling must be a models.Sampling"):
        loaded.generate("The ", sampling={"top_p": 0.5})
