"""Edges left over from earlier fuzzing, each against an oracle computed apart.

- `eval` of a capacity-routed MoE run: each window routes as its tokens do at the start
  of a row of the model's own length (the forward at the run's config, its NLL in
  float64 NumPy), whatever --batch (padded rows), --length or the data's length.
- A Llama config.json whose rope_parameters hold a null key (`"rope_scaling": null`)
  reads as transformers reads it: as the file without the key.
- `eval --quiet` with `--layout auto` prints the result line alone.
- A `.json` data file holds documents as `datasets`' json loader reads them (an array
  of records, or JSON lines), not raw text; one that holds none is a DataError naming
  the file and row or line.
"""

import gzip
import json

import jax
import numpy as np
import pytest

import namedmesh as nm
from models import transformer
from models.cli import evaluate
from models.cli.train import main as train
from models.errors import DataError
from models.families.common import UnsupportedModelError
from models.io import hub
from models.training import data, datasets

TEXT = "Pack my box with five dozen liquor jugs; " * 3  # 123 bytes


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """(folder, data file): a capacity-routed MoE run of one step, a quarter of each
    row's choices fitting its experts' slots (capacity 4 of 16 tokens x 2 choices over
    4 experts), on TEXT as bytes."""
    root = tmp_path_factory.mktemp("moe")
    data = root / "text.txt"
    data.write_text(TEXT)
    (root / "train.txt").write_text(TEXT * 2)  # a validation tenth of a whole window
    flags = ["--config", "tiny", "--model", "moe", "--length", "16", "--batch", "2"]
    flags += ["--steps", "1", "--eval-batches", "1", "--quiet", "--data", str(root / "train.txt")]
    flags += ["--set", "routing=capacity", "--set", "capacity_factor=0.5"]
    flags += ["--set", "layers=1", "--set", "d_model=16", "--set", "experts=4"]
    assert train([*flags, "--out", str(root / "run")]) == 0
    return root / "run", data


def forward_nll(folder, ids: np.ndarray, length: int) -> float:
    """Mean NLL of windows at 0, length, 2 length, ... (each scoring up to `length`
    targets), every window zero-padded to the run's own row length and run through the
    model at the run's config (later tokens never change earlier logits: test_moe)."""
    _, params, cfg, _ = evaluate.load(str(folder))
    cfg = cfg.replace(batch=1)
    forward = lambda p, t: transformer.lm_logits(p, t, cfg).transpose("batch", "length", "vocab")
    logits = jax.jit(forward)
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, length):
        window = ids[start : start + length + 1]
        row = np.zeros((1, cfg.length), np.int32)
        row[0, : len(window) - 1] = window[:-1]
        out = np.asarray(logits(params, nm.tensor(row, ("batch", "length"))).data, np.float64)
        out = out[0, : len(window) - 1]
        out -= out.max(-1, keepdims=True)
        logp = out - np.log(np.exp(out).sum(-1, keepdims=True))
        total -= logp[np.arange(len(window) - 1), window[1:]].sum()
        count += len(window) - 1
    return total / count


@pytest.mark.parametrize(
    "length, batch, cut",
    [(16, 3, None), (16, 1, None), (8, 3, None), (8, 2, 6)],
    ids=["padded-rows", "batch-1", "shorter-length", "short-data"],
)
def test_capacity_moe_eval_routes_windows_as_the_model(moe_run, tmp_path, length, batch, cut):
    """Before: a window shorter than the run's rows (--length 8, data of 6 bytes) got
    the slots of its own length (2, not 4), so its loss was not the model's."""
    folder, data = moe_run
    if cut is not None:
        data = tmp_path / "short.txt"
        data.write_text(TEXT[:cut])
    ids = np.frombuffer(data.read_bytes(), np.uint8).astype(np.int64)
    flags = [str(folder), "--data", str(data), "--length", str(length)]
    got = evaluate.evaluate(evaluate.arguments([*flags, "--batch", str(batch), "--quiet"]))
    assert got["tokens"] == len(ids) - 1
    assert got["loss"] == pytest.approx(forward_nll(folder, ids, length), rel=1e-5)


@pytest.mark.parametrize("key", ["rope_scaling", "partial_rotary_factor"])
def test_a_null_rope_key_reads_as_absent(key):
    transformers = pytest.importorskip("transformers")
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64)
    clean = transformers.LlamaConfig(num_attention_heads=4, rope_theta=5e5, **sizes).to_dict()
    given = dict(clean, rope_parameters={**clean["rope_parameters"], key: None})
    theirs = transformers.LlamaConfig.from_dict(dict(given)).rope_parameters
    assert {k: v for k, v in theirs.items() if k != key} == clean["rope_parameters"]
    assert hub.family_config("llama", dict(given), set()) == hub.family_config(
        "llama", dict(clean), set()
    )
    valued = dict(clean, rope_parameters={**clean["rope_parameters"], key: 2.0})
    with pytest.raises(UnsupportedModelError, match=f"'{key}': 2.0.* not implemented"):
        hub.family_config("llama", valued, set())


