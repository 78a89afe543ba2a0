"""`--config-file FILE`: a command's flags read from a JSON or YAML file (a run's
`run.json` is one), the flags given on the command line overriding them.

Keys are flag names, with `_` or `-` (`bpe_vocab`, `grad-accum`); values are what the
flag takes (`mesh: rows=2,cols=4` or `{rows: 2, cols: 4}`). A key that is no flag of
the command is refused by name; the keys a run records about itself (`vocab`) are
skipped.
"""

from __future__ import annotations

import argparse
import json
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
    flags = vars(parser.parse_args([]))
    out = {}
    for key, value in stored.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest in RECORDED:
            continue
        if dest not in flags or dest == "config_file":
            parser.error(f"--config-file {path}: {key!r} is not a flag of {parser.prog}")
        out[dest] = list(value) if isinstance(value, list) else value  # append copies
    return out


def parse(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """`parser.parse_args(argv)`, its defaults first taken from `--config-file` when
    argv names one."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # not --config
    pre.add_argument("--config-file", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config_file is not None:
        parser.set_defaults(**defaults(parser, known.config_file))
    return parser.parse_args(argv)
