"""`namedmesh eval` at its edges, against transformers: a tiny GPT-2 built from a config
(bytes as tokens, no tokenizer file), its mean next-token NLL computed in torch by hand
over windows cut by the documented rule written here apart (a window every --length
tokens, each predicting the --length tokens after its first, the last one shorter),
with data whose end falls inside a window, on one exactly, or before the first ends,
and batches that do not divide the windows.

And auto_layout's choices run: a Transformer layer's loss laid out as the search chose
under a memory limit that binds, on the 8 simulated devices as 2x4 and 2x2x2 meshes
(and unbound on 8), equals its value and gradients on one device, and its compiled
value_and_grad holds the collectives the chosen candidate counted (none where it
counted none)."""

import math
from pathlib import Path

import jax
import numpy as np
import pytest

import namedmesh as nm
from lowering import Layout, Mesh, auto_layout, lower
from lowering.hlo import collectives
from lowering.search import cost_layout
from models.cli import evaluate
from models.training import data, datasets

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXT = "The quick brown fox jumps over the lazy dog. " * 3 + "end!"  # 139 bytes


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """(folder, model): a GPT-2 of 2 layers, its weights moved off their init so that
    its tokens' losses differ."""
    folder = tmp_path_factory.mktemp("gpt2")
    cfg = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder, model


def torch_nll(model, ids: np.ndarray, length: int) -> tuple[float, int]:
    """(mean NLL, tokens predicted): windows at 0, length, 2 length, ..., each scoring
    the targets after its first token up to `length` of them, until every token but the
    first is scored once; float64 log-softmax of transformers' logits."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, length):
        window = torch.tensor(ids[start : start + length + 1], dtype=torch.long)
        with torch.no_grad():
            logits = model(window[None, :-1]).logits[0].double()
        logp = torch.log_softmax(logits, -1)
        total -= logp[torch.arange(len(window) - 1), window[1:]].sum().item()
        count += len(window) - 1
    return total / count, count


def run_eval(folder, path, *flags) -> dict:
    return evaluate.evaluate(evaluate.arguments([str(folder), "--data", str(path), *flags]))


@pytest.mark.parametrize(
    "text, length, batch",
    [
        (TEXT, 16, 3),  # 138 targets: 8 windows of 16 and one of 10; batches of 3, 3, 3
        (TEXT[:129], 16, 4),  # 128 targets: 8 whole windows, the last ending on the data's end
        (TEXT[:6], 16, 2),  # 5 targets: fewer than one window's 16
    ],
    ids=["tail", "exact", "short"],
)
def test_eval_scores_every_token_after_the_first_once(gpt2, tmp_path, text, length, batch):
    folder, model = gpt2
    path = tmp_path / "data.txt"
    path.write_text(text)
    ids = np.frombuffer(text.encode(), np.uint8)
    want, count = torch_nll(model, ids, length)
    out = run_eval(folder, path, "--length", str(length), "--batch", str(batch), "--quiet")
    assert out["tokens"] == count == len(ids) - 1
    assert out["windows"] == math.ceil(count / length)
    # a text shorter than a window is one window of its own length, not one padded to it
    assert (out["length"], out["length_from"]) == (
        (length, "--length") if count >= length else (count, "the data's length")
    )
    assert out["loss"] == pytest.approx(want, abs=2e-5)
    assert out["perplexity"] == pytest.approx(math.exp(want), rel=1e-4)
    assert out["bits_per_byte"] == pytest.approx(want / math.log(2), rel=1e-4)


def test_eval_max_batches_scores_the_first_windows_alone(gpt2, tmp_path):
    folder, model = gpt2
    path = tmp_path / "data.txt"
    path.write_text(TEXT)
    ids = np.frombuffer(TEXT.encode(), np.uint8)
    want, count = torch_nll(model, ids[: 2 * 3 * 16 + 1], 16)  # 2 batches of 3 windows
    out = run_eval(folder, path, "--length", "16", "--batch", "3", "--max-batches", "2")
    assert (out["tokens"], out["windows"]) == (count, 6) == (96, 6)
    assert out["loss"] == pytest.approx(want, abs=2e-5)


def test_eval_of_one_token_says_it_predicts_none(gpt2, tmp_path, capsys):
    folder, _ = gpt2
    path = tmp_path / "one.txt"
    path.write_text("x")
    assert evaluate.main([str(folder), "--data", str(path), "--length", "16", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert "--data has 1 token" in err[0] and "train split" not in err[0]


def test_eval_of_a_run_of_another_objective_says_eval_needs_a_decoder_lm(tmp_path, capsys):
    (tmp_path / "run.json").write_text('{"model": "bert", "config": "tiny"}')
    (tmp_path / "data.txt").write_text(TEXT)
    assert evaluate.main([str(tmp_path), "--data", str(tmp_path / "data.txt")]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "'bert'" in err and "eval measures next-token perplexity" in err
    assert "generation" not in err


@pytest.mark.parametrize("length, batch", [(1, 1), (3, 2), (8, 3)])
def test_validation_windows_score_each_token_after_the_first_once_in_context(length, batch):
    """Token ids 0 ... n - 1 (each its own position): the weighted targets of every
    batch are 1 ... n - 1, each once, after the tokens just before it in its window."""
    for n in range(2, 30):
        ids = datasets.Tokens(np.arange(n), Path("ids.npy"))
        corpus = data.Corpus(ids, data.ByteTokenizer(), length, valid=ids)
        scored = []
        for b in corpus.validation_batches(batch):
            rows, cols = np.nonzero(b["weights"])
            for r, c in zip(rows, cols, strict=True):
                target = b["targets"][r, c]
                assert list(b["inputs"][r, : c + 1]) == list(range(target - c - 1, target))
                scored.append(int(target))
        assert sorted(scored) == list(range(1, n)), (n, length, batch)
        assert corpus.validation_windows() == math.ceil((n - 1) / length)


def test_bits_per_byte_of_the_first_batches_counts_their_bytes():
    """--max-batches: bits per byte over the bytes of the targets scored (English, where
    the text goes on in Japanese, whose tokens hold more bytes), not the whole text's."""
    text = "The quick brown fox jumps over the lazy dog. " * 20 + "日本語の文章です。" * 40
    tok = data.BPETokenizer.train(text, 300)
    corpus = data.Corpus(text, tok, 16, valid=text)
    batches = list(corpus.validation_batches(3, 2))
    scored = np.concatenate([b["targets"][b["weights"] > 0] for b in batches])
    want = len(tok.decode(scored).encode("utf-8")) / len(scored)
    assert corpus.bytes_per_token(6) == pytest.approx(want, rel=1e-6)
    assert corpus.bytes_per_token(6) < 0.8 * corpus.bytes_per_token()  # the whole text's
    assert corpus.bytes_per_token(corpus.validation_windows()) == corpus.bytes_per_token()


