"""`--config-file FILE`: a command's flags read from a JSON or YAML file (a run's
`run.json` is one), the flags given on the command line overriding them.

Keys are flag names, with `_` or `-` (`bpe_vocab`, `grad-accum`), transformers' names
of the same setting included (`learning_rate`: models/cli/hints.py); values are what the
flag takes (`mesh: rows=2,cols=4` or `{rows: 2, cols: 4}`), checked as the command
line checks them (the flag's type and choices; true/false for a switch, a list for a
repeatable flag). A key that is no flag of the command is refused by name; the keys a
run records about itself (`vocab`) are skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RECORDED = ("vocab", "family", "fingerprints")  # what run.json records that is no flag


def read(path: str) -> dict:
    """The mapping a JSON (or, by a .yaml/.yml suffix, YAML) file holds; ValueError
    naming the file when it cannot be read or holds something else."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read it ({getattr(e, 'strerror', None) or e})") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            out = yaml.safe_load(text)
        else:
            out = json.loads(text)
    except Exception as e:  # json's and yaml's own error types
        kind = "YAML" if p.suffix in (".yaml", ".yml") else "JSON"
        raise ValueError(f"not {kind}: {e}") from None
    if not isinstance(out, dict):
        raise ValueError(f"holds a {type(out).__name__}, not a mapping of flag names to values")
    return out


def defaults(parser: argparse.ArgumentParser, path: str) -> dict:
    """The file's settings keyed by the parser's flags (argparse `dest`s)."""
    try:
        stored = read(path)
    except ValueError as e:
        parser.error(f"--config-file {path}: {str(e).splitlines()[0]}")
    # by every name of a flag: its own, transformers' (models/cli/hints.py), `_` for `-`
    actions = {s: a for a in parser._actions for s in a.option_strings}
    actions |= {a.dest: a for a in parser._actions if a.option_strings}  # and its dest
    out = {}
    for key, value in stored.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest in RECORDED:
            continue
        action = actions.get(dest) or actions.get("--" + dest.replace("_", "-"))
        if action is None or action.dest in ("config_file", "help"):
            parser.error(f"--config-file {path}: {key!r} is not a flag of {parser.prog}")
        try:
            out[action.dest] = value if value is None else checked(action, value)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            parser.error(f"--config-file {path}: {key}: {e}")
    return out


def checked(action: argparse.Action, value):
    """A file's `value` for a flag, as the command line would take it: a switch's
    true/false, a repeatable flag's list of texts, else the flag's type of the value's
    text (a mapping as `k=v,...`), within its choices."""
    if action.nargs == 0:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r:.60}")
        return value
    if isinstance(action, argparse._AppendAction):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"expected a list of texts, got {value!r:.60}")
        return list(value)  # a copy: append adds to it
    if isinstance(value, dict):
        text = ",".join(f"{k}={v}" for k, v in value.items())
    elif isinstance(value, list | bool):
        raise ValueError(f"expected one value, got {value!r:.60}")
    else:
        text = str(value)
    out = action.type(text) if callable(action.type) else text
    if action.choices is not None and out not in action.choices:
        raise ValueError(f"{out!r} is not one of {', '.join(map(str, action.choices))}")
    return out


def parse(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """`parser.parse_args(argv)`, its defaults first taken from `--config-file` when
    argv names one."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser.set_defaults(**in_file(parser, argv))
    return parser.parse_args(argv)


def in_file(parser: argparse.ArgumentParser, argv: list[str]) -> dict:
    """The settings (argparse `dest` -> value) of the `--config-file` argv names, {}
    when it names none."""
    from models.cli.hints import dashed

    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # not --config
    pre.add_argument("--config-file", default=None)
    known, _ = pre.parse_known_args(dashed(argv, {"--config-file"}))  # --config_file too
    return {} if known.config_file is None else defaults(parser, known.config_file)
