"""`python -m benchmarks.step_memory`: the planner's memory of a whole training step
(lowering/train_step.py: parameters, gradients, AdamW's moments, the accumulator,
remat's saved activations) against XLA's `memory_analysis` of the trainer's compiled,
state-donating step (models/training/trainer.py: loss, gradients, clipping, AdamW, the finite
guard) on 8 simulated CPU devices, across layouts, remat policies, accumulation and the
layer stack as one loop or unrolled (Config.scan_layers "auto" unrolls it without remat).
Goal: within 15%.
`--cases random --seed N -n K`: K cases drawn outside that table (other families,
meshes, layouts, bfloat16, attention kernels, accumulation), each also checking the
estimate's parameters and optimizer parts against the trainer's state bytes."""

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
    cfg = catalog_config(config_name, remat=remat, **changes)
    est, xla, _ = measure_step(cfg, SIZES, layout, grad_accum)
    return est.total, xla


def catalog_config(name: str, **changes):
    from models import catalog

    return catalog.get(name, **changes)


def measure_step(cfg, sizes: dict, layout: str, grad_accum: int):
    """(the StepMemory estimate, XLA's bytes, the real state's bytes per device by part)
    of one training step of the LM `cfg` on a mesh of `sizes`; the state's parts are
    counted from the trainer's own pytrees (device 0's shard of each leaf)."""
    import jax
    import numpy as np

    from lowering import Layout, Mesh
    from lowering.train_step import Training, step_memory
    from models import transformer, zoo
    from models.training import trainer

    mesh = Mesh(sizes)
    # shared: one table of layouts for every family (heads or kv_heads; experts or none)
    layout = Layout(layout, shared=True)
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
    xla = xla_bytes(lowered.compile(compiler_options=NOT_RUN))
    real = {"parameters": device_bytes(state["params"]), "optimizer": device_bytes(state["opt"])}
    return est, xla, real


def measure_forward(cfg, sizes: dict, layout: str) -> tuple[int, int]:
    """(the estimate, XLA's bytes) per device of the forward pass of one training step
    of the LM `cfg`: the inputs and `Report.forward_memory` (lowering.memory's forward
    walk) against XLA's memory_analysis of jax.vjp's forward of the trainer's lowered
    loss, its residuals (what the backward pass reads) the program's outputs."""
    import jax
    import numpy as np

    from lowering import Layout, Mesh
    from models import transformer, zoo
    from models.training import trainer

    mesh = Mesh(sizes)
    opt, _ = trainer.optimizer(trainer.OptimizerSpec("adamw", 1e-3, 10, 1, 1.0))
    tr = trainer.Trainer(zoo.get("lm"), cfg, mesh, Layout(layout, shared=True),
                         trainer.TrainSpec(opt, 0, 1))  # fmt: skip
    rep = tr.report()
    zeros = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype),
                                   transformer.abstract(tr.shapes))  # fmt: skip
    params = tr.init_state(zeros)["params"]
    rows = {k: np.zeros((cfg.batch, cfg.length), "int32") for k in ("inputs", "targets")}
    rows["weights"] = rows["inputs"].astype("float32")
    batch, key = tr.place_batch(rows), tr.key(1)
    forward = lambda p, b: jax.vjp(lambda p: tr.lowered(p, b, key), p)[1]  # noqa: E731
    compiled = jax.jit(forward).lower(params, batch).compile(compiler_options=NOT_RUN)
    return rep.memory_parts["inputs"] + rep.forward_memory, xla_bytes(compiled)


def device_bytes(tree) -> int:
    """Bytes on device 0 of a pytree's arrays (none where device 0 holds nothing),
    less its scalars: optax's step counters (AdamW's and its schedule's, 8 bytes),
    which the estimate leaves out."""
    import jax

    total = 0
    for leaf in jax.tree_util.tree_leaves(getattr(tree, "data", tree)):
        leaf = getattr(leaf, "data", leaf)
        if not leaf.ndim:
            continue
        shards = [s for s in leaf.addressable_shards if s.device == jax.devices()[0]]
        total += sum(s.data.nbytes for s in shards)
    return total


def table() -> list[list[str]]:
    out = []
    for name, layout, remat, accum, scan in CASES:
        est, xla = measure(layout, remat, accum, scan_layers=scan)
        layers = "loop" if scan is True or remat != "none" else "unrolled"
        out.append([name, f"`{layout}`", remat, str(accum), layers, f"{est / 2**20:.2f}",
                    f"{xla / 2**20:.2f}", f"{est / xla:.2f}"])  # fmt: skip
    return out


def deepseek_parts():
    from models.families.deepseek_v3 import GroupRouting

    return GroupRouting(expert_groups=2, topk_groups=1, router_scale=2.5)


def latent():
    from models.layers.latent import Latent

    return Latent(kv_rank=32, nope=16, v=16, q_rank=48)


