"""The `namedmesh` console command's first module (pyproject's [project.scripts]).

Importing `namedmesh.cli` imports the namedmesh package and with it jax, which takes
seconds, and Ctrl-C or SIGTERM meanwhile ended the command in a traceback. This module
imports nothing heavy, and nothing of ours (a user's models.py cannot shadow it): it
makes those signals end the command at once in one line (status 130 or 143, as
models.preempt.exit_at_once does later) while the packages load, then runs
`namedmesh.cli.main` with the handlers put back; its commands take the signals over.
`python -m namedmesh` imports the package before anything of this can run."""

from __future__ import annotations

import os
import signal


def _stop(signum, frame) -> None:
    name = signal.Signals(signum).name
    os.write(2, f"namedmesh: error: stopped by {name} while starting; nothing done\n".encode())
    os._exit(128 + signum)


def main() -> int:
    old = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        from namedmesh.cli import main as run
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return run()
