"""`python -m benchmarks.step_memory`: the planner's memory of a whole training step
(lowering/train_step.py: parameters, gradients, AdamW's moments, the accumulator,
remat's saved activations) against XLA's `memory_analysis` of the trainer's compiled,
state-donating step (models/training/trainer.py: loss, gradients, clipping, AdamW, the finite
guard) on 8 simulated CPU devices, across layouts, remat policies, accumulation and the
layer stack as one loop or unrolled (Config.scan_layers "auto" unrolls it without remat).
Goal: within 15%."""

from __future__ import annotations

import os

SIZES = {"data": 2, "model": 4}
MEGATRON = "batch:data;heads:model;d_ff:model;vocab:model"
# (name, layout, remat, grad_accum, scan_layers): "auto" is the default, which unrolls
# the stack without remat and keeps a loop with it; True, the loop
CASES = (
    ("data parallel", "batch:data,model", "none", 1, True),
    ("data parallel", "batch:data,model", "none", 1, "auto"),
    ("data parallel", "batch:data,model", "full", 1, "auto"),
    ("Megatron", MEGATRON, "none", 1, True),
    ("Megatron", MEGATRON, "none", 1, "auto"),
    ("Megatron", MEGATRON, "dots", 1, "auto"),
    ("FSDP", "batch:data,model;d_model:data,model", "full", 1, "auto"),
    ("Megatron, accumulated", MEGATRON, "none", 2, True),
    ("Megatron, accumulated", MEGATRON, "none", 2, "auto"),
)

# a step compiled only for its memory_analysis, never run: LLVM's optimisation of its
# kernels changes no buffer XLA assigns (the same bytes) and takes half the compile
NOT_RUN = {"xla_backend_optimization_level": 0}


def xla_bytes(compiled) -> int:
    """Per-device peak of XLA's memory analysis: arguments + outputs + temporaries, less
    the outputs that reuse (donated) argument buffers."""
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)  # fmt: skip


def measure(layout: str, remat: str, grad_accum: int, config_name: str = "small",
            **changes) -> tuple[int, int]:  # fmt: skip
    """(the estimate, XLA's bytes) per device of one training step of the LM."""
    import jax
    import numpy as np

    from lowering import Mesh
    from lowering.train_step import Training, step_memory
    from models import catalog, transformer, zoo
    from models.training import trainer

    cfg = catalog.get(config_name, remat=remat, **changes)
    mesh = Mesh(SIZES)
    opt, _ = trainer.optimizer(trainer.OptimizerSpec("adamw", 1e-3, 10, 1, 1.0))
    tr = trainer.Trainer(zoo.get("lm"), cfg, mesh, layout, trainer.TrainSpec(opt, 0, grad_accum))
    data_axes = dict(tr.layout.rules).get("batch", ())
    est = step_memory(tr.report(), mesh.sizes, data_axes, Training("adamw", grad_accum=grad_accum))
    # zeros: XLA's memory does not depend on the values, and drawing them compiles a
    # program per parameter shape (most of a tiny model's measure)
    zeros = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype),
                                   transformer.abstract(tr.shapes))  # fmt: skip
    state = tr.init_state(zeros)  # the moments laid out as their parameters
    rows = {k: np.zeros((cfg.batch, cfg.length), "int32") for k in ("inputs", "targets")}
    rows["weights"] = rows["inputs"].astype("float32")
    step = jax.jit(tr._guarded_update, donate_argnums=(0,))
    lowered = step.lower(state, tr.place_batch(rows), tr.key(1))
    return est.total, xla_bytes(lowered.compile(compiler_options=NOT_RUN))


def table() -> list[list[str]]:
    out = []
    for name, layout, remat, accum, scan in CASES:
        est, xla = measure(layout, remat, accum, scan_layers=scan)
        layers = "loop" if scan is True or remat != "none" else "unrolled"
        out.append([name, f"`{layout}`", remat, str(accum), layers, f"{est / 2**20:.2f}",
                    f"{xla / 2**20:.2f}", f"{est / xla:.2f}"])  # fmt: skip
    return out


if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    head = ["layout", "rules", "remat", "grad accum", "layers", "estimate MiB", "XLA MiB", "ratio"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in table():
        print("| " + " | ".join(row) + " |")
