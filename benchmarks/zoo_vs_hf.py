"""The zoo against transformers on one CPU device: a GPT-2-architecture model loaded into
the zoo from the folder transformers wrote, then the forward pass and a full training
step (forward, backward, AdamW) of namedmesh's jitted program against PyTorch's, eager
and under `torch.compile`, all single-threaded, timed by CPU time and alternated in one
process (benchmarks/fair.py).

    python -m benchmarks.zoo_vs_hf --layers 4 --d-model 256 --heads 4 --length 128 \\
        --batch 4 --repeats 7

Prints one markdown table (milliseconds, min / median of the rounds, and the ratios zoo /
PyTorch) and the first training loss of each, which must agree (the same weights and
batch).

With `--families` (all of models/families/, or a comma-separated list) it times instead
each family's model at those sizes with its options (benchmarks/zoo_families.py): the
forward pass and a training step against transformers' eager PyTorch and
`torch.compile`, logits and first losses checked equal:

    python -m benchmarks.zoo_vs_hf --families --layers 2 --d-model 256 --heads 8 \\
        --vocab 8192 --length 128 --batch 4 --repeats 7

`--size small` or `--size realistic` sets those five sizes to issue 40's (benchmarks/
train_vs_torch.py's SIZES: realistic is 4 layers, d_model 512, 8 heads, vocab 8192,
batch 4 x 512). With `--families` the run first measures the machine's single-thread
matmul peak (benchmarks/peak.py) and the step's table gives each side's compile time
and, both tables, the matmul flops and each side's fraction of the peak; a line names
the CPU and both sides' math libraries (benchmarks/stack.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import jax
import numpy as np
import optax

import namedmesh as nm
from benchmarks import cli, fair, peak, stack, zoo_families
from models import transformer
from models.io import hub


def torch_side(args, folder, ids, targets):
    """{"PyTorch eager": (forward, step), "torch.compile": (forward, step)} on the torch
    tensors `ids` and `targets`: the same model (and optimizer) either way, saved to
    `folder` first."""
    import torch
    import transformers

    cfg = transformers.GPT2Config(
        n_embd=args.d_model, n_layer=args.layers, n_head=args.heads, vocab_size=args.vocab,
        n_positions=args.length, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.save_pretrained(folder)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    logits = lambda ids: model(ids).logits

    def loss_of(ids, targets):
        return torch.nn.functional.cross_entropy(logits(ids).flatten(0, 1), targets.flatten())

    sides = {"PyTorch eager": zoo_families.torch_pair(opt, logits, loss_of, ids, targets)}
    if args.compile:
        compiled = torch.compile(logits), torch.compile(loss_of)
        sides["torch.compile"] = zoo_families.torch_pair(opt, *compiled, ids, targets)
    return sides


def zoo_side(folder):
    model = hub.load(folder)
    cfg = model.config
    opt = optax.adamw(1e-4, weight_decay=0.01)
    loss = lambda p, b: transformer.lm_loss(p, b, cfg).data

    @jax.jit
    def step(state, batch):
        value, grads = jax.value_and_grad(loss)(state["params"], batch)
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, value

    forward = jax.jit(lambda p, t: transformer.lm_logits(p, t, cfg).data)
    return model.params, forward, step, {"params": model.params, "opt": opt.init(model.params)}


# the size flags `--size` sets, by their argparse field (benchmarks/train_vs_torch.py's Size)
SIZE_FLAGS = {"layers": "--layers", "d_model": "--d-model", "heads": "--heads",
              "vocab": "--vocab", "length": "--length", "batch": "--batch"}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__)
    p.add_argument("--layers", type=cli.count, default=4)
    p.add_argument("--d-model", type=cli.count, default=256)
    p.add_argument("--heads", type=cli.count, default=4)
    p.add_argument("--vocab", type=cli.count, default=50257)
    p.add_argument("--length", type=cli.count, default=128)
    p.add_argument("--batch", type=cli.count, default=4)
    p.add_argument("--repeats", type=cli.count, default=7, help="timed rounds")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="also time PyTorch under torch.compile")  # fmt: skip
    p.add_argument("--families", nargs="?", const="all", default=None, metavar="NAMES",
                   help="time each family's model instead (all, or a list)")  # fmt: skip
    p.add_argument("--size", choices=("small", "realistic"), default=None,
                   help="issue 40's sizes (train_vs_torch.py's) for the six above")  # fmt: skip
    return p


def sized(p: argparse.ArgumentParser, args) -> None:
    """Set the sizes of `args.size`, refusing a size flag given beside it."""
    from benchmarks.train_vs_torch import SIZES

    size = SIZES[args.size]
    for field, flag in SIZE_FLAGS.items():
        if getattr(args, field) != p.get_default(field):
            p.error(f"--size {args.size} sets {flag}; give one or the other")
        setattr(args, field, getattr(size, field))


def main(argv=None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    if args.size:
        sized(p, args)
    threads = fair.single_threaded()  # before jax's first computation
    if args.families is not None:
        names = list(hub.FAMILIES) if args.families == "all" else args.families.split(",")
        if unknown := [n for n in names if n not in hub.FAMILIES]:
            p.error(f"--families: unknown {unknown}; known: {', '.join(hub.FAMILIES)}")
        return families(args, names, threads)
    import torch

    rng = np.random.default_rng(0)
    ids = rng.integers(0, args.vocab, (args.batch, args.length + 1)).astype(np.int32)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    t_ids, t_targets = torch.tensor(inputs).long(), torch.tensor(targets).long()
    folder = tempfile.mkdtemp()
    t_sides = torch_side(args, folder, t_ids, t_targets)
    params, z_forward, z_step, state = zoo_side(folder)

    tokens = nm.tensor(inputs, ("batch", "length"))
    batch = {
        "inputs": tokens,
        "targets": nm.tensor(targets, ("batch", "length")),
        "weights": nm.tensor(np.ones(inputs.shape, np.float32), ("batch", "length")),
    }
    # Warm up (compile) and check that both sides train the same model on the same batch.
    z_forward(params, tokens).block_until_ready()
    state, z_loss = z_step(state, batch)
    t_loss = t_sides["PyTorch eager"][1]()
    failed = {}
    for name, (forward, step) in list(t_sides.items())[1:]:
        try:
            forward(), step()
        except Exception as e:  # a compiler missing on this machine: say so in the row
            failed[name] = fair.why_not(e)
            del t_sides[name]

    def zoo_step():
        nonlocal state
        state, loss = z_step(state, batch)
        loss.block_until_ready()

    before = fair.load()
    fwd = fair.alternate(
        {"namedmesh": lambda: z_forward(params, tokens).block_until_ready()}
        | {name: f for name, (f, _) in t_sides.items()},
        args.repeats,
    )
    step = fair.alternate(
        {"namedmesh": zoo_step} | {name: s for name, (_, s) in t_sides.items()},
        args.repeats,
    )
    header("GPT-2 architecture", args, threads, before, fair.load())
    print(f"first training loss: zoo {float(z_loss):.5f}, PyTorch {t_loss:.5f}")
    print(table({"forward": fwd, "training step (fwd, bwd, AdamW)": step}, failed))
    return {"forward": fwd, "step": step, "losses": (float(z_loss), t_loss), "failed": failed}


def families(args, names: list[str], threads: str) -> dict:
    """Each family's rows, after the machine's matmul peak; prints the tables."""
    before = fair.load()
    peak_gflops = peak.matmul_peak()
    print(f"matmul peak: {peak_gflops}", flush=True)
    results = zoo_families.run(args, names, peak_gflops["peak"])
    header("Each family's forward pass and training step", args, threads, before, fair.load())
    best = max(("PyTorch", "XLA"), key=peak_gflops.get)
    print(f"Single-thread fp32 {peak.PEAK_SIZE}^3 matmul: PyTorch {peak_gflops['PyTorch']:.0f} "
          f"GFLOP/s, XLA {peak_gflops['XLA']:.0f} GFLOP/s; % of peak is against {best}'s. "
          f"{stack.describe()}")  # fmt: skip
    print(zoo_families.table(results, peak_gflops["peak"]))
    return results


def header(what: str, args, threads: str, before, after) -> None:
    """The run's sizes, devices and threads, then the timing method with the load."""
    print(
        f"{what}: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
        f"vocab {args.vocab}, batch {args.batch} x {args.length} tokens; "
        f"{jax.devices()[0].platform} ({jax.device_count()} device); {threads}"
    )
    print(fair.METHOD.format(flags=fair.XLA_SINGLE_THREAD, rounds=args.repeats,
                             before=before, after=after))  # fmt: skip


def table(rows: dict[str, dict[str, list[float]]], failed: dict[str, str]) -> str:
    """Markdown: per row, namedmesh's ms, then each PyTorch side's ms and the ratio."""
    return "\n".join(fair.table(rows, failed={what: failed for what in rows}))


if __name__ == "__main__":
    sys.exit(cli.run(main))
