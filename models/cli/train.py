"""`python -m models.cli.train`: train a model of the zoo on a mesh under a layout.

    python -m models.cli.train --model lm --config tiny --mesh rows=2,cols=4 \\
        --layout "batch:rows;d_ff:cols;heads:cols" --steps 300 --out runs/tiny

Prints the mesh, the layout and the lowering report, then a progress bar; writes
`OUT/metrics.jsonl` (one JSON object per step), orbax checkpoints under
`OUT/checkpoints`, `OUT/loss.png` and `OUT/run.json`. `--resume` continues from the
newest checkpoint in OUT that verifies, on any mesh and layout. On CPU, the mesh's
devices are simulated (XLA's host device count is set to the mesh size unless XLA_FLAGS
sets it). What a run promises under faults: docs/faults.md.

Exit statuses: 0 every step trained; 2 a bad flag, file or checkpoint, one line on
stderr before anything compiles (or, for a checkpoint, before training); 3 a step whose
loss or gradient norm is not finite, beyond --skip-nonfinite (not applied, not saved);
74 a checkpoint or the run's log could not be written (a full disk): the run stops at
the step that noticed, the older checkpoints kept; 75 stopped by SIGTERM or SIGINT after
saving a checkpoint at a step boundary (run the same command with --resume), or, with
several processes, a peer lost or hung (the step watchdog, --step-timeout; the last
checkpoint kept); 130 or 143 a signal before the training loop (while importing, loading
or compiling), a second signal, or none of the step ending within
models.training.preempt.GRACE_S seconds: nothing saved.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys

from models.cli import cluster

# re-exported (`models.cli.train.parser`, `.RANGES`, ...): their home was here
from models.cli.train_flags import FINETUNE_FIELDS as FINETUNE_FIELDS
from models.cli.train_flags import RANGES as RANGES
from models.cli.train_flags import Parser as Parser
from models.cli.train_flags import arguments as arguments
from models.cli.train_flags import parse_mesh as parse_mesh
from models.cli.train_flags import parser as parser
from models.training.preempt import exit_at_once


def user_errors() -> tuple[type[BaseException], ...]:
    """The errors that reach the command line as one line and exit status 2: ours (a
    flag, a file, its data, a checkpoint) and those of the file formats underneath (JSON, a
    file that cannot be read or written); orbax's and safetensors' are turned into
    CheckpointError where they are read (models/training/checkpoint.py, models/io/hub.py)."""
    import json

    from models.errors import DataError
    from models.training.checkpoint import CheckpointError
    from models.training.run import UsageError
    from namedmesh.errors import NamedMeshError

    return (UsageError, NamedMeshError, CheckpointError, DataError, json.JSONDecodeError, OSError)


def list_configs() -> str:
    """The named configs, one line each: name, layers, d_model, heads, d_ff, vocab, length."""
    from models.catalog import configs

    rows = [("name", "layers", "d_model", "heads", "d_ff", "vocab", "length")]
    rows += [
        (k, c.layers, c.d_model, c.heads, c.d_ff, c.vocab, c.length) for k, c in configs().items()
    ]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ("  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows)
    return "\n".join(line.rstrip() for line in lines)


def main(argv=None, prog: str = "python -m models.cli.train") -> int:
    name = prog.removeprefix("python -m ")
    # Ctrl-C or SIGTERM before the training loop (which saves first) ends the run at
    # once, in one line: installed before jax and the rest are imported
    restore = exit_at_once(name)
    try:
        return _main(argv, prog, name)
    finally:
        restore()


def _main(argv, prog: str, name: str) -> int:
    args = arguments(argv, prog)
    if args.config == "list":
        print(list_configs())
        return 0
    try:
        several = cluster.join(args, math.prod(args.mesh.values()))
    except cluster.ClusterError as e:
        return fail(e, 2, name)
    from models.training.checkpoint import SaveFailedError
    from models.training.run import (
        EXIT_DIVERGED,
        EXIT_SAVE_FAILED,
        EXIT_USAGE,
        DivergedError,
        train,
    )

    try:
        return train(args)
    except DivergedError as e:
        return cluster.ended(fail(e, EXIT_DIVERGED, name), several)
    except SaveFailedError as e:
        message = f"{e}, saving nothing more: free space and run the same command with --resume"
        return cluster.ended(fail(message, EXIT_SAVE_FAILED, name), several)
    except user_errors() as e:
        return cluster.ended(fail(e, EXIT_USAGE, name), several)
    except cluster.lost_peer_errors() as e:
        return cluster.ended(fail(cluster.lost(e), cluster.EXIT_LOST, name), several)


def fail(error, status: int, prog: str = "models.cli.train") -> int:
    """Print `error` as one line `prog: error: ...` on stderr; return `status`."""
    text = " ".join(str(error).split()) or type(error).__name__
    print(f"{prog}: error: {text}", file=sys.stderr, flush=True)
    return status


INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended


def one_line_on_ctrl_c(main):
    """`main(argv, prog)` of a command that saves nothing as it goes (generate, eval,
    export), ending at Ctrl-C in one line on stderr and status 130 instead of
    KeyboardInterrupt's traceback; its `finally` blocks have run by then (an export's
    half-written folder is removed, what was at --out kept)."""

    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        bound = inspect.signature(main).bind(*args, **kwargs)
        bound.apply_defaults()
        try:
            return main(*bound.args, **bound.kwargs)
        except KeyboardInterrupt:
            name = bound.arguments["prog"].removeprefix("python -m ")
            return fail("stopped by SIGINT (Ctrl-C) before it finished", INTERRUPTED, name)

    return run


if __name__ == "__main__":
    sys.exit(main())
