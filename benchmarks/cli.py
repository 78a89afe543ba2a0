"""What the benchmarks' command lines share (standard library only at import):
argparse types for counts and lists of counts, so `--rounds 0` or `--batches 1,abc` is
refused by argparse in one line (exit status 2) before any model is built, and `run`,
which ends a mistake the project reports by a typed error (a config, a layout, a file)
in one line with exit status 2 rather than a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def count(text: str) -> int:
    """An int >= 1 (rounds, steps, sizes, lengths)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def counts(text: str) -> list[int]:
    """Comma-separated ints >= 1, as "2048,8192"."""
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r}: an empty item; write e.g. 2048,8192")
    return [count(p) for p in parts]


def names(text: str) -> list[str]:
    """Comma-separated non-empty names, as "tiny,small"."""
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r}: an empty name")
    return parts


def user_errors() -> tuple[type[BaseException], ...]:
    """The typed errors the project raises for a user's mistake (a flag's value, a
    file), as opposed to a defect, which keeps its traceback."""
    # imported here, not at the top: a benchmark sets XLA's flags before jax starts
    from models.training.checkpoint import CheckpointError
    from models.training.data import DataError
    from namedmesh.errors import NamedMeshError

    return (NamedMeshError, CheckpointError, DataError)


def step_size_flags(p: argparse.ArgumentParser, families) -> None:
    """The flags that size a zoo family's training step (benchmarks.step_movement,
    benchmarks.dot_shapes): --family (of `families`), --layers, --d-model, --heads,
    --vocab, --length, --batch; the defaults are the realistic size of issue 40."""
    p.add_argument("--family", default="llama", choices=sorted(families))
    p.add_argument("--layers", type=count, default=4)
    p.add_argument("--d-model", type=count, default=512)
    p.add_argument("--heads", type=count, default=8)
    p.add_argument("--vocab", type=count, default=8192)
    p.add_argument("--length", type=count, default=512)
    p.add_argument("--batch", type=count, default=4)


def prog_name() -> str:
    """The command as the user typed it: `python -m benchmarks.NAME` or, under
    `namedmesh bench`, the argv[0] it sets."""
    first = sys.argv[0]
    if first.endswith(".py"):
        return f"python -m benchmarks.{first.rsplit('/', 1)[-1][:-3]}"
    return first


def run(main: Callable[[], int | None], prog: str | None = None) -> int:
    """main()'s exit status (0 where it returns no int: a result for callers); a user
    error it raises printed as one line, status 2."""
    prog = prog or prog_name()
    try:
        status = main()
        return status if isinstance(status, int) else 0
    except user_errors() as e:
        print(f"{prog}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
