"""The `namedmesh` command as a user runs it: from a folder holding its own models.py
and lowering.py, training on a token file with a validation file apart and settings
from a YAML config file; `eval` equal to a perplexity computed with NumPy from the
model's logits, on two meshes and layouts; `export` read back by transformers; `bench`
and the commands' one-line errors."""

import json
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

import namedmesh as nm
from models import catalog, transformer
from models.cli import evaluate, export, generate, settings, train
from models.io import hub
from namedmesh import cli

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    # conftest's XLA_FLAGS (the suite's compile options) and 8 devices (the last wins)
    "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=8",
    "PYTHONPATH": str(ROOT),
}
TEXT = "".join(__import__("pydoc_data.topics").topics.topics[k] for k in ("assert", "if"))


def entry_point() -> str:
    """`module:function` of the console script pyproject.toml declares."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    return scripts["namedmesh"]


def namedmesh(cwd: Path, *args) -> subprocess.CompletedProcess:
    """The console script's function run as `python -c` does, the current folder first
    on sys.path (a console script does not even put it there)."""
    module, func = entry_point().split(":")
    code = f"import sys; from {module} import {func}; sys.exit({func}())"
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step run of the tiny LM on a uint16 .bin of byte ids, validated on a .npy,
    its settings from a YAML file (--steps given on the command line overrides it),
    started in a folder whose models.py and lowering.py would shadow the packages."""
    here = tmp_path_factory.mktemp("user")
    for name in ("models.py", "lowering.py"):
        (here / name).write_text("raise SystemExit('the user module was imported')\n")
    ids = np.frombuffer(TEXT.encode(), np.uint8)
    ids.astype(np.uint16).tofile(here / "train.bin")
    np.save(here / "val.npy", ids[-3000:].astype(np.int64))
    (here / "run.yaml").write_text(
        "config: tiny\nbatch: 8\nlength: 16\nsteps: 100\nlr: 0.01\nquiet: true\n"
        "eval-every: 2\nval_data: val.npy\nset: [d_model=32, d_ff=64, d_kv=8]\n"
    )
    r = namedmesh(
        here, "train", "--config-file", "run.yaml", "--steps", "4", "--data", "train.bin",
        "--mesh", "data=2", "--out", "run",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return here


def test_the_command_trains_on_token_files_from_a_folder_with_its_own_models_py(run):
    stored = json.loads((run / "run" / "run.json").read_text())
    assert (
        stored["lr"] == 0.01 and stored["batch"] == 8 and stored["val_data"] == str(run / "val.npy")
    )
    assert stored["set"] == ["d_model=32", "d_ff=64", "d_kv=8"]  # from the YAML file
    steps = [json.loads(line) for line in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]  # --steps 4 overrode the file's 100
    assert all(math.isfinite(s["val_loss"]) for s in steps if s["step"] % 2 == 0)


def test_python_m_namedmesh_ignores_the_folders_models_py(run):
    r = subprocess.run(
        [sys.executable, "-m", "namedmesh", "train", "--help"],
        cwd=run, env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: namedmesh train") and "--val-data" in r.stdout


def test_make_demo_installs_no_test_extras():
    rules = (ROOT / "Makefile").read_text().split("\n\n")
    demo = next(r for r in rules if r.startswith("$(DEMO_STAMP):"))
    assert "pip install -e ." in demo and "[test]" not in demo
    assert "$(DEMO_STAMP)" in next(r for r in rules if "\ndemo:" in "\n" + r)


def numpy_loss(run_dir: Path, ids: np.ndarray, length: int) -> float:
    """Mean next-token cross-entropy over windows of up to length + 1 tokens every
    `length` tokens (the last one shorter: every token after the first scored once),
    from the model's logits, log-softmax and gather in NumPy."""
    params, cfg, _ = generate.load(run_dir)
    nll = []
    for start in range(0, len(ids) - 1, length):
        window = ids[start : start + length + 1].astype(np.int32)[None]
        logits = transformer.lm_logits(params, nm.tensor(window[:, :-1], "batch length"), cfg)
        z = np.asarray(logits.transpose("batch", "length", "vocab").data, np.float64)
        z = z - z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        nll.extend(-np.take_along_axis(logp, window[:, 1:, None], -1).ravel())
    return float(np.mean(nll))


@pytest.mark.parametrize(
    "mesh",
    [
        ["--mesh", "data=1"],
        ["--mesh", "rows=2,cols=2", "--layout", "batch:rows;heads:cols;d_ff:cols"],
    ],
)
def test_eval_equals_the_perplexity_numpy_computes_from_the_logits(run, mesh, capsys):
    ids = np.load(run / "val.npy")
    expect = numpy_loss(run / "run", ids, 16)
    rc = evaluate.main([str(run / "run"), "--data", str(run / "val.npy"), "--batch", "6", *mesh])
    out = capsys.readouterr()
    assert rc == 0, out.err
    words = out.out.split()
    loss = float(words[words.index("loss") + 1])
    ppl = float(words[words.index("perplexity") + 1].rstrip(","))
    bpb = float(words[words.index("bits/byte") - 1])
    assert loss == pytest.approx(expect, abs=1e-4)
    assert ppl == pytest.approx(math.exp(expect), rel=1e-3)
    assert bpb == pytest.approx(expect / math.log(2), abs=1e-3)  # byte tokenizer: 1 byte
    windows = len(range(0, len(ids) - 1, 16))  # numpy_loss's windows of up to 16 + 1 ids
    said = f"over {len(ids) - 1:,} tokens in {windows:,} windows of 16 (the model's training"
    assert said in out.out  # its window, as it must be told to compare scores


def test_eval_shows_a_progress_bar_and_refuses_bad_input_in_one_line(run, capsys):
    (run / "notes.txt").write_text(TEXT[:2000])
    assert evaluate.main([str(run / "run"), "--data", str(run / "notes.txt")]) == 0
    assert "batch/s]" in capsys.readouterr().err  # tqdm's bar, on stderr
    cases = [
        (["--data", str(run / "nothing.txt")], "nothing.txt"),
        (["--data", str(run / "notes.txt"), "--length", "999"], "--length 999"),
        (["--data", str(run / "notes.txt"), "--batch", "0"], "--batch 0"),
        (["--data", str(run / "notes.txt"), "--layout", "bogus:rows"], "rows"),
    ]
    for flags, names in cases:
        assert evaluate.main([str(run / "run"), *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and names in err[0] and "Traceback" not in err[0]


def test_export_is_read_by_transformers_with_equal_logits_and_eval(run, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    assert export.main([str(run / "run"), "--out", str(tmp_path / "hf")]) == 0
    params, cfg, _ = generate.load(run / "run")
    ids = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
    ours = transformer.lm_logits(params, nm.tensor(ids, "batch length"), cfg)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        theirs = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours.transpose(..., "vocab").data, theirs, atol=2e-5)
    capsys.readouterr()
    data = ["--data", str(run / "val.npy"), "--quiet"]
    assert evaluate.main([str(run / "run"), *data]) == 0
    assert evaluate.main([str(tmp_path / "hf"), *data]) == 0
    a, b = capsys.readouterr().out.strip().splitlines()
    assert a == b


def test_export_refuses_a_model_gpt2_cannot_hold():
    cfg = catalog.get("tiny")
    with pytest.raises(hub.UnsupportedModelError, match="Config.norm='rms'"):
        export.gpt2_config(cfg.replace(norm="rms"))
    with pytest.raises(hub.UnsupportedModelError, match="d_kv 8"):
        export.gpt2_config(cfg.replace(d_kv=8))


def test_the_dispatcher_names_unknown_commands_and_runs_benchmarks(capsys):
    assert cli.main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err
    assert cli.main([]) == 2 and "usage: namedmesh" in capsys.readouterr().out
    assert cli.main(["bench", "nosuch"]) == 2
    assert "benchmarks/nosuch.py" in capsys.readouterr().err
    argv = sys.argv
    try:
        assert cli.main(["bench", "eager", "--help"]) == 0
    finally:
        sys.argv = argv
    assert "usage: python -m benchmarks.eager" in capsys.readouterr().out  # the checkout's


def test_config_files_refuse_unknown_keys_and_bad_files(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps({"steps": 7, "vocab": 384, "grad-accum": 2}))
    args = train.arguments(["--config-file", str(tmp_path / "a.json"), "--lr", "0.5"])
    assert (args.steps, args.grad_accum, args.lr) == (7, 2, 0.5)
    assert train.arguments(["--config", "small"]).config == "small"  # not --config-file
    (tmp_path / "b.yaml").write_text("stepz: 3\n")
    (tmp_path / "c.json").write_text("[1, 2]")
    for name, says in (("b.yaml", "'stepz' is not a flag"), ("c.json", "not a mapping")):
        with pytest.raises(SystemExit) as e:
            train.arguments(["--config-file", str(tmp_path / name)])
        assert e.value.code == 2 and says in capsys.readouterr().err
    assert settings.read(str(tmp_path / "b.yaml")) == {"stepz": 3}
