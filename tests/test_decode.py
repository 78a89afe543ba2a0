"""Decoding that serves: one-pass prefill plus cached steps give the full forward pass's
logits, padded batches decode as each prompt alone (against greedy recomputation),
EOS and max length stop rows, top-k/top-p filtering equals a NumPy oracle, decoding
under a 2x4 layout gives one device's tokens, the cache is in the compute dtype, and
bad parameters raise typed errors naming their flag."""

import dataclasses

import jax
import numpy as np
import pytest

import namedmesh as nm
from lowering import Layout, Mesh
from models import architecture as config
from models import transformer
from models.architecture import ConfigError
from models.cli.generate import Decoder, main, prefill_step
from models.inference import decoding
from models.inference.sampling import Sampling, choose, filter_logits
from namedmesh.errors import ParameterError

# rotary positions, a gated FFN, RMS norms; learned positions (GPT-2) and grouped-query
# attention (Llama) decode padded batches against transformers in test_hub.py
CFG = config.Config(
    vocab=32,
    d_model=16,
    heads=4,
    d_kv=4,
    d_ff=32,
    layers=2,
    length=16,
    batch=4,
    shared_embedding=False,
    positions="rotary",
    ffn="gated_silu",
    norm="rms",
)
PROMPTS = [[3, 1, 4, 1, 5], [9], [2, 6, 5]]


def make(cfg):
    params = transformer.init(transformer.lm_shapes(cfg), 0)
    params["softmax"] = params["softmax"] * 4.0  # peaked predictions: decoding paths differ
    return params, cfg, Decoder(params, cfg)


@pytest.fixture(scope="module")
def model():
    return make(CFG)


_FULL = {}


def full_logits(params, cfg, rows) -> np.ndarray:
    """The full forward pass's logits (batch, length, vocab), the oracle: rows padded to
    cfg.length (causal: later tokens change no earlier logits), one compile per config."""
    rows = np.asarray(rows, np.int32)
    if cfg not in _FULL:
        _FULL[cfg] = jax.jit(lambda p, t: transformer.lm_logits(p, t, cfg))
    wide = np.zeros((len(rows), cfg.length), np.int32)
    wide[:, : rows.shape[1]] = rows
    logits = _FULL[cfg](params, nm.tensor(wide, ("batch", "length")))
    return np.asarray(logits.transpose("batch", "length", "vocab").data)[:, : rows.shape[1]]


def greedy_by_recomputation(params, cfg, prompt, n) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(full_logits(params, cfg, [toks])[0, -1].argmax()))
    return toks[len(prompt) :]


def test_prefill_then_steps_equal_the_full_forward_pass_at_every_position(model):
    params, cfg, dec = model
    rows = np.random.default_rng(0).integers(0, cfg.vocab, size=(2, cfg.length))
    want = full_logits(params, cfg, rows)
    n = 5  # prefill positions 0..4 in one pass, then one step per position
    prompt = nm.tensor(np.asarray(rows[:, :n], np.int32), ("batch", "length"))
    logits, cache = prefill_step(dec.params, prompt, None, cfg, cfg.length)
    got = np.asarray(logits.transpose("batch", "length", "vocab").data)
    np.testing.assert_allclose(got, want[:, :n], rtol=0, atol=1e-5)
    for i in range(n, cfg.length):
        logits, cache = dec.step_logits(rows[:, i], i, cache)
        np.testing.assert_allclose(np.asarray(logits), want[:, i], rtol=0, atol=1e-5)


def test_the_cache_grows_by_buckets_and_rows_at_different_positions_see_their_own():
    """A cache of 136 slots starts at the bucket past the prompt (64 slots) and grows to
    128 and 136 as the longest row passes each end; with one row 36 positions behind
    the other, every step's logits of both rows are the full forward pass's at that
    row's position, across both growths (the cache's layer-by-layer layout, its write
    and its growth against the training forward, which has no cache)."""
    cfg = CFG.replace(length=136, layers=1)
    params, _, dec = make(cfg)
    rows = np.random.default_rng(1).integers(0, cfg.vocab, size=(2, cfg.length))
    want = full_logits(params, cfg, rows)
    lengths = np.array([56, 20])
    logits, cache = dec.prefill_logits(rows[:, :56], lengths)
    sizes = {decoding.cache_slots(cache)}
    np.testing.assert_allclose(np.asarray(logits), want[[0, 1], lengths - 1], atol=1e-5)
    for i in range(56, cfg.length):
        at = np.array([i, i - 36])
        logits, cache = dec.step_logits(rows[[0, 1], at], at, cache)
        sizes.add(decoding.cache_slots(cache))
        np.testing.assert_allclose(np.asarray(logits), want[[0, 1], at], atol=1e-5)
    assert sizes == {64, 128, 136}


