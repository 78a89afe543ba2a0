"""The training CLI's help, defaults and newer flags as a user meets them: every flag
documented with its default, a default layout that is data parallel, `--set` for a
Config field, `--tokenizer` taking a file, TensorBoard events on request, and typed
one-line errors (with the closest name) for each of them."""

import json
import math
import re
import struct
import sys
from pathlib import Path

import pytest

from models import catalog, transformer
from models.training import data

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from test_train_cli import SMALL  # noqa: E402


@pytest.mark.parametrize("command", ["train", "plan", "generate", "evaluate"])
def test_help_documents_every_flag_with_one_default(capsys, command):
    """Every flag's help ends in one default: a help that says its own in words
    (plan's `--remat`: "(default: searched)") is not followed by "(default: None)"."""
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(f"models.cli.{command}").arguments(["--help"])
    text = capsys.readouterr().out
    options = text[text.index("options:") :]
    flags = re.findall(r"^  (--[\w-]+)", options, re.MULTILINE)
    assert len(flags) >= 8 and "--mesh" in flags
    blocks = re.split(r"^  (?=--)", options, flags=re.MULTILINE)[1:]
    defaults = {b.split()[0]: " ".join(b.split()).count("(default: ") for b in blocks}
    assert {f: n for f, n in defaults.items() if n != 1 and f != "--help"} == {}
    if command == "plan":
        assert "fix remat (default: searched)" in " ".join(options.split())


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--set", "d_modle=32"], "did you mean 'd_model'"),
        (["--set", "layers=two"], "'two' is not a valid int for Config.layers"),
        (["--set", "layers"], "expected field=value"),
        (["--tokenizer", "/no/such/tokenizer.json"], "/no/such/tokenizer.json"),
        (["--mesh", "data=2", "--layout", "bacth:data"], "did you mean 'batch'"),
        (["--mesh", "m=3", "--layout", "heads:m"], "input 0:layers/attn/"),  # by its path
    ],
)
def test_bad_new_flags_exit_2_with_one_line_naming_the_fault(tmp_path, flags, names, capsys):
    """In process (the subprocess path is test_train_cli's): main() as `python -m` runs it."""
    from models.cli.train import main

    code = main([*SMALL, *flags, "--out", str(tmp_path / "run"), "--steps", "2"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and names in lines[0], err


def scalars(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value, read from the TFRecord event files with the protobuf that
    tensorboardX writes (no TensorFlow needed)."""
    from tensorboardX.proto import event_pb2

    out: dict = {}
    for path in folder.glob("events.out.tfevents.*"):
        raw, i = path.read_bytes(), 0
        while i < len(raw):
            (n,) = struct.unpack("<Q", raw[i : i + 8])
            event = event_pb2.Event.FromString(raw[i + 12 : i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


def test_set_a_tokenizer_file_and_the_default_layout(tmp_path, capsys):
    """Set up and planned in process, one step run (`--steps 1`); the TensorBoard events
    of a real run are checked in test_train_cli, on its baseline run."""
    from models.cli.train import main

    tok = tmp_path / "tokenizer.json"
    data.ByteTokenizer().save(tmp_path)
    out = tmp_path / "run"
    flags = ["--mesh", "data=2", "--steps", "1", "--set", "d_model=32", "--tokenizer", str(tok)]
    assert main([*SMALL, *flags, "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "layout batch:data (the default: data parallel over the mesh)" in stdout
    # the default kernel and what it picks at 16 tokens (models.layers.kernels.FUSED_FROM)
    assert "attention auto (full at 16 tokens); remat none; dtype float32" in stdout
    cfg = catalog.get("tiny").replace(d_model=32, length=16, batch=8, vocab=data.padded_vocab(256))
    n = sum(math.prod(p.sizes.values()) for p in _leaves(transformer.lm_shapes(cfg)))
    assert f"{n:,} parameters" in stdout
    run = json.loads((out / "run.json").read_text())
    assert run["set"] == ["d_model=32"] and run["tokenizer"] == str(tok)


def _leaves(shapes):
    if isinstance(shapes, dict):
        return [s for v in shapes.values() for s in _leaves(v)]
    return [shapes]
