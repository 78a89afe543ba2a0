"""`make demo`: train the `tiny` LM on 8 simulated CPU devices under a 2D layout (batch
over rows, heads and d_ff over cols), then continue a prompt with it.

Prints the mesh, the layout and the lowering report, shows the loss fall, writes
runs/demo/loss.png and prints a generated sample. A previous demo run in runs/demo is
replaced; other runs are left alone.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys

PROMPT = "The assert statement"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m models.cli.demo", description=__doc__.split("\n")[0]
    )
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--out", default="runs/demo")
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    from models.cli import generate, train

    every = str(max(args.steps // 8, 1))
    flags = [
        "--model", "lm", "--config", "tiny", "--mesh", "rows=2,cols=4",
        "--layout", "batch:rows;d_ff:cols;heads:cols", "--steps", str(args.steps),
        "--eval-every", every, "--save-every", str(max(args.steps // 4, 1)), "--out", args.out,
    ]  # fmt: skip
    if os.path.exists(args.out):
        print(f"replacing the previous demo run in {args.out}")
        shutil.rmtree(args.out)
    print("$ namedmesh train " + shlex.join(flags), flush=True)
    if rc := train.main(flags, prog="namedmesh train"):
        return rc
    for mode in ("greedy", "sample"):
        gen = [args.out, "--prompt", PROMPT, "--mode", mode, "--max-new", "200"]
        print(f"\n$ namedmesh generate {shlex.join(gen)}", flush=True)
        if rc := generate.main(gen, prog="namedmesh generate"):
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
