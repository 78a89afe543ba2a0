"""Generation for scripts: `models.load(path)` generates what transformers generates and
scores as it scores; `namedmesh generate --stop/--jsonl/--stream` cut, describe and
stream the same text; streamed pieces are whole characters and never a stop string."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import models  # noqa: E402
from lowering import Mesh  # noqa: E402
from models.cli import generate as gen  # noqa: E402
from models.inference.api import LoadError  # noqa: E402
from models.inference.continuations import Continuations  # noqa: E402
from models.training import data  # noqa: E402
from namedmesh.errors import ParameterError  # noqa: E402
from tests.test_hub_cli import tiny_gpt2  # noqa: E402

PROMPTS = ["The assert statement", "A list"]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A small GPT-2 folder with a BPE tokenizer, its transformers model, and models.load
    of it (one load: its compiled programs serve every test)."""
    out, model, tok = tiny_gpt2(tmp_path_factory.mktemp("gpt2"), 0.3)
    return out, model, tok, models.load(out)


def hf_new_tokens(model, tok, text: str, n: int) -> list[int]:
    """transformers' greedy tokens after `text` (no end token)."""
    ids = tok.encode(text).tolist()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def wants(hf):
    _, model, tok, _ = hf
    return [hf_new_tokens(model, tok, t, 12) for t in PROMPTS]


def test_load_generates_and_scores_as_transformers(hf, wants):
    path, model, tok, loaded = hf
    assert loaded.generate(PROMPTS, max_new_tokens=12) == [tok.decode(w) for w in wants]
    records = loaded.generate(PROMPTS, max_new_tokens=12, details=True)
    assert [r["tokens"] for r in records] == wants
    assert [r["finish_reason"] for r in records] == ["length", "length"]
    assert loaded.generate(PROMPTS[1], max_new_tokens=12) == tok.decode(wants[1])  # str: str
    # sampling from the single likeliest token is greedy
    one = loaded.generate(PROMPTS, max_new_tokens=12, sampling=models.Sampling(0.7, 1, seed=3))
    assert one == [tok.decode(w) for w in wants]
    ids = [tok.encode(t).tolist() for t in PROMPTS]
    got = loaded.logits(PROMPTS)  # right-padded to the longest, padding NaN
    assert got.shape == (2, max(map(len, ids)), tok.vocab_size)
    for row, i in zip(got, ids, strict=True):
        with torch.no_grad():
            want = model(torch.tensor([i])).logits.numpy()[0]
        np.testing.assert_allclose(row[: len(i)], want, atol=1e-4)
        assert np.isnan(row[len(i) :]).all()
    np.testing.assert_allclose(loaded.logits(ids[0]), got[0], atol=1e-5)
    with pytest.raises(LoadError, match="nothing"):
        models.load(path.parent / "nothing")
    with pytest.raises(ParameterError, match="layout='heads:model' places the model on a mesh"):
        models.load(path, layout="heads:model")  # no mesh: it would be ignored


def test_load_on_a_mesh_generates_and_scores_as_one_device(hf, wants):
    path, model, tok, loaded = hf
    megatron = models.load(path, mesh=Mesh({"model": 2}), layout="heads:model;d_ff:model")
    assert megatron.generate(PROMPTS, max_new_tokens=12) == [tok.decode(w) for w in wants]
    ids = tok.encode(PROMPTS[0]).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits.numpy()[0]
    np.testing.assert_allclose(megatron.logits(ids), want, atol=1e-4)


@pytest.fixture
def shared(hf, monkeypatch):
    """The command line's Decoder is the loaded model's, with its compiled programs (the
    same folder's parameters; each main() would otherwise compile its own)."""
    dec = hf[3].decoder()
    monkeypatch.setattr(gen, "Decoder", lambda params, cfg, **kw: dec)


