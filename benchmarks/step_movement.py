"""Where a zoo family's training step moves data: the compiled step (forward, backward,
AdamW: benchmarks/zoo_families.py's) read by `lowering.hlo.movement`, per setting of
the layer stack (one loop, or unrolled), with the compile time:

    python -m benchmarks.step_movement --family llama --layers 4 --d-model 512 \\
        --heads 8 --vocab 8192 --length 512 --batch 4

Prints one markdown table: per setting, the instructions and MB of each kind of data
movement (fill, stack, unstack, transpose, copy; a loop's counted per iteration) and
the seconds XLA took to compile the step. Structural, so a loaded machine does not
change it; benchmarks/zoo_vs_hf.py times the same step against PyTorch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import numpy as np
import optax

from benchmarks import cli, zoo_families
from lowering.hlo import MOVEMENT_KINDS, movement
from models import hub

SETTINGS = {"layer loop": {"scan_layers": True}, "unrolled layers": {"scan_layers": False}}


def compiled_step(loaded, batch: dict, targets: np.ndarray):
    """(the compiled training step of `loaded` on `batch`, seconds to compile it): the
    step of zoo_families.zoo_sides."""
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
    compiled = jax.jit(step).lower(state).compile()
    return compiled, time.perf_counter() - start


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
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_movement", description=__doc__)
    p.add_argument("--family", default="llama", choices=sorted(hub.FAMILIES))
    p.add_argument("--layers", type=cli.count, default=4)
    p.add_argument("--d-model", type=cli.count, default=512)
    p.add_argument("--heads", type=cli.count, default=8)
    p.add_argument("--vocab", type=cli.count, default=8192)
    p.add_argument("--length", type=cli.count, default=512)
    p.add_argument("--batch", type=cli.count, default=4)
    args = p.parse_args(argv)
    spec = zoo_families.configs(args.layers, args.d_model, args.heads, args.vocab,
                                args.length)[args.family]  # fmt: skip
    rng = np.random.default_rng(0)
    ids = rng.integers(0, args.vocab, (args.batch, args.length + 1)).astype(np.int32)
    _, loaded, batch, _ = zoo_families.built(args.family, spec, ids[:, :-1])
    rows = {}
    for name, change in SETTINGS.items():
        config = dataclasses.replace(loaded.config, **change)
        compiled, seconds = compiled_step(dataclasses.replace(loaded, config=config), batch,
                                          ids[:, 1:])  # fmt: skip
        rows[name] = (movement(compiled.as_text()), seconds)
    print(f"{args.family}'s training step: {args.layers} layers, d_model {args.d_model}, "
          f"{args.heads} heads, vocab {args.vocab}, batch {args.batch} x {args.length} "
          f"tokens; jax {jax.__version__}, {jax.devices()[0].platform}")  # fmt: skip
    print("\n".join(table(rows)))
    return rows


if __name__ == "__main__":
    sys.exit(cli.run(main))
