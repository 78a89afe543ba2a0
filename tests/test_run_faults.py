"""A run never loses work, round two (issue 41): an export never deletes what is not its
own; a checkpoint record damaged yet still JSON, and a metrics log with damaged lines,
fall back and resume; a restart with nothing to resume starts afresh; run.json keeps
absolute data paths and their fingerprints, so a resume elsewhere reads the same data
and one that would read other data stops; a save that fails on a full disk stops the run
with its own status; Ctrl-C while jax imports is one line and 130.

Each test injects the fault into a copy of one tiny 4-step run (saved at steps 2 and 4,
trained on a file given by a relative path) and checks against that uninterrupted run:
its losses, its files."""

import contextlib
import errno
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import orbax.checkpoint as ocp
import pytest

from models.cli import export, train
from models.io import files
from models.training import checkpoint

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--config", "tiny", "--length", "16", "--batch", "8", "--quiet", "--eval-batches", "1"]
RUN = [*FLAGS, "--steps", "4", "--save-every", "2", "--eval-every", "4"]


def text(start: int, n: int = 30_000) -> str:
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics))[start : start + n]


def main(*flags, cwd: Path | None = None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python -m models.cli.train FLAGS` in process, in
    the folder `cwd`."""
    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(cwd or here)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = train.main([str(f) for f in flags])
    except SystemExit as e:
        code = e.code
    finally:
        os.chdir(here)
    return code, out.getvalue(), err.getvalue()


def one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    return lines[0]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in files.read_jsonl(out / "metrics.jsonl")}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """root/run: the tiny run, trained on root/here/corpus.txt given as `corpus.txt`
    from root/here, started by `--resume` in a folder holding no run (it starts afresh,
    saying so). root/elsewhere/corpus.txt is another text of the same name."""
    root = tmp_path_factory.mktemp("faults")
    for folder, start in (("here", 0), ("elsewhere", 40_000)):
        (root / folder).mkdir()
        (root / folder / "corpus.txt").write_text(text(start))
    code, out, err = main(*RUN, "--data", "corpus.txt", "--out", "../run", "--resume",
                          cwd=root / "here")  # fmt: skip
    assert code == 0, err
    assert "../run holds no run to resume: starting it afresh" in out
    return root


def copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run / "run", tmp_path / "run")
    return tmp_path / "run"


def test_a_restart_with_nothing_to_resume_starts_and_a_lost_record_is_exit_2(run, tmp_path):
    assert list(losses(run / "run")) == [1, 2, 3, 4]
    assert checkpoint.all_steps(run / "run") == [4, 2]
    out = copy(run, tmp_path)
    (out / "run.json").unlink()  # checkpoints without the record they were made under
    code, _, err = main(*RUN, "--out", out, "--resume")
    assert code == 2 and "holds checkpoints but no run.json" in one_line(err)
    assert checkpoint.all_steps(out) == [4, 2]


@pytest.mark.parametrize(
    "key, to, digest, names",
    [
        ('"d_model"', '"d_modem"', True, "fails its SHA-256"),
        ('"opt_leaves"', '"opt_leaveq"', False, "no list of the optimizer's arrays"),
        ('"shape": [256', '"shape": ["256"', False, "describes parameter 'embed'"),
    ],
)
def test_a_record_damaged_yet_json_is_a_damaged_checkpoint(run, tmp_path, key, to, digest, names):
    """With its digest (a flipped bit anywhere) or without (a checkpoint written before
    digests: its structure checked), never another model's record."""
    out = copy(run, tmp_path)
    meta = out / "checkpoints" / "4" / "meta" / "metadata"
    assert key in meta.read_text()
    meta.write_text(meta.read_text().replace(key, to, 1))
    if not digest:
        shutil.rmtree(out / "checkpoints" / "4" / "digest")
    with pytest.raises(checkpoint.DamagedCheckpointError, match=f"step 4 .*{names}"):
        checkpoint.read_meta(out, 4)
    assert checkpoint.read_meta(out, 2)["step"] == 2


def test_a_run_json_value_of_the_wrong_type_is_one_line_naming_it(run, tmp_path):
    out = copy(run, tmp_path)
    stored = json.loads((out / "run.json").read_text())
    files.write_json(out / "run.json", {**stored, "batch": "8"})
    code, _, err = main(*RUN, "--out", out, "--resume")
    assert code == 2 and "run.json: 'batch' holds '8', not a value of --batch" in one_line(err)


def test_run_json_records_the_data_by_absolute_path_with_its_size_and_hash(run):
    stored = json.loads((run / "run" / "run.json").read_text())
    data = run / "here" / "corpus.txt"
    assert stored["data"] == str(data) and Path(stored["data"]).is_absolute()
    raw = data.read_bytes()
    assert stored["fingerprints"]["data"] == {
        "bytes": len(raw),
        "sha256": hashlib.sha256(raw).hexdigest(),
    }
    args = train.arguments(["--config-file", str(run / "run" / "run.json")])  # a settings file
    assert (args.data, args.batch) == (str(data), 8)


def test_a_resume_elsewhere_past_a_damaged_record_and_log_loses_nothing(run, tmp_path):
    """Step 4's record with "d_model" -> "d_modem" (still JSON), metrics lines 1-3
    damaged (a key with a flipped bit, a value that is no object, a torn line), resumed
    from a folder holding another corpus.txt: it falls back to step 2, drops the lines
    with one warning, reads the run's own data and logs the uninterrupted losses."""
    out = copy(run, tmp_path)
    meta = out / "checkpoints" / "4" / "meta" / "metadata"
    meta.write_text(meta.read_text().replace('"d_model"', '"d_modem"'))
    json.loads(meta.read_text())  # the damage leaves it JSON
    lines = (out / "metrics.jsonl").read_text().splitlines()
    lines[:3] = [lines[0].replace('"step"', '"stdp"'), "[1, 2]", lines[2][:20]]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    code, stdout, err = main(*RUN, "--out", out, "--resume", cwd=run / "elsewhere")
    assert code == 0, err
    assert "step 4" in err and "its record (meta) fails its SHA-256" in err
    assert "resuming from step 2" in err and "resumed from step 2" in stdout
    warned = [x for x in err.splitlines() if "metrics.jsonl" in x]
    assert len(warned) == 1 and f"{out}/metrics.jsonl: dropped damaged line(s) 1, 2, 3" in warned[0]
    want, got = losses(run / "run"), losses(out)
    assert list(got) == [3, 4]  # the damaged lines are gone, every later step logged once
    assert [got[s] for s in got] == pytest.approx([want[s] for s in got], rel=1e-6)
    assert (out / "damaged" / "4").exists()


def test_a_resume_that_would_read_other_data_stops_unless_the_data_is_given(run, tmp_path):
    out = copy(run, tmp_path)
    data = tmp_path / "corpus.txt"  # the run's data, moved: the record says where it is
    shutil.copyfile(run / "here" / "corpus.txt", data)
    stored = json.loads((out / "run.json").read_text())
    files.write_json(out / "run.json", {**stored, "data": str(data)})
    raw = bytearray(data.read_bytes())
    raw[5] ^= 0x20  # the same size, one letter's case changed
    data.write_bytes(bytes(raw))
    before = (out / "metrics.jsonl").read_bytes()
    code, _, err = main(*RUN, "--out", out, "--resume")
    line = one_line(err)
    assert code == 2 and f"--data {data} is not the data this run started on" in line
    assert (out / "metrics.jsonl").read_bytes() == before
    code, stdout, err = main(*RUN, "--out", out, "--resume", "--data", data)  # as asked
    assert code == 0, err
    said = [x for x in stdout.splitlines() if "not the data this run started on" in x]
    assert len(said) == 1 and "training on it as asked" in said[0]
    stored = json.loads((out / "run.json").read_text())  # a later --resume reads it as is
    assert stored["fingerprints"]["data"]["sha256"] == hashlib.sha256(raw).hexdigest()


def test_a_full_disk_during_a_background_save_stops_the_run_keeping_the_older(
    tmp_path, monkeypatch
):
    """The save of step 4 fails in orbax's background thread (ENOSPC while writing the
    record): the run stops (before the next save) with exit 74 and one line naming step
    4, saves nothing more, and keeps step 2."""
    write = ocp.handlers.JsonCheckpointHandler._save_fn

    async def full(self, x, directory):
        if x.get("step") == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return await write(self, x, directory)

    monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "_save_fn", full)
    out = tmp_path / "run"
    code, _, err = main(*FLAGS, "--steps", "8", "--save-every", "2", "--eval-every", "8",
                        "--out", out)  # fmt: skip
    line = one_line(err)
    assert code == train_status("EXIT_SAVE_FAILED") == 74
    assert "checkpoint of step 4" in line and "No space left on device" in line
    assert "the newest checkpoint is step 2" in line
    assert checkpoint.all_steps(out) == [2]
    last = max(losses(out))
    assert 4 < last <= 6 and f"the run stopped after step {last}" in line


def train_status(name: str) -> int:
    from models.training import run

    return getattr(run, name)


IMPORTING = """
import builtins, os, signal, sys
{before}
real = builtins.__import__
def hook(name, *args, **kwargs):
    if name == "jax":  # Ctrl-C while jax imports
        os.kill(os.getpid(), signal.SIGINT)
    return real(name, *args, **kwargs)
builtins.__import__ = hook
{start}
"""
# (imported before the signal, the start): the console command (pyproject's entry; jax
# and namedmesh not imported yet) and `python -m models.cli.train` (the command's modules
# import jax)
STARTS = {
    "namedmesh": ("import namedmesh_command", "sys.argv[1:] = ['train', '--steps', '1', "
                  "'--out', sys.argv[1]]; sys.exit(namedmesh_command.main())"),
    "models.cli.train": ("from models.cli import train",
                     "sys.exit(train.main(['--steps', '1', '--out', sys.argv[1]]))"),
}  # fmt: skip


@pytest.mark.parametrize("start", STARTS)
def test_ctrl_c_while_jax_imports_is_one_line_and_130(tmp_path, start):
    proc = subprocess.run(
        [sys.executable, "-c", IMPORTING.format(before=STARTS[start][0], start=STARTS[start][1]),
         str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert "stopped by SIGINT" in one_line(proc.stderr)
    assert not (tmp_path / "run").exists()


def test_ctrl_c_while_python_m_namedmesh_imports_jax_is_one_line_and_130(tmp_path):
    """`python -m namedmesh` imports the package before its __main__ runs: the hook is
    a sitecustomize, in place before runpy imports anything of ours."""
    (tmp_path / "sitecustomize.py").write_text(IMPORTING.format(before="", start=""))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, "-m", "namedmesh", "train", "--steps", "1", "--out",
         str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert one_line(proc.stderr) == (
        "namedmesh: error: stopped by SIGINT while starting; nothing done"
    )
    assert not (tmp_path / "run").exists()


# --- export ------------------------------------------------------------------------
def export_main(run: Path, out) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = export.main([str(run), "--out", str(out)])
    return code, err.getvalue()


def listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_export_replaces_only_its_own_folder_and_never_loses_what_was_there(
    run, tmp_path, monkeypatch
):
    src = run / "run"
    before = listing(src)
    hf = tmp_path / "hf"
    assert export_main(src, hf) == (0, "")
    marker = json.loads((hf / export.MARKER).read_text())
    wrote = {p.name for p in hf.iterdir()} - {export.MARKER}
    assert set(marker["files"]) == wrote and {"config.json", "model.safetensors"} <= wrote
    assert export_main(src, hf) == (0, "")  # an earlier export: replaced
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "empty").mkdir()
    (hf / "notes.txt").write_text("mine")
    for out, names in [
        (src, "holds the run"),
        (run, "holds the run"),
        (src / "checkpoints" / "9", f"is inside {src / 'checkpoints'}, which the run"),
        (tmp_path / "notes.txt", "is a file"),
        (hf, "holds notes.txt, not written by an export"),
        (tmp_path, "holds empty, hf, notes.txt"),
    ]:
        code, err = export_main(src, out)
        assert code == 2 and f"--out {out}: {names}" in one_line(err)
    assert listing(src) == before  # the run, its checkpoints and records untouched
    assert (tmp_path / "notes.txt").read_text() == (hf / "notes.txt").read_text() == "mine"
    (hf / "notes.txt").unlink()
    old = listing(hf)
    import safetensors.numpy

    def full(tensors, path, metadata=None):
        Path(path).write_bytes(b"\0" * 100)  # part of the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    code, err = export_main(src, hf)
    assert code == 2 and "No space left on device" in one_line(err)
    assert listing(hf) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "hf", "notes.txt"]


def test_the_fingerprint_of_a_large_file_and_of_a_folder(tmp_path):
    big = tmp_path / "big.bin"
    raw = os.urandom(3 << 20)
    big.write_bytes(raw)
    mib = 1 << 20
    want = hashlib.sha256(raw[:mib] + raw[-mib:]).hexdigest()  # its two ends
    assert files.fingerprint(big) == {"bytes": len(raw), "sha256": want}
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / ".git").mkdir()
    (folder / "a.txt").write_text("one")
    (folder / "sub" / "b.txt").write_text("two")
    (folder / ".git" / "x").write_text("hidden")
    first = files.fingerprint(folder)
    assert first["bytes"] == 6
    (folder / ".git" / "x").write_text("skipped, as the readers skip it")
    assert files.fingerprint(folder) == first
    (folder / "sub" / "b.txt").write_text("tw0")
    assert files.fingerprint(folder)["sha256"] != first["sha256"]
    (folder / "sub" / "b.txt").write_text("two")
    (folder / "a.txt").rename(folder / "c.txt")
    assert files.fingerprint(folder)["sha256"] != first["sha256"]
