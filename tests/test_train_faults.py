"""A training run under faults (issue 27): divergence, SIGTERM and SIGINT, a kill during
a save, damaged checkpoints and files, a run killed before its first checkpoint. Each
test injects the fault and checks that nothing is lost against an uninterrupted run of
the same flags (its losses), and that the message is typed and one line.

Runs are in process (main() as `python -m models.cli.train` runs it) where they can be: a
signal is sent to this process from inside the run, at a chosen step, by wrapping the
corpus' batch. A kill and a second Ctrl-C end the process, so those run as commands."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from models.cli import train
from models.io import files
from models.training import checkpoint, data, run

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--config", "tiny", "--length", "16", "--batch", "8", "--quiet", "--eval-batches", "1"]
STEPS = 12
RUN = [*FLAGS, "--steps", str(STEPS), "--save-every", "4", "--eval-every", "12"]
# conftest's XLA_FLAGS (the suite's compile options) and this file's devices (the last wins)
DEVICES = "--xla_force_host_platform_device_count=1"
ENV = {**os.environ, "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} {DEVICES}"}


def losses(out: Path) -> dict[int, float]:
    records = files.read_jsonl(out / "metrics.jsonl")
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), f"steps logged twice or out of order: {steps}"
    return {r["step"]: r["loss"] for r in records}


def main(*flags, capsys=None):
    """(exit status, stdout, stderr) of `python -m models.cli.train FLAGS`, in process."""
    try:
        code = train.main([str(f) for f in flags])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr() if capsys else None
    return code, (out.out if out else ""), (out.err if out else "")


def one_line_error(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """An uninterrupted run of 12 steps, saving every 4, started in a folder where a run
    was killed before its first checkpoint (its metrics end in a torn line): the same
    command starts it again, saying so."""
    out = tmp_path_factory.mktemp("baseline") / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "lo')
    code = train.main([*RUN, "--out", str(out)])
    assert code == 0
    return out


def test_a_run_killed_before_its_first_checkpoint_is_started_again(baseline):
    got = losses(baseline)
    assert list(got) == list(range(1, STEPS + 1))
    assert got[1] != 9.0  # the killed run's line is gone
    assert checkpoint.all_steps(baseline) == [12, 8, 4]


def stop_at(monkeypatch, step: int, signum) -> None:
    """Send `signum` to this process while the run builds the batch of `step`."""
    batch = data.Corpus.batch

    def wrapped(self, s, *a):
        if s == step:
            os.kill(os.getpid(), signum)
        return batch(self, s, *a)

    monkeypatch.setattr(data.Corpus, "batch", wrapped)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_at_the_step_boundary_and_resume_loses_nothing(
    baseline, tmp_path, monkeypatch, capsys, signum
):
    out = tmp_path / "run"
    before = signal.getsignal(signum)
    stop_at(monkeypatch, 6, signum)
    code, stdout, err = main(*RUN, "--out", out, capsys=capsys)
    assert code == run.EXIT_PREEMPTED == 75, err
    assert f"stopped by {signum.name} after step 6" in stdout
    assert checkpoint.all_steps(out) == [6, 4]  # step 6 saved, though --save-every is 4
    assert list(losses(out)) == list(range(1, 7))
    assert signal.getsignal(signum) == before  # the run's handlers are gone
    if signum == signal.SIGINT:
        return  # the resume is the same for both
    monkeypatch.undo()
    resume_loses_nothing(baseline, out, 6, capsys)


def resume_loses_nothing(baseline: Path, out: Path, step: int, capsys) -> str:
    """Resume the run in `out`: it restores `step`, and logs the losses of the run never
    stopped, every step once. Its stderr."""
    code, stdout, err = main(*RUN, "--out", out, "--resume", capsys=capsys)
    assert code == 0, err
    assert f"resumed from step {step}" in stdout
    want, got = losses(baseline), losses(out)
    assert list(got) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-6)
    return err


def command(*flags):
    return [sys.executable, "-m", "models.cli.train", *[str(f) for f in flags]]


STUCK = """
import sys, time
from models.training.preempt import Preemption
with Preemption(grace_s=float(sys.argv[1])):
    print("ready", flush=True)
    time.sleep(120)  # a step that never ends (a collective waiting on a lost peer)