def jsonl(capsys, *flags) -> list[dict]:
    capsys.readouterr()
    assert gen.main([*flags, "--jsonl"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_jsonl_stop_and_eos_against_the_full_greedy_text(hf, wants, tmp_path, capsys, shared):
    path, _, tok, _ = hf
    (tmp_path / "p.txt").write_text("\n".join(PROMPTS) + "\n")
    flags = [str(path), "--prompts", str(tmp_path / "p.txt"),
             "--max-new", "12", "--max-length", "64"]  # fmt: skip
    for bad, named in ((["--stop", ""], "--stop"), (["--stream", "--jsonl"], "--stream")):
        assert gen.main([*flags, *bad]) == 2  # refused in one line before loading
        assert named in capsys.readouterr().err
    full = jsonl(capsys, *flags)
    assert [r["prompt"] for r in full] == PROMPTS
    assert [r["tokens"] for r in full] == wants
    assert [r["text"] for r in full] == [tok.decode(w) for w in wants]
    assert [r["finish_reason"] for r in full] == ["length", "length"]
    # plain output: each prompt and its continuation, a blank line between them
    assert gen.main(flags) == 0
    plain = "\n\n".join(p + r["text"] for p, r in zip(PROMPTS, full, strict=True))
    assert capsys.readouterr().out == plain + "\n"
    # stop strings: the row's text cut at the first occurrence of any (str.find)
    text = full[0]["text"]
    stops = [text[6:9], text[3:5]]
    cut = lambda t: t[: min([t.find(s) for s in stops if s in t], default=len(t))]  # noqa: E731
    assert len(cut(text)) <= 3
    stopped = jsonl(capsys, *flags, "--stop", stops[0], "--stop", stops[1])
    for r, whole in zip(stopped, full, strict=True):
        assert r["text"] == cut(whole["text"])
        assert r["finish_reason"] == ("stop" if cut(whole["text"]) != whole["text"] else "length")
        assert r["tokens"] == whole["tokens"][: len(r["tokens"])]  # decoding stopped early
        assert tok.decode(r["tokens"]).startswith(r["text"])
    assert len(stopped[0]["tokens"]) < 12
    # an end id: the row ends before it, finish_reason eos; the other row goes on
    eos = wants[0][4]
    ended = jsonl(capsys, *flags, "--eos", str(eos))
    assert ended[0]["tokens"] == wants[0][: wants[0].index(eos)]
    assert ended[0]["finish_reason"] == "eos"
    other = wants[1][: wants[1].index(eos)] if eos in wants[1] else wants[1]
    assert ended[1]["tokens"] == other


def test_stream_prints_the_text_of_the_plain_output_in_pieces(hf, capsys, monkeypatch, shared):
    path, show = hf[0], gen.show
    for stop in ([], ["--stop", "e"]):
        flags = [str(path), "--prompt", PROMPTS[0], "--max-new", "12", *stop]
        capsys.readouterr()
        assert gen.main(flags) == 0
        plain = capsys.readouterr().out
        pieces = []
        monkeypatch.setattr(gen, "show", pieces.append)
        assert gen.main([*flags, "--stream"]) == 0
        monkeypatch.setattr(gen, "show", show)
        assert "".join(pieces) == plain
        assert len(pieces) > 3 or stop  # the prompt, pieces of text, the newline


def test_streamed_pieces_are_whole_characters_and_never_a_pending_stop_string():
    """Bytes one at a time: a character of 2 to 4 bytes shows once whole, and the start
    of a stop string waits until the next bytes rule it out or complete it."""
    text = "naïve café: €5 → ok 𝄞 S then €5 STOP, end"
    tok = data.ByteTokenizer()
    for stops in ([], ["STOP"], ["€5 S", "STOP"], ["nothing"]):
        pieces: list[str] = []
        show = lambda r, p, out=pieces: out.append(p)  # noqa: E731
        cont = Continuations(tok, 1, ends=[], stops=stops, on_text=show)
        bytes_ = tok.encode(text)
        ended = next((n for n, b in enumerate(bytes_, 1) if cont.push([b])[0]), None)
        cont.finish()
        at = min([text.find(s) for s in stops if s in text], default=len(text))
        assert cont.texts[0] == "".join(pieces) == text[:at]
        assert not any("\ufffd" in p for p in pieces)
        assert cont.reasons[0] == ("stop" if at < len(text) else "length")
        if at < len(text):  # decoding ended at the byte that completed the stop string
            first = min((text.find(s) + len(s), s) for s in stops if s in text)
            assert ended == len(text[: first[0]].encode())
        else:
            assert ended is None
