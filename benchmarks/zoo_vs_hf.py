"""The zoo against transformers on one CPU device: a GPT-2-architecture model loaded into
the zoo from the folder transformers wrote, then the forward pass and a full training
step (forward, backward, AdamW) timed for namedmesh's jitted program and for PyTorch,
interleaved, median of repeats.

    python -m benchmarks.zoo_vs_hf --layers 4 --d-model 256 --heads 4 --length 128 \\
        --batch 4 --repeats 7

Prints one markdown table (milliseconds and the ratio zoo / PyTorch) and the first
training loss of each, which must agree (the same weights and batch).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import numpy as np
import optax

import namedmesh as nm
from models import hub, transformer


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def torch_side(args, folder):
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

    def forward(ids):
        with torch.no_grad():
            return model(ids).logits

    def step(ids, targets):
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return forward, step


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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.zoo_vs_hf", description=__doc__)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    import torch

    folder = tempfile.mkdtemp()
    t_forward, t_step = torch_side(args, folder)
    params, z_forward, z_step, state = zoo_side(folder)

    rng = np.random.default_rng(0)
    ids = rng.integers(0, args.vocab, (args.batch, args.length + 1)).astype(np.int32)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    t_ids, t_targets = torch.tensor(inputs).long(), torch.tensor(targets).long()
    tokens = nm.tensor(inputs, ("batch", "length"))
    batch = {
        "inputs": tokens,
        "targets": nm.tensor(targets, ("batch", "length")),
        "weights": nm.tensor(np.ones(inputs.shape, np.float32), ("batch", "length")),
    }
    # Warm up (compile) and check that both sides train the same model on the same batch.
    z_forward(params, tokens).block_until_ready()
    state, z_loss = z_step(state, batch)
    t_loss = t_step(t_ids, t_targets)
    t_forward(t_ids)

    times = {k: [] for k in ("zoo forward", "torch forward", "zoo step", "torch step")}
    for _ in range(args.repeats):  # interleaved, so drifts in machine load hit both
        times["zoo forward"].append(timed(lambda: z_forward(params, tokens).block_until_ready()))
        times["torch forward"].append(timed(lambda: t_forward(t_ids)))
        start = time.perf_counter()
        state, loss = z_step(state, batch)
        loss.block_until_ready()
        times["zoo step"].append(time.perf_counter() - start)
        times["torch step"].append(timed(lambda: t_step(t_ids, t_targets)))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(
        f"GPT-2 architecture: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
        f"vocab {args.vocab}, batch {args.batch} x {args.length} tokens; "
        f"{jax.devices()[0].platform} ({jax.device_count()} device), torch threads "
        f"{torch.get_num_threads()}; median of {args.repeats}"
    )
    print(f"first training loss: zoo {float(z_loss):.5f}, PyTorch {t_loss:.5f}")
    print("| | namedmesh (ms) | PyTorch (ms) | namedmesh / PyTorch |")
    print("|---|---|---|---|")
    for what in ("forward", "step"):
        z, t = med[f"zoo {what}"], med[f"torch {what}"]
        name = "forward" if what == "forward" else "training step (fwd, bwd, AdamW)"
        print(f"| {name} | {z:.1f} | {t:.1f} | {z / t:.2f} |")


if __name__ == "__main__":
    main()