"""


def stuck(grace_s: float) -> subprocess.Popen:
    """A process inside Preemption whose main thread never reaches a step boundary."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK, str(grace_s)], cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_a_second_ctrl_c_aborts_at_once_and_no_signal_waits_forever():
    proc = stuck(grace_s=600)
    try:
        proc.send_signal(signal.SIGINT)
        assert "SIGINT: saving a checkpoint" in proc.stderr.readline()  # the first, noted
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 128 + signal.SIGINT
        assert time.monotonic() - start < 10
        assert "aborted without saving: a second SIGINT" in proc.stderr.read()
        proc = stuck(grace_s=1)  # one SIGTERM, and the step never ends: out after 1 s
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert "aborted without saving: no step ended" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_sigkill_during_a_save_resumes_from_the_last_complete_one(baseline, tmp_path, capsys):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        command(*RUN, "--save-every", "1", "--out", out),
        cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    saving = lambda: any("tmp" in p.name for p in (out / "checkpoints").glob("*"))
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            time.sleep(0.002)  # a save takes longer; the run needs the CPU more than we do
            if (out / "checkpoints").exists() and saving() and len(losses(out)) >= 3:
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before a save could be killed"
    newest = checkpoint.all_steps(out)[0]
    assert newest < STEPS
    resume_loses_nothing(baseline, out, newest, capsys)


def test_a_diverging_run_skips_then_stops_and_never_saves_a_non_finite_state(tmp_path, capsys):
    """lr 1e30 after one step of warmup (lr 0): the update of step 2 is finite but huge,
    every later loss NaN. With --skip-nonfinite 2, steps 3 and 4 are skipped (their
    updates not applied: the checkpoints of steps 2, 3 and 4 hold the same state), step
    5 stops the run, and stops it again when resumed (the budget is stored with each checkpoint)."""
    out = tmp_path / "run"
    code, _, err = main(*FLAGS, "--steps", "10", "--lr", "1e30", "--warmup", "1",
                        "--save-every", "1", "--skip-nonfinite", "2", "--out", out,
                        capsys=capsys)  # fmt: skip
    assert code == run.EXIT_DIVERGED == 3
    line = one_line_error(err)
    assert "step 5: loss nan" in line.lower() and "newest checkpoint is step 4" in line
    records = files.read_jsonl(out / "metrics.jsonl")
    assert [r.get("skipped", False) for r in records] == [False, False, True, True, True]
    assert all(np.isfinite(r["loss"]) for r in records[:2])
    assert checkpoint.all_steps(out) == [4, 3, 2]  # the last finite ones, all kept
    # --resume keeps the budget: 2 used, so step 5 (not finite again) stops it at once
    code, _, err = main(*FLAGS, "--steps", "10", "--lr", "1e30", "--warmup", "1",
                        "--save-every", "1", "--skip-nonfinite", "2", "--out", out, "--resume",
                        capsys=capsys)  # fmt: skip
    assert code == run.EXIT_DIVERGED and "step 5: loss nan" in one_line_error(err).lower()
    assert checkpoint.all_steps(out) == [4, 3, 2]
    target = _target(out)
    states = [checkpoint.restore(out, target, s)[0] for s in (2, 3, 4)]  # verify: finite
    for other in states[1:]:
        for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(other), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _target(out: Path):
    """A fresh state of the run in `out` (restore's target)."""
    stored = json.loads((out / "run.json").read_text())
    args = train.arguments([*FLAGS, "--out", str(out), "--resume"])
    assert stored["config"] == args.config
    trainer = run.setup(args)[6]
    return trainer.init_state()