def test_quiet_eval_prints_the_result_line_alone(moe_run, capsys):
    """--layout auto's table (and its rates line) is shown without --quiet, and --quiet
    leaves the result line alone."""
    from models.cli.evaluate import main

    folder, data = moe_run
    flags = [str(folder), "--data", str(data), "--layout", "auto", "--mesh", "data=2"]
    assert main([*flags, "--max-batches", "1"]) == 0
    loud = capsys.readouterr().out.splitlines()
    assert len(loud) > 2 and any("chosen" in line for line in loud)
    assert main([*flags, "--max-batches", "1", "--quiet"]) == 0
    assert capsys.readouterr().out.splitlines() == loud[-1:]
    assert loud[-1].startswith("loss ")


JSON_FILES = {
    "records.json": json.dumps([{"text": "a\u2028b", "id": 1}, {"text": "second"}], indent=1),
    "lines.json": '{"text": "one"}\n\n{"text": "two", "n": 2}\n',
    "object.json.gz": '{"text": "alone"}',
    "indented.json": '{\n  "text": "on lines\\nof its own"\n}\n',
}


@pytest.mark.parametrize("name", JSON_FILES)
def test_a_json_file_reads_as_datasets_json_loader_reads_it(tmp_path, name):
    """Before: a .json file was read as raw text, brackets and keys trained on."""
    load_dataset = pytest.importorskip("datasets").load_dataset
    text = JSON_FILES[name].encode()
    (tmp_path / name).write_bytes(gzip.compress(text) if name.endswith(".gz") else text)
    want = load_dataset("json", data_files=str(tmp_path / name), cache_dir=str(tmp_path / "c"))
    assert datasets.read(tmp_path / name) == "\n".join(want["train"]["text"])


@pytest.mark.parametrize(
    "text, message",
    [
        ('[{"text": "a"}, {"body": "b"}]', r"x.json row 2: no 'text' field \(has body\)"),
        ('[{"text": "a"}, 3]', "x.json row 2: an item must be an object"),
        ('[{"messages": []}]', r"x.json row 1: a conversation .* chat data is a .jsonl file"),
        ('[{"text": "a"},', "x.json: not a JSON array"),
        ('"just a string"', "x.json: holds a JSON str"),
        ('{"text": ["p", "q"]}', "x.json row 1: the 'text' field is a list, not text"),
        (
            '{\n "name": "pkg",\n "version": "1"\n}',
            r"x.json row 1: no 'text' field \(has name, version",
        ),
        ('{"text": "a"}\n{oops', "x.json:2: not a JSON line"),
    ],
)
def test_a_json_file_that_holds_no_documents_is_named(tmp_path, text, message):
    (tmp_path / "x.json").write_text(text)
    with pytest.raises(DataError, match=f"--data .*{message}"):
        datasets.read(tmp_path / "x.json")


@pytest.mark.parametrize("text", ["abcdefgh", "abcde"])
def test_training_windows_draw_every_start_the_split_holds(text):
    """Every window of length + 1 tokens inside the train split is drawn, the one ending
    on its last token too (before: never; a split of exactly one window was refused)."""
    from models.training.data import ByteTokenizer, Corpus

    corpus = Corpus(text, ByteTokenizer(), 4, valid="vwxyz")
    want = {text[i : i + 5] for i in range(len(text) - 4)}  # every start, in plain Python
    drawn = set()
    for step in range(40):
        b = corpus.batch(step, 4, seed=0)
        for inputs, targets in zip(b["inputs"], b["targets"], strict=True):
            drawn.add(bytes([*inputs, targets[-1]]).decode())
    assert drawn == want


def test_a_byte_token_file_is_a_byte_a_token_whatever_its_bytes(tmp_path):
    """Bits per byte of byte ids that are no UTF-8 (Latin-1 text, 0xff): one byte each,
    not the 3 of the replacement character their decoded text holds."""
    ids = np.frombuffer("café crème, naïve ".encode("latin-1") * 8, np.uint8)
    ids.astype(np.uint16).tofile(tmp_path / "latin.bin")
    corpus = data.Corpus(datasets.read(tmp_path / "latin.bin"), data.ByteTokenizer(), 8)
    assert corpus.bytes_per_token() == 1.0 and corpus.bytes_per_token(1) == 1.0


def test_a_prompts_file_is_split_at_newlines_alone(tmp_path):
    """A prompt holding a form feed, U+2028 or NEL is one prompt (str.splitlines broke
    it in two); Windows line ends are no part of a prompt; blank lines are none."""
    from models.cli.generate import read_prompts

    prompts = ["def f():\x0c", "a\u2028b", "c\x85d", "plain"]
    (tmp_path / "p.txt").write_bytes("\r\n\n".join(prompts).encode() + b"\r\n")
    assert read_prompts(tmp_path / "p.txt") == prompts
