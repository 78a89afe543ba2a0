"""One command surface (issue 39): an unknown flag of any subcommand gets a did-you-mean,
by spelling or for transformers' name of the setting; `bench run --quick` asks for its
devices itself and writes a page of its own, not the published docs/benchmarks.md."""

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import evaluate, export, generate, train

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "main, flags, says",
    [
        (train.main, ["--learning-rate", "3e-4"], "did you mean --lr for --learning-rate?"),
        (train.main, ["--output_dir", "x", "--stpes", "3"],
         "did you mean --out for --output_dir, --steps for --stpes?"),
        (train.main, ["--model-name-or-path", "gpt2"], "--init-from for --model-name-or-path"),
        (train.main, ["--per-device-train-batch-size=8"],
         "--batch for --per-device-train-batch-size?"),
        (export.main, ["run", "--out", "x", "--output-dir", "y"], "--out for --output-dir?"),
        (evaluate.main, ["run", "--data", "x", "--max-length", "9"], "--length for --max-length?"),
        (generate.main, ["--checkpoint", "x", "--max-new-tokens", "5"],
         "--max-new for --max-new-tokens?"),
        (generate.main, ["--checkpoint", "x", "--model-name-or-path", "y"],
         "--checkpoint for --model-name-or-path?"),
        (train.main, ["--zzzz"], "unrecognized arguments: --zzzz (see --help)"),
    ],
)  # fmt: skip
def test_an_unknown_flag_gets_the_command_own_flag_for_it(main, flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and says in err, err


def test_an_unknown_command_gets_the_closest_one(capsys):
    from namedmesh import cli

    assert cli.main(["trian", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown command 'trian'; did you mean 'train'?" in err, err


def test_bench_asks_for_its_devices_after_jax_is_imported_and_keeps_the_docs():
    """As the `namedmesh` command runs it: jax imported first, no XLA_FLAGS."""
    from benchmarks import run

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    code = ("import jax, namedmesh.cli; from benchmarks import run; run.simulate(run.DEVICES); "
            "print(jax.device_count())")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and out.stdout.split() == ["8"], out.stderr
    day = datetime.date.today().isoformat()
    assert run.docs_path(None, True, "res") == str(Path("res") / f"{day}-quick.md")
    assert run.docs_path(None, False, "res") == str(ROOT / "docs" / "benchmarks.md")
    assert run.docs_path("", True, "res") == ""