@pytest.fixture(scope="module")
def target(baseline):
    return _target(baseline)


def flip_a_bit(out: Path, step: int) -> None:
    """Flip one bit in the middle of the largest data file of the step's parameters."""
    found = (out / "checkpoints" / str(step) / "params").rglob("ocdbt.process_0/d/*")
    path = max(found, key=lambda f: f.stat().st_size)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def truncate(out: Path, step: int) -> None:
    found = (out / "checkpoints" / str(step) / "params").rglob("ocdbt.process_0/d/*")
    path = max(found, key=lambda f: f.stat().st_size)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def empty_newest(out: Path, step: int) -> None:
    (out / "checkpoints" / str(step + 4)).mkdir()


@pytest.mark.parametrize(
    "damage, names",
    [
        (flip_a_bit, "step 12 .* array params/\\S+ fails its checksum"),
        (truncate, "step 12 .* array\\(s\\) params/\\S+ .*cannot be read"),
        (empty_newest, "step 16 .* its meta cannot be read"),
    ],
)
def test_a_damaged_checkpoint_is_a_typed_error_and_resume_falls_back(
    baseline, target, tmp_path, damage, names, capsys
):
    out = tmp_path / "run"
    shutil.copytree(baseline, out)
    damage(out, 12)
    bad = checkpoint.all_steps(out)[0]
    with pytest.raises(checkpoint.DamagedCheckpointError, match=names):
        checkpoint.restore(out, target, bad)
    state, meta = checkpoint.restore_newest(out, target, say=print)
    assert meta["step"] == (12 if bad == 16 else 8)
    said = capsys.readouterr().out
    assert f"step {bad}" in said and f"resuming from step {meta['step']}" in said
    assert (out / "damaged" / str(bad)).exists()  # set aside, not deleted
    assert checkpoint.all_steps(out)[0] == meta["step"]


def test_resume_after_a_flipped_bit_and_a_torn_metrics_line_loses_nothing(
    baseline, tmp_path, capsys
):
    out = tmp_path / "run"
    shutil.copytree(baseline, out)
    flip_a_bit(out, 12)
    text = (out / "metrics.jsonl").read_text()
    (out / "metrics.jsonl").write_text(text[: len(text) - 30])  # step 12's line torn
    err = resume_loses_nothing(baseline, out, 8, capsys)
    assert "dropped a torn last line" in err and "fails its checksum" in err


def test_a_non_finite_checkpoint_is_refused_naming_the_last_finite_one(baseline, target, tmp_path):
    """A checkpoint holding NaN (as an older version could write) with valid checksums:
    --resume refuses it and names the newest finite step."""
    out = tmp_path / "run"
    shutil.copytree(baseline, out)
    state, meta = checkpoint.restore(out, target, 12)
    state["params"]["embed"] = state["params"]["embed"] * np.nan
    with pytest.raises(checkpoint.NonFiniteError, match="refusing to save step 16: params/embed"):
        checkpoint.Checkpointer(out).save(16, state, meta)
    shutil.rmtree(out / "checkpoints" / "12")
    flat = checkpoint.checksums({"params/embed": state["params"]["embed"].data})[0]
    sums = {**meta["checksums"], **flat}
    arrays = checkpoint.Checkpointer(out)  # the save without the check, as orbax does it
    opt = jax.tree.leaves(state["opt"])
    params = jax.tree.map(lambda t: t.data, state["params"], is_leaf=lambda x: hasattr(x, "dims"))
    arrays.manager.save(
        12,
        args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt=ocp.args.StandardSave({f"{i:05d}": x for i, x in enumerate(opt)}),
            meta=ocp.args.JsonSave({**meta, "checksums": sums}),
        ),
    )
    arrays.close()
    with pytest.raises(checkpoint.NonFiniteError, match="newest finite one is step 8"):
        checkpoint.restore_newest(out, target)