def test_padded_batch_decodes_each_prompt_as_alone(model):
    """Right-padded prompts of lengths 5, 1, 3 in one batch: each row's greedy tokens
    are those of recomputing its own prefix from scratch, and of decoding it alone."""
    params, cfg, dec = model
    got = dec.decode(PROMPTS, 6)
    assert got.shape == (3, 6)
    for row, prompt in zip(got, PROMPTS, strict=True):
        assert list(row) == greedy_by_recomputation(params, cfg, prompt, 6)
    assert list(dec.decode(PROMPTS[2:], 6)[0]) == list(got[2])
    assert len({tuple(r) for r in got}) == 3


def test_eos_and_max_length_stop_rows_one_by_one(model):
    _, _, dec = model
    free = dec.decode(PROMPTS, 6)
    eos = int(free[1, 2])  # row 1's third token ends row 1 (and any row that emits it)
    got = dec.decode(PROMPTS, 6, eos=eos)
    for g, f in zip(got, free, strict=True):
        stop = list(f).index(eos) + 1 if eos in f else len(f)
        assert list(g[:stop]) == list(f[:stop]) and set(g[stop:]) <= {eos}
    assert list(got[1, 3:]) == [eos] * (got.shape[1] - 3)
    # several end ids (Llama 3 lists three): a row ends at the first of any, then emits
    # the first id given
    ends = [int(free[0, 1]), eos]
    got = dec.decode(PROMPTS, 6, eos=ends)
    for g, f in zip(got, free, strict=True):
        stop = next((i + 1 for i, t in enumerate(f) if t in ends), len(f))
        assert list(g[:stop]) == list(f[:stop]) and set(g[stop:]) <= {ends[0]}
    one = dec.generate(PROMPTS[0], 6, eos=ends)
    assert one == list(free[0, : next(i + 1 for i, t in enumerate(free[0]) if t in ends)])
    # a row holds max_length tokens at most, prompt included: 7 - 5, 7 - 1, 7 - 3 new
    capped = dec.decode(PROMPTS, 6, max_length=7)
    for g, f, p in zip(capped, free, PROMPTS, strict=True):
        k = min(6, 7 - len(p))
        assert list(g[:k]) == list(f[:k]) and not g[k:].any()  # then padding (0)


def test_sampling_is_seeded_and_cold_sampling_is_greedy(model):
    _, _, dec = model
    greedy = dec.decode(PROMPTS, 5)
    cold = dec.decode(PROMPTS, 5, sampling=Sampling(temperature=1e-4, seed=3))
    np.testing.assert_array_equal(cold, greedy)
    hot = Sampling(temperature=2.0, top_k=8, top_p=0.9, seed=1)
    a = dec.decode(PROMPTS, 5, sampling=hot)
    np.testing.assert_array_equal(a, dec.decode(PROMPTS, 5, sampling=hot))
    other = dataclasses.replace(hot, seed=2)  # equal as a compiled program's key, other draws
    assert other == hot and not np.array_equal(a, dec.decode(PROMPTS, 5, sampling=other))


# --- top-k / top-p against NumPy ----------------------------------------------------------
def numpy_filtered(logits: np.ndarray, temperature: float, k: int, p: float) -> np.ndarray:
    """The distribution sampling draws from, row by row in float64: softmax(logits/T),
    zero outside the k largest (ties with the k-th kept), renormalised, then zero outside
    the nucleus: walking tokens likeliest first (ties by index), a token is kept while
    the mass before it is < p."""
    out = []
    for row in logits.astype(np.float64) / temperature:
        keep = np.ones(row.shape, bool)
        if k:
            keep &= row >= np.sort(row)[::-1][k - 1]
        prob = np.where(keep, np.exp(row - row.max()), 0.0)
        prob /= prob.sum()
        if p < 1:
            mass = 0.0
            for i in sorted(range(len(row)), key=lambda i: (-row[i] if keep[i] else np.inf, i)):
                keep[i] &= mass < p
                mass += prob[i]
            prob = np.where(keep, prob, 0.0)
        out.append(prob / prob.sum())
    return np.array(out)


