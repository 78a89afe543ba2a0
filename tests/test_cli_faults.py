"""Bad input at the command lines, checked in process and before anything compiles:
every numeric flag against its declared range (one line naming flag, value and range,
exit 2), bad --set sizes and binary data; damaged files (a truncated .safetensors, a
config.json with a key missing or of the wrong type, a broken index, damaged
checkpoints) as one line and exit 2 at `models.cli.train` and `models.cli.generate`. And
`hub.save` over an export: the whole folder replaced, or (full disk) left intact."""

import errno
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from models import transformer  # noqa: F401
from models.cli import generate, train  # noqa: F401
from models.io import files, hub  # noqa: F401
from models.training import run  # noqa: F401

FLAGS = ["--config", "tiny", "--length", "16", "--batch", "8", "--quiet", "--steps", "2"]


def one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    "flag, value, allowed",
    [
        ("--batch", "0", ">= 1"),
        ("--length", "0", ">= 1"),
        ("--seed", "-1", ">= 0"),
        ("--save-every", "0", ">= 1"),
        ("--eval-every", "0", ">= 1"),
        ("--steps", "0", ">= 1"),
        ("--steps", "-5", ">= 1"),
        ("--lr", "nan", "> 0"),
        ("--lr", "inf", "> 0"),
        ("--lr", "0", "> 0"),
        ("--clip", "-1", ">= 0"),
        ("--eval-batches", "0", ">= 1"),
        ("--bpe-vocab", "0", ">= 257"),
        ("--dropout", "1.5", ">= 0 and <= 1"),
        ("--skip-nonfinite", "-1", ">= 0"),
    ],
)
def test_a_flag_out_of_its_range_is_one_line_naming_flag_value_and_range(
    flag, value, allowed, capsys
):
    with pytest.raises(SystemExit) as e:
        train.arguments([*FLAGS, flag, value])
    line = one_line(capsys.readouterr().err)
    assert e.value.code == 2
    assert f"{flag} {float(value) if flag in ('--lr', '--clip', '--dropout') else value}" in line
    assert f"must be {allowed}" in line


def test_every_numeric_flag_has_a_declared_range():
    """The class, not the cases: a numeric flag added without a range is caught here."""
    numeric = {a.dest for a in train.parser()._actions if a.type in (int, float)}
    assert numeric == set(train.RANGES)


def test_a_mesh_axis_given_twice_is_refused(capsys):
    with pytest.raises(SystemExit):
        train.arguments([*FLAGS, "--mesh", "a=2,a=4"])
    assert "axis 'a' given twice" in one_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--set", "heads=0"], "Config.heads (--set heads=) must be an int >= 1, got 0"),
        (["--set", "layers=0"], "Config.layers (--set layers=) must be an int >= 1, got 0"),
        (["--set", "dropout=-0.5"], "Config.dropout must be >= 0"),
        (["--data", "BINARY"], "a binary file, not UTF-8 text"),
    ],
)
def test_bad_sizes_and_binary_data_are_refused_before_compiling(
    tmp_path, flags, names, capsys, monkeypatch
):
    binary = tmp_path / "corpus.txt"  # text by its name, binary by its bytes
    binary.write_bytes(b"abc\0\x01\x02" * 100)
    flags = [str(binary) if f == "BINARY" else f for f in flags]
    monkeypatch.setattr(
        jax, "jit", None
    )  # nothing may compile before the error (models.training.run
    # and what it imports are imported above, their decorators applied)
    code = train.main([*FLAGS, *flags, "--out", str(tmp_path / "run")])
    assert code == 2 and names in one_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


# --- Hugging Face folders ----------------------------------------------------------
HF = {"model_type": "gpt2", "n_embd": 32, "n_head": 4, "n_layer": 2, "vocab_size": 64}
HF |= {"n_positions": 16}


def gpt2(seed: int) -> hub.HubModel:
    cfg = hub.family_config("gpt2", HF, set())
    return hub.HubModel("gpt2", cfg, transformer.init(hub.shapes_of("gpt2", cfg), seed), None, HF)


def arrays(model: hub.HubModel) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_leaves_with_path(model.params)
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hub") / "gpt2"
    hub.save(gpt2(0), folder)
    return folder


