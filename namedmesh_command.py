"""The `namedmesh` console command's first module (pyproject's [project.scripts]).

Importing `namedmesh.cli` imports the namedmesh package and with it jax, which takes
seconds, and Ctrl-C or SIGTERM meanwhile ended the command in a traceback. This module
imports nothing heavy, and nothing of ours (a user's models.py cannot shadow it): it
makes those signals end the command at once in one line (status 130 or 143, as
models.training.preempt.exit_at_once does later) while the packages load, then runs
`namedmesh.cli.main` with the handlers put back; its commands take the signals over.
`python -m namedmesh` imports the package before its __main__ can run: the package's
__init__ calls `guard()` first thing then (sys.argv[0] is "-m" while runpy imports it)."""

from __future__ import annotations

import os
import signal


def _stop(signum, frame) -> None:
    name = signal.Signals(signum).name
    os.write(2, f"namedmesh: error: stopped by {name} while starting; nothing done\n".encode())
    os._exit(128 + signum)


def guard():
    """Make SIGINT and SIGTERM end the process at once in one line while the packages
    load; the function that puts the previous handlers back."""
    old = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    return lambda: [signal.signal(s, handler) for s, handler in old.items()] and None


def main() -> int:
    unguard = guard()
    try:
        from namedmesh.cli import main as run
    finally:
        unguard()
    return run()