@pytest.mark.parametrize(
    "temperature,k,p", [(1.0, 5, 1.0), (0.7, 0, 0.6), (1.3, 12, 0.8), (1.0, 0, 0.05), (1, 3, 1)]
)
def test_filtered_distribution_equals_numpy(temperature, k, p):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (6, 40)).astype(np.float32)
    logits[0, :6] = logits[0, 0]  # ties at the top
    got = np.asarray(filter_logits(logits, Sampling(temperature, k, p)), np.float64)
    got = np.exp(got - got.max(-1, keepdims=True))
    got /= got.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, numpy_filtered(logits, temperature, k, p), atol=1e-6)


def test_draws_follow_the_filtered_distribution():
    logits = np.random.default_rng(1).normal(0, 1.5, (1, 20)).astype(np.float32)
    want = numpy_filtered(logits, 0.9, 6, 0.7)[0]
    draws = np.asarray(choose(np.repeat(logits, 4000, 0), jax.random.key(0), Sampling(0.9, 6, 0.7)))
    freq = np.bincount(draws, minlength=20) / len(draws)
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(want))
    np.testing.assert_allclose(freq, want, atol=0.03)


# --- under a layout, and in the compute dtype ---------------------------------------------
def test_decoding_on_a_2x4_mesh_gives_one_devices_tokens(model):
    params, cfg, one = model
    mesh = Mesh({"data": 2, "model": 4})
    dec = Decoder(params, cfg, mesh=mesh, layout=Layout("batch:data;heads:model"))
    prompts = PROMPTS + [[7, 7]]  # batch 4: two rows per data shard
    np.testing.assert_array_equal(dec.decode(prompts, 5), one.decode(prompts, 5))
    hot = Sampling(1.5, 10, 0.95, seed=4)
    np.testing.assert_array_equal(
        dec.decode(prompts, 5, sampling=hot), one.decode(prompts, 5, sampling=hot)
    )
    _, cache = dec.prefill_logits(np.asarray([p + [0] * 3 for p in [[1, 2]] * 4]), np.full(4, 2))
    k = cache[0]["k"]  # layer 0's (batch, heads, memory, d_kv): batch on data, heads on model
    local = k.data.sharding.shard_shape(k.data.shape)
    assert local[k.dims.index("batch")] == 2 and local[k.dims.index("heads")] == 1


def test_bfloat16_decoding_keeps_a_bfloat16_cache(model):
    cfg = CFG.replace(dtype="bfloat16")
    params = model[0]
    dec = Decoder(params, cfg)
    rows = np.asarray([PROMPTS[0]])
    logp, cache, _ = dec.prefill(rows)
    assert {t.dtype for c in cache for t in c.values()} == {np.dtype("bfloat16")}
    want = full_logits(params, cfg, rows)[0, -1].astype(np.float32)
    want = want - np.log(np.exp(want - want.max()).sum()) - want.max()
    np.testing.assert_allclose(logp[0], want, atol=0.05 * np.abs(want).max())
    _, cache = dec.step([1], 5, cache)
    assert {t.dtype for c in cache for t in c.values()} == {np.dtype("bfloat16")}


# --- typed errors naming the flag -----------------------------------------------------------
@pytest.mark.parametrize(
    "kw,flag",
    [
        ({"temperature": 0.0}, "--temperature"),
        ({"top_k": -1}, "--top-k"),
        ({"top_p": 0.0}, "--top-p"),
        ({"top_p": 1.5}, "--top-p"),
    ],
)
def test_bad_sampling_names_the_flag(kw, flag):
    with pytest.raises(ParameterError, match=flag):
        Sampling(**kw)


