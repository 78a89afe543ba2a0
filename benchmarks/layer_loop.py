"""The layer stack as one loop or unrolled, by depth and size: the measurements behind
nm.scan's unroll="auto" (Config.scan_layers="auto", namedmesh.control.UNROLL_BUDGET):

    python -m benchmarks.layer_loop --sizes small,realistic --layers 2,4,8,16 --rounds 3

For each size (SIZES: the zoo's Llama of benchmarks/zoo_families.py) and depth, the
training step (forward, backward, AdamW: benchmarks/step_movement.py's) compiled with
the layers in one loop (scan_layers=True) and unrolled (False), each compile's CPU
seconds, the unrolled program's jax equations (the layers times the body's, the measure
the rule reads) and what "auto" picks; then the two steps timed by
benchmarks/fair.py's method (one thread, CPU time, alternated) after checking their
first losses equal. Prints one markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import numpy as np

from benchmarks import cli, fair, step_movement, zoo_families
from namedmesh import control

# name -> (d_model, heads, vocab, length, batch): the small and realistic sizes
SIZES = {
    "small": (256, 4, 1024, 128, 4),
    "realistic": (512, 8, 8192, 512, 4),
}


def program_size(loaded, batch) -> int:
    """The unrolled layer stack's jax equations (layers x the body's), as unroll="auto"
    counts them: control.unrolls's count, read by wrapping it for one trace."""
    seen = []
    real = control.unrolls

    def spy(step, carry, xs, length, unroll, remat="none"):
        body = jax.make_jaxpr(step)(list(carry), [x[0] for x in xs])
        seen.append(length * control.equations(body))
        return real(step, carry, xs, length, unroll, remat)

    control.unrolls = spy
    try:
        config = dataclasses.replace(loaded.config, scan_layers="auto")
        from models.io import hub

        jax.eval_shape(lambda p: hub.forward(p, batch, config, loaded.family).data, loaded.params)
    finally:
        control.unrolls = real
    return max(seen)


def measure(size: str, layers: int, rounds: int) -> list[str]:
    """One row's cells."""
    d, heads, vocab, length, b = SIZES[size]
    spec = zoo_families.configs(layers, d, heads, vocab, length)["llama"]
    ids = np.random.default_rng(0).integers(0, vocab, (b, length + 1)).astype(np.int32)
    _, loaded, batch, _ = zoo_families.built("llama", spec, ids[:, :-1])
    steps, losses, compile_s = {}, {}, {}
    for name, scan in (("loop", True), ("unrolled", False)):
        config = dataclasses.replace(loaded.config, scan_layers=scan)
        start = time.process_time()
        compiled, state, _ = step_movement.compiled_step(
            dataclasses.replace(loaded, config=config), batch, ids[:, 1:], {}
        )
        compile_s[name] = time.process_time() - start
        steps[name], losses[name] = step_movement.timed(compiled, state)
        if (" while(" in compiled.as_text()) != scan:
            raise SystemExit(f"{size}, {layers} layers, {name}: a while loop is {scan=}'s opposite")
    if abs(losses["loop"] - losses["unrolled"]) > 1e-4 * max(1.0, abs(losses["loop"])):
        raise SystemExit(f"{size}, {layers} layers: losses differ {losses}")
    eqns = program_size(loaded, batch)
    t = fair.alternate(steps, rounds)
    return [size, str(layers), str(eqns), "unrolled" if eqns <= control.UNROLL_BUDGET else "loop",
            f"{compile_s['loop']:.1f}", f"{compile_s['unrolled']:.1f}",
            fair.cell(t["loop"], 1), fair.cell(t["unrolled"], 1),
            fair.ratio(t["unrolled"], t["loop"])]  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__)
    p.add_argument("--sizes", type=cli.names, default=["small", "realistic"])
    p.add_argument("--layers", type=cli.counts, default=[2, 4, 8, 16])
    p.add_argument("--rounds", type=cli.count, default=3)
    args = p.parse_args(argv)
    if unknown := sorted(set(args.sizes) - set(SIZES)):
        p.error(f"--sizes: unknown {unknown}; known: {', '.join(SIZES)}")
    threads = fair.single_threaded()
    before = fair.load()
    head = ["size", "layers", "unrolled eqns", "auto picks", "loop compile s",
            "unrolled compile s", "loop step s", "unrolled step s", "unrolled / loop"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size in args.sizes:
        for layers in args.layers:
            lines.append("| " + " | ".join(measure(size, layers, args.rounds)) + " |")
            print(lines[-1], flush=True)
    print(fair.METHOD.format(flags=fair.XLA_SINGLE_THREAD, rounds=args.rounds, before=before,
                             after=fair.load()) + f" ({threads})")  # fmt: skip
    print("\n".join(lines))
    return {"lines": lines}


if __name__ == "__main__":
    sys.exit(cli.run(main))