def shard(folder: Path) -> None:
    """Split the folder's model.safetensors into two shards and an index, as
    transformers' save_pretrained does for a large model."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2]}
    halves["model-00002-of-00002.safetensors"] = names[1::2]
    for file, part in halves.items():
        save_file({k: tensors[k] for k in part}, folder / file, {"format": "pt"})
    index = {"weight_map": {k: f for f, part in halves.items() for k in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model.safetensors").unlink()


def test_saving_over_a_sharded_export_replaces_it_whole(export, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(export, folder)
    shard(folder)
    old = arrays(hub.load(folder))
    new = gpt2(1)
    hub.save(new, folder)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    got, want = arrays(hub.load(folder)), arrays(new)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
        assert not np.array_equal(got[k], old[k]) or got[k].std() == 0, k
    assert [p.name for p in tmp_path.iterdir()] == ["gpt2"]  # no temporary left


def test_a_full_disk_leaves_the_old_export_intact_with_a_typed_error(export, tmp_path, monkeypatch):
    import safetensors.numpy

    folder = tmp_path / "gpt2"
    shutil.copytree(export, folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def full(tensors, path, metadata=None):
        Path(path).write_bytes(b"\0" * 100)  # part of the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    with pytest.raises(hub.SaveError, match="No space left on device"):
        hub.save(gpt2(1), folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["gpt2"]


def truncate_weights(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def drop_key(folder: Path) -> None:
    hf = json.loads((folder / "config.json").read_text())
    del hf["n_embd"]
    (folder / "config.json").write_text(json.dumps(hf))


def wrong_type(folder: Path) -> None:
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "n_head": "four"}))


def torn_config(folder: Path) -> None:
    (folder / "config.json").write_text('{"model_type": "gpt2", "n_e')


def broken_index(folder: Path) -> None:
    shard(folder)
    (folder / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')


@pytest.mark.parametrize(
    "damage, names",
    [
        (truncate_weights, "model.safetensors is not a readable safetensors file"),
        (drop_key, "config.json lacks the key 'n_embd'"),
        (wrong_type, "config.json: a value of the wrong type"),
        (torn_config, "config.json"),
        (broken_index, "no weight_map object"),
    ],
)
def test_a_damaged_hub_folder_is_one_line_and_exit_2(export, tmp_path, damage, names, capsys):
    folder = tmp_path / "gpt2"
    shutil.copytree(export, folder)
    damage(folder)
    with pytest.raises(hub.HubError, match=names.replace("(", r"\(")):
        hub.load(folder)
    assert generate.main([str(folder), "--max-new", "2"]) == 2
    assert names in one_line(capsys.readouterr().err)
    out = tmp_path / "run"
    assert train.main([*FLAGS, "--init-from", str(folder), "--out", str(out)]) == 2
    assert names in one_line(capsys.readouterr().err)


def test_a_run_whose_checkpoints_are_all_damaged_or_record_torn_is_one_line(tmp_path, capsys):
    """--resume of a run whose run.json is torn, then whose only checkpoint is empty."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text('{"model": "lm", "con')
    (out / "checkpoints" / "4").mkdir(parents=True)
    assert train.main([*FLAGS, "--out", str(out), "--resume"]) == 2
    assert f"the run's record {out}/run.json is not JSON" in one_line(capsys.readouterr().err)
    files.write_json(out / "run.json", {"model": "lm", "config": "tiny", "length": 16})
    (out / "tokenizer.json").write_text('{"kind": "byte"}')
    assert train.main([*FLAGS, "--out", str(out), "--resume"]) == 2
    warning, error = capsys.readouterr().err.strip().splitlines()
    assert "step 4" in warning and "its meta cannot be read" in warning
    assert error.startswith("models.cli.train: error: no checkpoint in") and "verifies" in error


@pytest.mark.parametrize("command", ["generate", "evaluate", "export"])
def test_ctrl_c_ends_a_command_in_one_line_and_status_130(
    command, export, tmp_path, monkeypatch, capsys
):
    """KeyboardInterrupt where the command works (here: as it joins its processes):
    one line naming the signal, status 130 (128 + SIGINT), no traceback."""
    import importlib

    from models.cli import cluster

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cluster, "join", ctrl_c)
    monkeypatch.setattr(cluster, "rank", ctrl_c)
    (tmp_path / "data.txt").write_text("some text " * 50)
    argv = {
        "generate": [str(export), "--prompt", "x"],
        "evaluate": [str(export), "--data", str(tmp_path / "data.txt")],
        "export": [str(export), "--out", str(tmp_path / "out")],
    }[command]
    module = importlib.import_module(f"models.cli.{command}")
    assert module.main(argv, prog=f"namedmesh {command}") == 130
    line = one_line(capsys.readouterr().err)
    assert line == f"namedmesh {command}: error: stopped by SIGINT (Ctrl-C) before it finished"
    assert not (tmp_path / "out").exists()


def test_generate_layout_auto_and_a_run_without_checkpoint_say_so(export, tmp_path, capsys):
    """`generate --layout auto` was refused as a malformed rule 'auto' (its docs said it
    works as train's); a run without a checkpoint yet was 'no run.json and checkpoint'."""
    flags = [str(export), "--prompt", "x", "--max-new", "1", "--mesh", "data=2"]
    assert generate.main([*flags, "--layout", "auto"]) == 2
    assert "generate takes rules" in one_line(capsys.readouterr().err)
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "run.json").write_text('{"model": "tiny"}')
    assert generate.main([str(folder), "--prompt", "x"]) == 2
    assert "no checkpoint yet" in one_line(capsys.readouterr().err)
