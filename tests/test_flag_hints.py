"""One command surface (issue 39): transformers' name of a setting that ours takes alike is
an alias (underscores too); an unknown flag of any subcommand gets a did-you-mean, by
spelling or, for transformers' name of a setting held differently, ours and how; `bench
run --quick` asks for its devices itself and writes a page of its own, not the published
docs/benchmarks.md."""

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models.cli import evaluate, export, generate, train

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "main, flags, says",
    [
        (train.main, ["--output_dir", "x", "--stpes", "3"], "did you mean --steps for --stpes?"),
        (train.main, ["--model-name-or-path", "gpt2"],
         "did you mean --init-from for --model-name-or-path (a local Hugging Face folder)?"),
        (train.main, ["--per-device-train-batch-size=8"],
         "--batch for --per-device-train-batch-size (the global batch, split over the mesh)?"),
        (train.main, ["--num_train_epochs", "3"],
         "--steps for --num_train_epochs (optimizer steps in all: there are no epochs)?"),
        (export.main, ["run", "--out", "x", "--learning-rate", "1"], "unrecognized arguments: "
         "--learning-rate 1 (see --help)"),  # export has no --lr: no alias, no hint
        (evaluate.main, ["run", "--data", "x", "--max-length", "9"],
         "--length for --max-length (tokens per sequence)?"),
        (generate.main, ["x", "--model-name-or-path", "y"],
         "SOURCE for --model-name-or-path (the positional argument: a run or a local"),
        (generate.main, ["x", "--max-new-tokenz", "5"], "--max-new for --max-new-tokenz?"),
        (train.main, ["--zzzz"], "unrecognized arguments: --zzzz (see --help)"),
    ],
)  # fmt: skip
def test_an_unknown_flag_gets_the_command_own_flag_for_it(main, flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and says in err, err


@pytest.mark.parametrize(
    "parse, theirs, ours",
    [
        (train.arguments, ["--learning-rate", "3e-4", "--output-dir", "o", "--max-steps", "7"],
         ["--lr", "3e-4", "--out", "o", "--steps", "7"]),
        (train.arguments, ["--learning_rate=3e-4", "--gradient_accumulation_steps", "2",
                           "--warmup_steps", "5", "--max_grad_norm", "0.5", "--adam_epsilon",
                           "1e-6", "--save_steps", "4", "--eval_steps", "4", "--block_size", "8"],
         ["--lr", "3e-4", "--grad-accum", "2", "--warmup", "5", "--clip", "0.5", "--eps",
          "1e-6", "--save-every", "4", "--eval-every", "4", "--length", "8"]),
        (train.arguments, ["--train_file", "a.txt", "--validation-file", "b.txt",
                           "--max_seq_length", "8", "--grad_accum", "2"],
         ["--data", "a.txt", "--val-data", "b.txt", "--length", "8", "--grad-accum", "2"]),
        (generate.arguments, ["x", "--max_new_tokens", "5", "--top_k", "3"],
         ["x", "--max-new", "5", "--top-k", "3"]),
        (export.arguments, ["r", "--output_dir", "o"], ["r", "--out", "o"]),
    ],
)  # fmt: skip
def test_transformers_name_of_the_same_setting_is_an_alias(parse, theirs, ours):
    """Their names (and underscores for dashes) parse to what ours do; a value that
    only looks like a flag name after a `--` stays as it is."""
    assert vars(parse(theirs)) == vars(parse(ours))


def test_a_config_file_takes_their_names_too(tmp_path):
    """A YAML of transformers' names (and `--config_file` itself) sets our flags."""
    (tmp_path / "hf.yaml").write_text("learning_rate: 0.001\nmax_steps: 7\nwarmup-steps: 2\n")
    args = train.arguments(["--config_file", str(tmp_path / "hf.yaml"), "--max_steps", "9"])
    assert (args.lr, args.steps, args.warmup) == (0.001, 9, 2)  # the command line wins


def test_underscores_stop_at_the_double_dash():
    from models.cli.hints import dashed

    flags = {"--max-new", "--top-k"}
    argv = ["--max_new", "3", "--top_k=2", "--nope_x", "--", "--max_new"]
    assert dashed(argv, flags) == ["--max-new", "3", "--top-k=2", "--nope_x", "--", "--max_new"]


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
