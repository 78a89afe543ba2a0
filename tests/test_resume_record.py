"""A resume that keeps its word (issue 39): run.json records every setting of the run,
`--resume` goes on with them (the steps and schedule too), a flag given anew that
contradicts the record is refused naming both values unless changing it is meaningful
(then applied and said in one line), and `--config-file RUN/run.json` repeats the run."""

import datetime
import json
import sys
from pathlib import Path

import pytest

from models.cli import train

sys.path.insert(0, str(Path(__file__).parent))
from test_train_cli import SMALL  # noqa: E402

FLAGS = [*SMALL, "--steps", "2", "--save-every", "1", "--optimizer", "lion", "--lr", "1e-3",
         "--schedule", "constant", "--warmup", "0", "--seed", "3"]  # fmt: skip


def run(*flags, capsys):
    try:
        code = train.main([str(f) for f in flags])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def records(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "run"
    assert train.main([*FLAGS, "--out", str(out)]) == 0
    return out


def test_run_json_holds_every_setting_but_the_invocations(first):
    stored = json.loads((first / "run.json").read_text())
    flags = {a.dest for a in train.parser()._actions}  # noqa: SLF001 (argparse's)
    mine = {"help", "resume", "out", "config_file", "coordinator", "num_processes",
            "process_id", "quiet", "step_timeout", "tensorboard"}  # fmt: skip
    assert flags - mine <= set(stored) and not (mine & set(stored))
    assert (stored["steps"], stored["optimizer"], stored["schedule"]) == (2, "lion", "constant")
    kept = (stored["mesh"], stored["layout"], stored["seed"], stored["lr"])
    assert kept == ({"data": 1}, "", 3, 1e-3)


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--lr", "0.01"], "--lr 0.01 contradicts the run in {out}, which recorded 0.001"),
        (["--optimizer", "adamw"], "--optimizer adamw contradicts the run in {out}, which "
                                   "recorded lion"),
        (["--length", "32"], "--length 32 contradicts the run in {out}, which recorded 16"),
        (["--set", "d_model=32"], "--set d_model=32 contradicts the run in {out}, which "
                                  "recorded None"),
        (["--lora-rank", "4"], "--lora-rank 4 contradicts the run in {out}, which recorded "
                               "None"),
        # chat templates' strftime_now renders the day the run began, not the resume's
        (["--chat-date", "2001-02-03"], "--chat-date 2001-02-03 contradicts the run in {out}, "
                                        f"which recorded {datetime.date.today().isoformat()}"),
    ],
)  # fmt: skip
def test_a_flag_that_contradicts_the_record_is_refused_naming_both(first, flags, names, capsys):
    before = (first / "run.json").read_text()
    code, _, err = run("--out", first, "--resume", "--quiet", *flags, capsys=capsys)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and names.format(out=first) in lines[0], err
    assert (first / "run.json").read_text() == before


def test_resume_keeps_the_runs_settings_and_applies_more_steps_in_one_line(first, tmp_path, capsys):
    """`--resume` trains the recorded run (lion at the constant lr 1e-3, not 300 steps of
    the defaults); `--steps 3` goes on to step 3, said once, and recorded."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(first, out)
    code, stdout, _ = run("--out", out, "--resume", "--quiet", "--steps", "3", "--eval-every", "7",
                          capsys=capsys)  # fmt: skip
    said = [x for x in stdout.splitlines() if "going on with" in x]
    assert code == 0 and said == [
        f"--steps 3: the run in {out} recorded 2; going on with 3 as asked",
        f"--eval-every 7: the run in {out} recorded 100; going on with 7 as asked",
    ]
    recs = records(out)
    assert [r["step"] for r in recs] == [1, 2, 3] and recs[2]["lr"] == pytest.approx(1e-3)
    stored = json.loads((out / "run.json").read_text())
    assert (stored["steps"], stored["eval_every"], stored["optimizer"]) == (3, 7, "lion")


def test_config_file_of_run_json_repeats_the_run(first, tmp_path):
    again = tmp_path / "again"
    assert train.main(["--config-file", str(first / "run.json"), "--out", str(again)]) == 0
    want = [r["loss"] for r in records(first)]
    assert [r["loss"] for r in records(again)] == want  # same seed, data, optimizer: bitwise
    a, b = (json.loads((f / "run.json").read_text()) for f in (first, again))
    assert {k: v for k, v in a.items()} == {k: v for k, v in b.items()}


def test_a_run_recorded_before_chat_date_resumes_without_a_clock(first, tmp_path, capsys):
    """A run.json without `chat_date` rendered its chat templates with no strftime_now:
    its resume holds that ('none'), not the resume's day."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(first, out)
    stored = json.loads((out / "run.json").read_text())
    del stored["chat_date"]
    (out / "run.json").write_text(json.dumps(stored))
    code, _, err = run("--out", out, "--resume", "--quiet", "--chat-date", "2001-02-03",
                       capsys=capsys)  # fmt: skip
    assert code == 2 and "which recorded none" in err, err