def test_bad_decoding_parameters_name_the_flag(model):
    _, cfg, dec = model
    with pytest.raises(ParameterError, match="--eos"):
        dec.decode(PROMPTS, 3, eos=cfg.vocab)
    with pytest.raises(ParameterError, match="--max-length"):
        dec.decode(PROMPTS, 3, max_length=cfg.length + 1)
    with pytest.raises(ParameterError, match="--max-length"):
        dec.decode([list(range(cfg.length + 1))], 3)
    with pytest.raises(ParameterError, match="--max-new"):
        dec.decode(PROMPTS, -1)
    with pytest.raises(ParameterError, match="must be a models.inference.sampling.Sampling"):
        dec.decode(PROMPTS, 3, sampling="sample")  # the mode string it once took
    with pytest.raises(ParameterError, match="--seed"):
        Sampling(seed=1.5)
    with pytest.raises(ParameterError, match="sampling .a draw. and on_step"):
        dec.generate(PROMPTS[0], 3, beams=2, sampling=Sampling())
    with pytest.raises(ParameterError, match="prompt 1 is empty"):
        dec.decode([[1], []], 3)
    with pytest.raises(ParameterError, match="token 40 is outside the vocabulary"):
        dec.decode([[1, 40]], 3)
    with pytest.raises(ParameterError, match="--max-length"):
        Decoder({}, CFG.replace(positions="learned"), slots=CFG.length + 1)  # past them


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--top-p", "2"], "top_p (--top-p) must be in (0, 1]"),
        (["--temperature", "-1"], "temperature (--temperature) must be > 0"),
        (["--prompts", "/nonexistent/prompts.txt"], "--prompts /nonexistent/prompts.txt"),
    ],
)
def test_the_command_line_reports_bad_flags_before_loading(flags, message, capsys):
    assert main(["/nonexistent", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("models.cli.generate: error:") and message in err


def test_every_flag_has_help_and_shows_its_default(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    entries = capsys.readouterr().out.split("\n  -")  # one per option, after the usage
    for flag in ("--top-k", "--top-p", "--temperature", "--eos", "--prompts", "--max-length"):
        (entry,) = [e for e in entries if e.startswith(flag[1:] + " ")]
        assert "(default:" in entry and len(entry.split()) > 4, flag


# --- encoder-decoder (T5-style): the memory's keys and values projected once ------------------
ENCDEC = CFG.replace(
    positions="none", relative_buckets=8, relative_max_distance=16, attention_scale=False
)


@pytest.fixture(scope="module")
def encdec():
    shapes = transformer.encdec_shapes(ENCDEC)
    params = jax.jit(lambda: transformer.init(shapes, 1))()  # one compile, not op by op
    params["softmax"] = params["softmax"] * 4.0
    return params, Decoder(params, ENCDEC)


def translate_by_recomputation(params, inputs, n) -> np.ndarray:
    """Greedy tokens from the whole encoder-decoder forward pass (transformer's
    encdec_logits: encoder and cross-attention projections recomputed every step), the
    decoder inputs padded to cfg.length so that one compiled program serves every step."""
    rows = np.zeros((len(inputs), max(map(len, inputs))), np.int32)
    for i, p in enumerate(inputs):
        rows[i, : len(p)] = p
    weights = np.arange(rows.shape[1]) < np.array([[len(p)] for p in inputs])
    run = jax.jit(lambda p, b: transformer.encdec_logits(p, b, ENCDEC)[0])
    dec_in, out = np.zeros((len(inputs), ENCDEC.length), np.int32), []
    for i in range(n):
        batch = {
            "inputs": nm.tensor(rows, ("batch", "length")),
            "input_weights": nm.tensor(weights.astype(np.float32), ("batch", "length")),
            "decoder_inputs": nm.tensor(dec_in, ("batch", "length")),
        }
        logits = np.asarray(run(params, batch).transpose("batch", "length", "vocab").data)
        out.append(logits[:, i].argmax(-1))
        if i + 1 < ENCDEC.length:
            dec_in[:, i + 1] = out[-1]
    return np.stack(out, 1)


def test_encdec_translates_as_recomputation_and_on_a_2x4_mesh_as_one_device(encdec):
    """Inputs of lengths 5, 1, 3, 2: the one-device decoder (encoder once, cross keys and
    values once) gives the tokens of recomputing everything; under batch:data;heads:model
    the same tokens, with the cross keys and values split like the cache."""
    params, one = encdec
    inputs = PROMPTS + [[7, 7]]
    got = one.translate(inputs, 5)
    np.testing.assert_array_equal(got, translate_by_recomputation(params, inputs, 5))
    assert len({tuple(r) for r in got}) > 1
    mesh = Mesh({"data": 2, "model": 4})
    dec = Decoder(params, ENCDEC, mesh=mesh, layout=Layout("batch:data;heads:model"))
    np.testing.assert_array_equal(dec.translate(inputs, 5), got)
    cross = dec.encoded[0][0]["k"]  # layer 0's
    assert cross.dims == ("batch", "memory", "heads", "d_kv")
    local = cross.data.sharding.shard_shape(cross.data.shape)
    assert local[0] == 2 and local[2] == 1


def test_encdec_beam_bfloat16_and_misuse(encdec):
    """Beam search of width 1 is greedy for an encoder-decoder too (the encoding is
    repeated for every hypothesis); bfloat16 keeps bfloat16 cross keys and values and
    the float32 tokens of these peaked predictions; misuse is a ParameterError."""
    params, one = encdec
    greedy = one.translate([[3, 1, 4]], 4)
    one.encode([[3, 1, 4]])
    assert one.beam([0], 4, 1)[0] == list(greedy[0])
    assert len(one.beam([0], 4, 3)[0]) == 4 and one.encoded[1].size_of("batch") == 1
    half = Decoder(params, ENCDEC.replace(dtype="bfloat16"))
    np.testing.assert_array_equal(half.translate([[3, 1, 4]], 4), greedy)
    assert {c["k"].dtype for c in half.encoded[0]} == {np.dtype("bfloat16")}
    with pytest.raises(ParameterError, match="2 rows but encode was given 1 inputs"):
        one.decode([[0], [0]], 3)
    with pytest.raises(ParameterError, match="after encode"):
        Decoder(params, ENCDEC).decode([[0]], 3)


# --- the edges an outside tester tries ---------------------------------------------------------
def test_decoding_edges(model):
    """A prompt as long as max_length gets no new token (and `generate` cuts one longer
    than the cache to its last slots); an eos inside a prompt ends nothing; top_k past
    the vocabulary is no filter; a tiny top_p is greedy."""
    params, cfg, dec = model
    assert dec.decode([list(range(cfg.length))], 3).shape == (1, 0)
    long = [t % cfg.vocab for t in range(3, cfg.length + 7)]
    window = full_logits(params, cfg, [long[-cfg.length :]])[0, -1]
    assert dec.generate(long, 1) == [int(window.argmax())]
    assert dec.decode([[3, 1, 4, 1, 5]], 3, max_length=5).shape == (1, 0)
    free = dec.decode(PROMPTS, 4)
    np.testing.assert_array_equal(dec.decode(PROMPTS, 4, eos=PROMPTS[0][1]), free)
    wide = dec.decode(PROMPTS, 4, sampling=Sampling(1.0, cfg.vocab + 100, seed=5))
    np.testing.assert_array_equal(wide, dec.decode(PROMPTS, 4, sampling=Sampling(seed=5)))
    tiny = dec.decode(PROMPTS, 4, sampling=Sampling(1.0, 0, 1e-9, seed=5))
    np.testing.assert_array_equal(tiny, free)


def test_blockwise_decodes_any_length_and_ring_refuses_the_cache(model):
    """A block size that divides neither the 16 cache slots nor the prompts pads with
    masked slots and gives full attention's greedy tokens, as the fused kernel does;
    ring attention has no keys to pass around under a KV cache and says so (it never
    falls back to full)."""
    params, cfg, dec = model
    other = Decoder(params, cfg.replace(attention="blockwise", attention_block=5))
    np.testing.assert_array_equal(other.decode(PROMPTS, 4), dec.decode(PROMPTS, 4))
    fused = Decoder(params, cfg.replace(attention="fused"))  # the cache's mask as a bias
    np.testing.assert_array_equal(fused.decode(PROMPTS, 4), dec.decode(PROMPTS, 4))
    ring = Decoder(params, cfg.replace(attention="ring", attention_block=4))
    with pytest.raises(ConfigError, match="attention='ring' with cached: a KV cache"):
        ring.decode(PROMPTS, 4)


def test_bad_tokens_and_eos_are_parameter_errors(model):
    _, _, dec = model
    with pytest.raises(ParameterError, match="prompt 0 must be a flat list of int"):
        dec.decode([[1.5, 2]], 3)
    with pytest.raises(ParameterError, match="prompt 1 must be a flat list of int"):
        dec.decode([[1], [[1, 2]]], 3)
    with pytest.raises(ParameterError, match="--eos"):
        dec.decode(PROMPTS, 3, eos=2.5)
    with pytest.raises(ParameterError, match="no encoder"):
        dec.encode(PROMPTS)
