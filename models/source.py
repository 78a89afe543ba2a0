"""SOURCE: how every subcommand that reads a model takes it (generate, eval, export).

    namedmesh generate runs/tiny --step 200 --prompt "The"
    namedmesh eval hf/gpt2 --data val.txt
    namedmesh export runs/tiny --step 200 --out hf/tiny

One positional SOURCE, a training run's --out folder or a Hugging Face folder, and
`--step N` to read a run's checkpoint at step N instead of its latest (a step the run
has not saved is refused, naming the steps it has; a Hugging Face folder has no steps).
An older spelling (`generate --checkpoint X`) still works, with a one-line note on
stderr saying the new one.
"""

from __future__ import annotations

import argparse
import sys

SOURCE = "SOURCE"  # the positional's name in usage lines and did-you-mean hints
WHAT = "a training run's --out folder, or a Hugging Face folder"


def add_source(p: argparse.ArgumentParser, what: str = WHAT, old: tuple[str, ...] = ()) -> None:
    """SOURCE (described by `what`), --step, and `old`: earlier flags for SOURCE, kept
    working but left out of --help (`resolve` says they are deprecated)."""
    p.add_argument("source", nargs="?", default=None, metavar=SOURCE, help=what)
    p.add_argument(
        "--step",
        type=int,
        default=None,
        help="a run's checkpoint at this step (None: its latest)",
    )
    for flag in old:
        p.add_argument(flag, dest=f"old_{flag.lstrip('-')}", default=None, help=argparse.SUPPRESS)


def resolve(p: argparse.ArgumentParser, args: argparse.Namespace, old: tuple[str, ...] = ()):
    """`args` with .source set from SOURCE or an `old` flag (a one-line deprecation note
    on stderr); the parser's one-line error for neither or two different ones."""
    name = p.prog.removeprefix("python -m ")
    for flag in old:
        given = vars(args).pop(f"old_{flag.lstrip('-')}", None)
        if given is None:
            continue
        if args.source is not None and args.source != given:
            p.error(f"{SOURCE} {args.source} and {flag} {given} name two models: give one")
        print(
            f"{name}: note: {flag} is deprecated: write `{name} {given} ...` ({SOURCE} first)",
            file=sys.stderr,
            flush=True,
        )
        args.source = given
    if args.source is None:
        what = next(a.help for a in p._actions if a.metavar == SOURCE)  # argparse's list
        p.error(f"{SOURCE} is missing: {what} (e.g. `{name} runs/tiny ...`)")
    return args
