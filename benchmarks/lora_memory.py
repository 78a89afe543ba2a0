"""`python -m benchmarks.lora_memory [--config small] [--rank 8]`: the memory of a LoRA
fine-tune's training step against a full fine-tune's, on one CPU device: trainable
parameters, the optimizer's state (AdamW's moments, as init_state lays them out) and
XLA's `memory_analysis` of the trainer's compiled, state-donating step (arguments +
outputs + temporaries - aliased outputs), with its arguments and temporaries apart.
Prints a Markdown table."""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks import cli

TARGETS = ("q", "k", "v", "o", "up", "down")  # every projection of the zoo's (ungated) LM


def measure(config_name: str, rank: int | None) -> dict:
    """Sizes of one training step of the LM `config_name`: full (rank None) or LoRA."""
    import jax

    from benchmarks.step_memory import xla_bytes
    from lowering import Mesh
    from models import catalog, zoo
    from models.layers import lora
    from models.training import trainable, trainer

    cfg = catalog.get(config_name)
    model, trained = zoo.get("lm"), None
    if rank:
        model = lora.adapted(model, lora.Lora(rank, 2.0 * rank, 0.0, TARGETS), cfg)
        trained = trainable.chooser(trainable.paths(model.shapes(cfg)), (), lora.is_adapter)
    opt, _ = trainer.optimizer(trainer.OptimizerSpec("adamw", 1e-4, 10, 0, 1.0))
    tr = trainer.Trainer(model, cfg, Mesh({"data": 1}), "", trainer.TrainSpec(opt, 0, 1, trained))
    state = tr.init_state()
    count = lambda tree: sum(x.size for x in jax.tree_util.tree_leaves(tree))
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))
    rows = {k: np.zeros((cfg.batch, cfg.length), np.int32) for k in ("inputs", "targets")}
    rows["weights"] = rows["inputs"].astype(np.float32)
    step = jax.jit(tr._guarded_update, donate_argnums=(0,))  # the step `update` compiles
    compiled = step.lower(state, tr.place_batch(rows), tr.key(1)).compile()
    m = compiled.memory_analysis()
    return {
        "params": count(state["params"]),
        "trained": count(trainable.split(state["params"], trained)[0]),
        "opt": nbytes(state["opt"]),
        "peak": xla_bytes(compiled),
        "args": m.argument_size_in_bytes,
        "temp": m.temp_size_in_bytes,
    }


def table(config_name: str, rank: int) -> str:
    mib = lambda b: f"{b / 2**20:.2f}"
    lines = [
        "| run | parameters | trained | AdamW state MiB | step peak MiB | arguments MiB | "
        "temporaries MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in (("full fine-tune", None), (f"LoRA r={rank} ({','.join(TARGETS)})", rank)):
        s = measure(config_name, r)
        lines.append(
            f"| {name} | {s['params']:,} | {s['trained']:,} | {mib(s['opt'])} | "
            f"{mib(s['peak'])} | {mib(s['args'])} | {mib(s['temp'])} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__.split("\n")[0])
    p.add_argument("--config", default="small")
    p.add_argument("--rank", type=int, default=8)
    args = p.parse_args(argv)
    print(table(args.config, args.rank))


if __name__ == "__main__":
    main()
