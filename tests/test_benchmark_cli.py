"""The benchmarks' command lines refuse a bad flag value in one line with exit status 2,
before building anything, and end the project's typed errors the same way."""

import argparse
import importlib
import sys

import pytest

from benchmarks import cli
from models.architecture import ConfigError

BAD_FLAGS = [  # (module, argv): a count of 0, a list with a non-number, an unknown name
    ("auto_layout", ["--steps", "0"]),
    ("decode", ["--new", "0"]),
    ("decode_latent", ["--rounds", "0"]),
    ("gpu", ["--steps", "-3"]),
    ("zoo_vs_hf", ["--repeats", "0"]),
    ("zoo_vs_hf", ["--size", "realistic", "--layers", "2"]),  # a size and a size flag
    ("einsum_emission", ["--repeats", "x"]),
    ("grouped_kernel", ["--rows", "0"]),
    ("moe_routing", ["--experts", "0"]),
    ("expert_ffn_routes", ["--experts", "0"]),
    ("pipeline", ["--repeats", "0"]),
    ("quality", ["--steps", "abc"]),
    ("step_movement", ["--layers", "0"]),
    ("layer_loop", ["--sizes", "huge"]),
    ("long_seq", ["--kinds", "fused;flash"]),
    ("honest", ["--rounds", "0"]),
    ("experts_slots", ["--rounds", "0"]),
    ("experts_slots", ["--before", "no-such-revision"]),
    ("experts_profile", ["--size", "huge"]),
    ("beside_dots", ["--rounds", "0"]),
    ("step_profile", ["--size", "huge"]),
    ("experts_blocks", ["--rounds", "0"]),
    ("experts_blocks", ["--blocks", "3"]),  # not a divisor of --rows
]


@pytest.mark.parametrize(
    "module, argv", BAD_FLAGS, ids=lambda x: " ".join(x) if isinstance(x, list) else x
)
def test_a_bad_count_is_refused_by_argparse_in_one_line(module, argv, capsys, monkeypatch):
    """...named as every benchmark names itself (cli.prog_name: the command typed)."""
    main = importlib.import_module(f"benchmarks.{module}").main
    monkeypatch.setattr(sys, "argv", [f"/checkout/benchmarks/{module}.py"])
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert argv[0] in err and "Traceback" not in err
    assert err.startswith(f"python -m benchmarks.{module}: error: ")


@pytest.mark.parametrize(
    "text, want", [("2048,8192", [2048, 8192]), (" 1 ,8", [1, 8]), ("0", None), ("1,,2", None)]
)
def test_counts_reads_positive_ints_or_refuses(text, want):
    if want is None:
        with pytest.raises(argparse.ArgumentTypeError, match="at least 1|empty"):
            cli.counts(text)
    else:
        assert cli.counts(text) == want


def test_run_ends_a_typed_user_error_in_one_line_and_keeps_a_defect(capsys):
    def bad_config():
        raise ConfigError("Config.length (--length) must be an int >= 1, got 0")

    assert cli.run(bad_config, "prog") == 2
    err = capsys.readouterr().err
    assert err == "prog: error: ConfigError: Config.length (--length) must be an int >= 1, got 0\n"
    assert cli.run(lambda: {"rows": 1}, "prog") == 0  # a result for callers is not a status

    def defect():
        raise KeyError("a bug")

    with pytest.raises(KeyError):  # not a user's mistake: its traceback stays
        cli.run(defect, "prog")