def layer(x, wq, wk, wv, wo, w1, w2):
    """A Transformer layer's loss: test_auto_layout's layer (attention and a ReLU FFN,
    with residuals), squared and averaged."""
    from tests.test_auto_layout import layer as attention_ffn

    y = attention_ffn(x, wq, wk, wv, wo, w1, w2)
    return (y * y).mean()


def layer_inputs():
    rng = np.random.default_rng(0)
    draw = lambda **sizes: nm.tensor(
        rng.normal(size=tuple(sizes.values())).astype(np.float32) * 0.5, " ".join(sizes)
    )
    proj = dict(d_model=16, heads=4, d_head=8)
    x = draw(batch=4, seq=8, d_model=16)
    out = draw(heads=4, d_head=8, d_model=16)
    return (
        x,
        draw(**proj),
        draw(**proj),
        draw(**proj),
        out,
        draw(d_model=16, d_ff=32),
        draw(d_ff=32, d_model=16),
    )


@pytest.mark.parametrize(
    "sizes, squeeze",
    [({"a": 8}, None), ({"a": 2, "b": 4}, 3), ({"a": 2, "b": 2, "c": 2}, 3)],
    ids=["8", "2x4", "2x2x2"],
)
def test_auto_layouts_choice_runs_as_one_device_and_compiles_what_it_counted(sizes, squeeze):
    inputs = layer_inputs()
    mesh, wrt = Mesh(sizes), tuple(range(1, 7))
    whole = cost_layout(layer, mesh, *inputs, layout="", grad_argnums=wrt, rates="h100").memory
    limit = whole / squeeze if squeeze else None
    layout, search = auto_layout(
        layer, mesh, *inputs, grad_argnums=wrt, rates="h100", memory_limit=limit
    )
    assert (layout == Layout("")) == (squeeze is None)  # the limit binds
    lowered = lower(layer, mesh, layout)
    weights = [w.data for w in inputs[1:]]

    def loss(run, *ws):
        return run(
            inputs[0], *(nm.tensor(w, t.dims) for w, t in zip(ws, inputs[1:], strict=True))
        ).data

    step = jax.jit(jax.value_and_grad(lambda *ws: loss(lowered, *ws), tuple(range(6))))
    value, grads = step(*weights)
    want, wanted = jax.value_and_grad(lambda *ws: loss(layer, *ws), tuple(range(6)))(*weights)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    for got, expected in zip(grads, wanted, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    compiled = collectives(step.lower(*weights).compile().as_text())
    assert len([c for c in compiled if c[2] != 1]) == search[0].collectives