# tiny models of other families: (catalog name, the sizes changed)
SMALL = dict(vocab=256, d_model=64, heads=4, d_kv=16, d_ff=128, layers=2, length=32, batch=32)
FAMILIES = {
    "gpt": ("tiny", SMALL),
    "llama (GQA)": ("llama3-8b", dict(SMALL, kv_heads=2)),
    "gemma 2 (soft-caps)": ("gemma-2-2b", dict(SMALL, kv_heads=2, sliding_window=16,
                                               sliding_layers=(True, False))),
    "mixtral (MoE)": ("mixtral-8x7b", dict(SMALL, kv_heads=2, experts=4, experts_per_token=2)),
    "qwen3-moe": ("qwen3-30b-a3b", dict(SMALL, kv_heads=2, experts=4, experts_per_token=2,
                                        expert_ff=64)),
    "deepseek-v3 (MLA)": ("deepseek-v3", dict(
        SMALL, layers=3, dense_layers=1, experts=4, experts_per_token=2, expert_ff=64,
        shared_ff=64)),
}  # fmt: skip
MESHES = ({"data": 8}, {"data": 2, "model": 4}, {"data": 4, "model": 2},
          {"data": 2, "fsdp": 2, "model": 2})  # fmt: skip


def layouts(sizes: dict) -> dict[str, str]:
    """Named layouts on a mesh: the last axis is the model axis where there are two or more."""
    names = list(sizes)
    everything = ",".join(names)
    if len(names) == 1:
        return {
            "data parallel": f"batch:{everything}",
            "FSDP": f"batch:{everything};d_model:{everything}",
        }
    data, model = ",".join(names[:-1]), names[-1]
    return {
        "data parallel": f"batch:{everything}",
        "Megatron": f"batch:{data};heads:{model};kv_heads:{model};d_ff:{model};vocab:{model}",
        "FSDP": f"batch:{everything};d_model:{everything}",
        "FSDP x TP": f"batch:{data};d_model:{data};heads:{model};kv_heads:{model};d_ff:{model}",
        "sequence parallel": f"batch:{data};length:{model}",
        "experts split": f"batch:{data};experts:{model}",
        "vocab split": f"batch:{data};vocab:{model}",
    }


def random_cases(seed: int, n: int):
    """`n` cases drawn by `seed`: (family, sizes, layout name, rules, config changes, accum)."""
    import random

    rng = random.Random(seed)
    for _ in range(n):
        family = rng.choice(list(FAMILIES))
        sizes = rng.choice(MESHES)
        name, rules = rng.choice(list(layouts(sizes).items()))
        changes = dict(remat=rng.choice(("none", "dots", "full")),
                       dtype=rng.choice(("float32", "bfloat16")),
                       attention=rng.choice(("full", "blockwise")), attention_block=16,
                       scan_layers=rng.choice((True, "auto")))  # fmt: skip
        if rng.random() < 0.3:  # uneven: the vocabulary and the FFN split with a remainder
            changes |= dict(vocab=250, d_ff=120)
        yield family, sizes, name, rules, changes, rng.choice((1, 2, 4))


def random_table(seed: int, n: int):
    """Rows of `random_cases`: the estimate against XLA, and the state's parts exactly."""
    from namedmesh.errors import NamedMeshError

    for family, sizes, name, rules, changes, accum in random_cases(seed, n):
        base, own = FAMILIES[family]
        if base == "deepseek-v3":  # its records, made here: importing them imports jax
            own = own | dict(parts=deepseek_parts(), mla=latent())
        cfg = catalog_config(base, **(own | changes))
        mesh = "x".join(str(v) for v in sizes.values())
        try:
            est, xla, real = measure_step(cfg, sizes, rules, accum)
        except NamedMeshError as err:  # a typed refusal (a split that does not divide)
            yield [family, mesh, f"{name} `{rules}`", "", str(accum), "", "", "", "", str(err)]
            continue
        settings = f"{changes['remat']} {changes['dtype']} {changes['attention']} " + (
            "loop" if changes["scan_layers"] is True else "auto"
        )
        got = (est.parameters, est.optimizer)
        want = (real["parameters"], real["optimizer"])
        exact = "yes" if got == want else f"no: (parameters, optimizer) {got} != {want}"
        dims = "uneven" if "vocab" in changes else ""
        mib = [f"{est.total / 2**20:.2f}", f"{xla / 2**20:.2f}", f"{est.total / xla:.2f}"]
        yield [family, mesh, f"{name} `{rules}`", settings, str(accum), dims, *mib, exact]


if __name__ == "__main__":
    import argparse
    import sys

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", choices=("table", "random"), default="table")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-n", type=int, default=12)
    args = ap.parse_args()
    if args.cases == "random":
        head = [
            "family",
            "mesh",
            "layout",
            "remat dtype attention layers",
            "grad accum",
            "dims",
            "estimate MiB",
            "XLA MiB",
            "ratio",
            "parts exact",
        ]
        rows = random_table(args.seed, args.n)
    else:
        head = [
            "layout",
            "rules",
            "remat",
            "grad accum",
            "layers",
            "estimate MiB",
            "XLA MiB",
            "ratio",
        ]
        rows = table()
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |", flush=True)
        sys.stdout.flush()
