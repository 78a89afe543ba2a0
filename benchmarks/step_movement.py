"""Where a zoo family's training step moves data: the compiled step (forward, backward,
AdamW: benchmarks/zoo_families.py's) read by `lowering.hlo.movement`, per setting
(`SETTINGS`: the layer stack as one loop or unrolled, keeping every residual or only
the matmuls' outputs; XLA:CPU's dots by its default YNNPACK kernels or by Eigen, a
compile option), with the compile time:

    python -m benchmarks.step_movement --family llama --layers 4 --d-model 512 \\
        --heads 8 --vocab 8192 --length 512 --batch 4 --time 7

Prints one markdown table: per setting, the instructions and MB of each kind of data
movement (fill, stack, unstack, transpose, copy; a loop's counted per iteration) and
the seconds XLA took to compile the step (structural: a loaded machine does not change
the movement). With `--time ROUNDS`, also each setting's step against transformers'
PyTorch eager step on the same model and batch, by benchmarks/fair.py's method
(single-threaded, CPU time, alternated), after checking the first losses equal.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import numpy as np
import optax

from benchmarks import cli, fair, zoo_families
from lowering.hlo import MOVEMENT_KINDS, movement
from models.io import hub

# setting -> (Config fields, XLA compile options); "" turns XLA:CPU's YNNPACK fusions off
EIGEN_DOTS = {"xla_cpu_experimental_ynn_fusion_type": ""}
SETTINGS = {
    "layer loop": ({"scan_layers": True}, {}),
    "unrolled layers": ({"scan_layers": False}, {}),
    "layer loop, Eigen dots": ({"scan_layers": True}, EIGEN_DOTS),
    # the backward pass recomputes what is not a matmul's output (nm.scan's remat)
    "layer loop, remat dots": ({"scan_layers": True, "remat": "dots"}, {}),
    "unrolled, remat dots": ({"scan_layers": False, "remat": "dots"}, {}),
}


def compiled_step(loaded, batch: dict, targets: np.ndarray, options: dict):
    """(the compiled training step of `loaded` on `batch`, its first state, seconds to
    compile it): the step of zoo_families.zoo_sides, compiled with XLA `options`."""
    cfg, family = loaded.config, loaded.family
    opt = optax.adamw(1e-4, weight_decay=0.01)

    def loss(p):
        logits = hub.forward(p, batch, cfg, family).transpose("batch", "length", "vocab")
        return optax.softmax_cross_entropy_with_integer_labels(logits.data, targets).mean()

    def step(state):
        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, value

    state = {"params": loaded.params, "opt": opt.init(loaded.params)}
    start = time.perf_counter()
    compiled = jax.jit(step).lower(state).compile(compiler_options=options or None)
    return compiled, state, time.perf_counter() - start


def timed(compiled, state):
    """(a call of one training step that blocks until done, the first step's loss)."""
    box = [state]

    def run():
        box[0], value = compiled(box[0])
        value.block_until_ready()
        return float(value)

    return run, run()


def table(rows: dict[str, tuple[dict, float]]) -> list[str]:
    """Markdown lines: per setting, each kind's count and MB, the total MB, compile s."""
    head = ["setting", *(f"{k} n / MB" for k in MOVEMENT_KINDS), "total MB", "compile s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, (moved, seconds) in rows.items():
        cells = [f"{moved[k][0]} / {moved[k][1] / 1e6:.1f}" for k in MOVEMENT_KINDS]
        total = sum(b for _, b in moved.values()) / 1e6
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {total:.0f} | {seconds:.1f} |")
    return lines


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__)
    cli.step_size_flags(p, hub.FAMILIES)
    p.add_argument("--time", type=cli.count, default=None, metavar="ROUNDS",
                   help="also time each setting against PyTorch eager")  # fmt: skip
    args = p.parse_args(argv)
    threads = fair.single_threaded() if args.time else "XLA's default threads"
    spec = zoo_families.configs(args.layers, args.d_model, args.heads, args.vocab,
                                args.length)[args.family]  # fmt: skip
    rng = np.random.default_rng(0)
    ids = rng.integers(0, args.vocab, (args.batch, args.length + 1)).astype(np.int32)
    model, loaded, batch, decodes = zoo_families.built(args.family, spec, ids[:, :-1])
    rows, steps, losses = {}, {}, {}
    for name, (change, options) in SETTINGS.items():
        config = dataclasses.replace(loaded.config, **change)
        compiled, state, seconds = compiled_step(dataclasses.replace(loaded, config=config),
                                                 batch, ids[:, 1:], options)  # fmt: skip
        rows[name] = (movement(compiled.as_text()), seconds)
        if args.time:
            steps[name], losses[name] = timed(compiled, state)
    print(f"{args.family}'s training step: {args.layers} layers, d_model {args.d_model}, "
          f"{args.heads} heads, vocab {args.vocab}, batch {args.batch} x {args.length} "
          f"tokens; jax {jax.__version__}, {jax.devices()[0].platform}; {threads}")  # fmt: skip
    print("\n".join(table(rows)))
    if args.time:
        times = against_torch(model, ids, decodes, steps, losses, args.time)
        print("\n".join(fair.table({name: {"namedmesh": ts, "PyTorch eager": times["torch"]}
                                    for name, ts in times.items() if name != "torch"},
                                   "setting", unit="s")))  # fmt: skip
        return {"movement": rows, "times": times}
    return {"movement": rows}


def against_torch(model, ids, decodes: bool, steps: dict, losses: dict, rounds: int):
    """{setting or "torch": CPU seconds per round}: each compiled step and transformers'
    eager step alternated (benchmarks/fair.py), the first losses checked equal first."""
    sides = zoo_families.torch_sides(model, ids[:, :-1], ids[:, 1:], decodes, compile=False)
    torch_step = sides["PyTorch eager"][1]
    want = torch_step()
    for name, got in losses.items():
        if abs(got - want) > zoo_families.TOLERANCE * max(1.0, abs(want)):
            raise SystemExit(f"{name}: first loss {got} differs from PyTorch's {want}")
    before = fair.load()
    times = fair.alternate({**steps, "torch": torch_step}, rounds)
    print(fair.METHOD.format(flags=fair.XLA_SINGLE_THREAD, rounds=rounds, before=before,
                             after=fair.load()))  # fmt: skip
    return times


if __name__ == "__main__":
    sys.exit(cli.run(main))
