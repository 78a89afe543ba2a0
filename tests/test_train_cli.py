"""`python -m models.cli.train` as a user runs it: one-line errors with status 2 for bad
flags, the files a run writes, and resuming after SIGKILL (same losses) or on another
mesh and layout (same losses within float32 noise)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from models.training import checkpoint

ROOT = Path(__file__).resolve().parents[1]
# conftest's XLA_FLAGS (the suite's compile options) and this file's devices (the last wins)
DEVICES = "--xla_force_host_platform_device_count=8"
ENV = {**os.environ, "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} {DEVICES}"}
SMALL = ["--config", "tiny", "--length", "16", "--batch", "8", "--quiet", "--eval-batches", "1"]
TWO_D = ["--mesh", "rows=2,cols=2", "--layout", "batch:rows;d_ff:cols;heads:cols"]


def command(*flags):
    return [sys.executable, "-m", "models.cli.train", *SMALL, *flags]


def train(*flags, timeout=300):
    return subprocess.run(
        command(*flags), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def losses(out: Path) -> dict[int, float]:
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), f"steps logged twice or out of order: {steps}"
    return {r["step"]: r["loss"] for r in records}


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--mesh", "rows=4,cols=4"], "16"),  # more devices than the 8 there are
        (["--mesh", "data=2", "--layout", "nonsense:data"], "nonsense"),
        (["--mesh", "data=2", "--layout", "batch:rows"], "rows"),  # no such mesh axis
        (["--mesh", "data=3", "--layout", "batch:data"], "batch"),  # 3 does not divide 8
        (["--data", "/no/such/corpus.txt"], "/no/such/corpus.txt"),
        (["--model", "gpt9"], "gpt9"),
        (["--mesh", "rows2"], "rows2"),  # malformed: argparse's own error
        (["--grad-accum", "3"], "grad_accum 3"),  # 3 does not divide the batch of 16
        (["--attention", "blockwise", "--attention-block", "0"], "--attention-block 0"),
    ],
)
def test_bad_flags_exit_2_with_one_line_naming_the_fault(tmp_path, flags, names, capsys):
    """In process, main() as `python -m` runs it (argparse's own errors exit by SystemExit);
    the two cases below run the real command line."""
    from models.cli.train import main

    out = tmp_path / "run"
    try:
        code = main([*SMALL, *flags, "--out", str(out), "--steps", "3"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("usage")]
    assert code == 2, err
    assert len(lines) == 1 and "error:" in lines[0] and names in lines[0], err
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--mesh", "data=2", "--layout", "nonsense:data"], "nonsense"),  # from the run
        (["--mesh", "rows2"], "rows2"),  # from argparse
    ],
)
def test_the_command_line_exits_2_with_one_line_and_no_traceback(tmp_path, flags, names):
    out = tmp_path / "run"
    r = train(*flags, "--out", str(out), "--steps", "3")
    lines = [x for x in r.stderr.splitlines() if x.strip() and not x.startswith("usage")]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and "error:" in lines[0] and names in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not (out / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """An uninterrupted 2D run of 24 steps, saving every 6."""
    out = tmp_path_factory.mktemp("baseline") / "run"
    board = ["--tensorboard", str(out.parent / "tb")]  # checked below, against metrics.jsonl
    r = train(
        *TWO_D, "--steps", "24", "--save-every", "6", "--eval-every", "12", "--out", out, *board
    )
    assert r.returncode == 0, r.stderr
    return out, r.stdout


def test_a_run_prints_its_plan_and_writes_metrics_plot_and_checkpoints(baseline):
    out, stdout = baseline
    assert "Mesh(rows=2, cols=2)" in stdout and "batch:rows;d_ff:cols;heads:cols" in stdout
    assert "per-device flops" in stdout and "psum" in stdout  # the lowering report
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 25))
    assert all(np.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in records)
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [12, 24]
    assert all(r["val_bits_per_byte"] > 0 for r in evals)
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert checkpoint.latest_step(out) == 24
    assert json.loads((out / "run.json").read_text())["config"] == "tiny"
    assert (out / "tokenizer.json").exists()


def test_tensorboard_events_hold_the_metrics(baseline):
    from test_train_cli_flags import scalars

    out, _ = baseline
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    got = scalars(out.parent / "tb")
    assert got["loss"] == pytest.approx({r["step"]: r["loss"] for r in records})
    assert got["val_loss"] == pytest.approx(
        {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    )


def test_sigkill_then_resume_logs_the_same_losses(baseline, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        command(*TWO_D, "--steps", "24", "--save-every", "6", "--eval-every", "12", "--out", out),
        cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and len(losses(out)) >= 14:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    logged = losses(out)
    assert len(logged) < 24, "the run finished before it could be killed"
    assert checkpoint.latest_step(out) is not None and checkpoint.latest_step(out) < 24
    r = train(*TWO_D, "--steps", "24", "--save-every", "6", "--eval-every", "12", "--out", out,
              "--resume")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "resumed from step" in r.stdout
    want, got = losses(baseline[0]), losses(out)
    assert list(got) == list(range(1, 25))
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-6)


def test_a_checkpoint_resumes_on_another_mesh_and_layout(baseline, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(baseline[0], out)
    for step in (24, 18):  # keep the checkpoints up to step 12
        shutil.rmtree(out / "checkpoints" / str(step))
    r = train("--mesh", "data=4", "--layout", "batch:data;d_model:data", "--steps", "24",
              "--save-every", "6", "--eval-every", "12", "--out", out, "--resume")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "resumed from step 12" in r.stdout and "Mesh(data=4)" in r.stdout
    want, got = losses(baseline[0]), losses(out)
    assert list(got) == list(range(1, 25))
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-3)
