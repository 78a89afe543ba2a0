"""`namedmesh`: the console command `pip install` puts on the PATH.

    namedmesh train --model lm --config tiny --mesh rows=2,cols=4 --out runs/tiny
    namedmesh generate runs/tiny --prompt "The assert statement"
    namedmesh eval runs/tiny --data notes.txt --mesh data=2
    namedmesh export runs/tiny --out hf/tiny
    namedmesh launch -n 2 -- train --mesh data=2 --out runs/two
    namedmesh plan --config llama3-70b --mesh data=256,model=8 --rates h100,node=8 ...
    namedmesh bench run --quick

Each subcommand is the `main` of a module, imported only when it is asked for (so the
XLA device flags a subcommand sets are set before jax starts its backend). The
installed `models` and `lowering` packages are the ones next to this package, even
from a folder holding its own `models.py` or `lowering.py`. `bench` runs a module of
`benchmarks/`, which is not installed: it is read from the source checkout this
package was installed from (`pip install -e .`) or from the current folder.
"""

from __future__ import annotations

import difflib
import importlib
import os
import runpy
import sys
from pathlib import Path

# subcommand -> (module whose main(argv, prog) runs it, what it does)
COMMANDS = {
    "train": ("models.cli.train", "train a model of the zoo on a mesh under a layout"),
    "generate": ("models.cli.generate", "continue prompts with a run or a Hugging Face folder"),
    "eval": ("models.cli.evaluate", "loss, perplexity and bits per byte of a model on data"),
    "export": ("models.cli.export", "write a run's checkpoint as a Hugging Face folder"),
    "launch": ("models.cli.launch", "run a command as N processes of one run on this machine"),
    "plan": ("models.cli.plan", "plan a training step on a cluster (abstract meshes, no devices)"),
    "bench": ("benchmarks", "run a benchmark of the source checkout (default: run)"),
}
PROG = "namedmesh"


class CommandError(Exception):
    """A subcommand that does not exist, or `bench` without a source checkout."""


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {k:<{width}}  {v[1]}" for k, v in COMMANDS.items())
    return (
        f"usage: {PROG} {{{','.join(COMMANDS)}}} [flags]\n\n{rows}\n\n"
        f"`{PROG} COMMAND --help` lists a command's flags."
    )


def package_root() -> Path:
    """The folder holding the installed namedmesh, models and lowering packages."""
    return Path(__file__).resolve().parent.parent


def installed_first() -> None:
    """Drop the current folder from sys.path (`python -m` puts it first) unless the
    packages live there, so that a user's own models.py or lowering.py cannot shadow
    the installed ones."""
    root = package_root()
    here = {"", ".", os.getcwd()}
    if Path.cwd().resolve() != root:
        sys.path[:] = [p for p in sys.path if p not in here]


def checkout() -> Path:
    """The source checkout holding `benchmarks/`: next to the installed packages
    (an editable install) or the current folder."""
    for folder in (package_root(), Path.cwd()):
        if (folder / "benchmarks" / "__init__.py").is_file():
            return folder
    raise CommandError(
        f"bench runs the benchmarks/ of a source checkout; none next to {package_root()} "
        f"or in {Path.cwd()}: run it from a clone of the repository (pip install -e .)"
    )


def bench(argv: list[str]) -> int:
    """`namedmesh bench [NAME] [flags]`: `python -m benchmarks.NAME [flags]` of the
    checkout (NAME defaults to run)."""
    root = checkout()
    name = argv[0] if argv and not argv[0].startswith("-") else "run"
    rest = argv[1:] if argv and argv[0] == name else argv
    names = sorted(p.stem for p in (root / "benchmarks").glob("*.py") if p.stem != "__init__")
    if name not in names:
        raise CommandError(f"bench {name!r}: no benchmarks/{name}.py; known: {', '.join(names)}")
    sys.path.insert(0, str(root))
    sys.argv = [f"{PROG} bench {name}", *rest]
    try:
        runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    installed_first()
    try:
        if name not in COMMANDS:
            close = difflib.get_close_matches(name, COMMANDS, n=1)
            mean = f"did you mean {close[0]!r}? " if close else ""
            raise CommandError(f"unknown command {name!r}; {mean}one of {', '.join(COMMANDS)}")
        if name == "bench":
            return bench(rest)
        module = importlib.import_module(COMMANDS[name][0])
        return module.main(rest, prog=f"{PROG} {name}")
    except CommandError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
