"""Imported first by the package's __init__: under `python -m namedmesh ...` runpy
imports the package (and with it jax, seconds) before the package's __main__ can install
the console command's handlers, and Ctrl-C meanwhile ended in a traceback. While runpy
imports the package sys.argv[0] is "-m": then this installs namedmesh_command's handlers
(one line, status 130 or 143), and the package's __init__ calls `unguard()` once it has
imported. Standard library only."""

import sys


def _guard():
    if sys.argv[:1] != ["-m"]:
        return lambda: None
    try:
        import namedmesh_command
    except ImportError:  # the package without its console module: Python's own way
        return lambda: None
    return namedmesh_command.guard()


unguard = _guard()  # puts the previous handlers back (a no-op outside `python -m`)
