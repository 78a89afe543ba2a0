"""`python -m benchmarks.beside_dots`: a zoo family's training step (benchmarks/
train_vs_torch.py's sizes and step) before and after the changes of "The realistic step
beside the dots (stop 49)" in docs/benchmarks.md, both compiled in one process and
alternated with transformers' eager step by benchmarks/fair.py's method (one thread,
CPU time), after checking the three first losses agree.

"Before" is this code with each change's earlier form put back while the step is
traced (`BEFORE`: the name of what changed -> a function that puts it back and returns
the undo), so the two builds differ in those changes alone:

    python -m benchmarks.beside_dots --family llama --size realistic --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from benchmarks import cli, fair


def traced_rotary_tables():
    """The rotation's cos and sin as ops of the program, not a NumPy table (before: XLA
    fused them into each consumer of q and k, one cos and one sin per element)."""
    from models.layers import common

    kept = common._cos_sin
    common._cos_sin = common.traced_cos_sin
    return lambda: setattr(common, "_cos_sin", kept)


BEFORE = {"rotary tables": traced_rotary_tables}


@contextlib.contextmanager
def before(names):
    """The earlier form of each change in `names` put back inside the block."""
    undo = [BEFORE[n]() for n in names]
    try:
        yield
    finally:
        for u in reversed(undo):
            u()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__)
    p.add_argument("--family", default="llama")
    p.add_argument("--size", default="realistic", choices=("small", "realistic"))
    p.add_argument("--rounds", type=cli.count, default=5)
    p.add_argument("--changes", type=cli.names, default=list(BEFORE),
                   help=f"which changes 'before' undoes, of {','.join(BEFORE)}")  # fmt: skip
    args = p.parse_args(argv)
    if unknown := [n for n in args.changes if n not in BEFORE]:
        p.error(f"--changes: no change named {unknown[0]!r} (known: {', '.join(BEFORE)})")
    notes = fair.single_threaded()
    from benchmarks import step_movement, train_vs_torch

    size = train_vs_torch.SIZES[args.size]
    if args.family not in (known := train_vs_torch.families(size)):
        p.error(f"--family: no family {args.family!r} (known: {', '.join(sorted(known))})")
    ids, model, loaded, batch, decodes = train_vs_torch.case(args.family, size)
    steps, losses = {}, {}
    for name, undo in (("before", args.changes), ("after", ())):
        with before(undo):
            compiled, state, _ = step_movement.compiled_step(loaded, batch, ids[:, 1:], {})
        steps[name], losses[name] = step_movement.timed(compiled, state)
    times = step_movement.against_torch(model, ids, decodes, steps, losses, args.rounds)
    print(f"{args.family}'s training step, {size}; changes: {', '.join(args.changes)}; {notes}")
    rows = {n: {"namedmesh": ts, "PyTorch eager": times["torch"]} for n, ts in times.items()
            if n != "torch"}  # fmt: skip
    print("\n".join(fair.table(rows, "build", unit="s")))
    print(f"after / before: {fair.ratio(times['after'], times['before'])}")
    return {"times": times, "losses": losses}


if __name__ == "__main__":
    sys.exit(cli.run(main))
