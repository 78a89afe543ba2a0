"""Training's edge cases outside the issues (fuzzed): each test a mistake or corner a
user meets, checked against an oracle apart from the code under test (the run's own
record, a NumPy computation, an uninterrupted run)."""

import json
import math

import pytest

from models.cli import train
from models.training import run


def main(*flags, capsys):
    """(exit status, stdout, stderr) of `python -m models.cli.train FLAGS`, in process."""
    try:
        code = train.main([str(f) for f in flags])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_resume_holds_a_config_files_flags_to_the_record_as_the_command_lines(tmp_path, capsys):
    """`--resume --config-file F`: F's --steps (changeable) is applied and said, F's
    --seed (not changeable) refused naming both values, never both left silently at the
    record's (run.json holds the run's seed 0 and 3 steps)."""
    out = tmp_path / "run"
    out.mkdir()
    first = train.arguments(["--steps", "3", "--out", str(out)])
    (out / "run.json").write_text(json.dumps(run.record_of(first)))
    before = (out / "run.json").read_text()
    (tmp_path / "more.json").write_text(json.dumps({"steps": 6, "seed": 5}))
    code, said, err = main("--out", out, "--resume", "--config-file", tmp_path / "more.json",
                           capsys=capsys)  # fmt: skip
    assert "--steps 6 (of --config-file" in said and "recorded 3; going on with 6" in said
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "--seed 5 (of --config-file" in lines[0] and "which recorded 0" in lines[0]
    assert (out / "run.json").read_text() == before


SMALL = ["--config", "tiny", "--length", "16", "--batch", "8", "--quiet", "--eval-batches", "1"]


def test_the_lr_logged_is_the_one_a_step_computed_with_after_skipped_steps(tmp_path, capsys):
    """lr 1e30 after one step of warmup: step 2's update is finite but huge, steps 3 to
    5 are not finite and skipped (their updates not applied, the optimizer's step count
    with them), step 6 stops the run. Steps 3 to 6 start from the same state, so each
    computes with the lr of update 2 (counted from 0) of the cosine schedule over 10
    steps, in float64: end + (lr - end) (1 + cos(pi (2 - 1) / 9)) / 2, end = lr / 10."""
    out = tmp_path / "run"
    code, _, _ = main(*SMALL, "--steps", "10", "--lr", "1e30", "--warmup", "1",
                      "--skip-nonfinite", "3", "--out", out, capsys=capsys)  # fmt: skip
    assert code == run.EXIT_DIVERGED
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped", False) for r in records] == [False, False, True, True, True, True]
    end = 1e29
    want = end + (1e30 - end) * 0.5 * (1 + math.cos(math.pi * 1 / 9))
    for r in records[2:]:
        assert r["lr"] == pytest.approx(want, rel=1e-6), (r["step"], r["lr"], want)
