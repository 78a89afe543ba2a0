"""The dropless MoE's grouped matmul (`nm.grouped_matmul`'s jax kernel,
namedmesh/grouped.py `grouped_rows`) against PyTorch's loop over the experts
(index_select, matmul, index_add: what transformers' Mixtral and Qwen-MoE blocks run),
timed by the fair method (benchmarks/fair.py: both single-threaded, process time,
alternated), beside the earlier kernel (padded blocks, each multiplied by a gathered
copy of its expert's weight), `jax.lax.ragged_dot` (a dense product over every expert
on XLA:CPU) and one dense matmul of all the rows by one weight (the ideal flops).
Forward and backward of sum(out²) (the rows' and the weights' gradients), and the
forward alone; rows' experts uniform at random, or all but a few rows on one expert.

    python -m benchmarks.grouped_kernel --rows 1024 --d-in 256 --d-out 1024 --experts 8

Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import cli, fair


def gathered_blocks(x, w, g, block: int = 16):
    """The earlier kernel (namedmesh/grouped.py before the loop over experts): rows
    sorted by expert, each expert's rows padded to whole blocks, one batched matmul of
    the blocks against a gathered copy of each block's expert weight, then unsorted."""
    import jax.numpy as jnp

    n, groups = x.shape[0], w.shape[0]
    inside = (g >= 0) & (g < groups)
    key = jnp.where(inside, g, groups)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros(groups + 1, jnp.int32).at[key].add(1)[:groups]
    starts = jnp.cumsum(sizes) - sizes
    padded = (sizes + block - 1) // block * block
    ends = jnp.cumsum(padded)
    rank = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    safe = jnp.where(inside, g, 0)
    blocks = (n + groups * (block - 1)) // block
    dest = jnp.where(inside, ends[safe] - padded[safe] + rank - starts[safe], blocks * block)
    src = jnp.full(blocks * block, n, jnp.int32).at[dest].set(jnp.arange(n, dtype=jnp.int32))
    xb = jnp.take(x, src, axis=0, mode="fill", fill_value=0).reshape(blocks, block, -1)
    owner = jnp.searchsorted(ends, jnp.arange(blocks) * block, side="right")
    yb = jnp.einsum("nbc,nco->nbo", xb, w[jnp.minimum(owner, groups - 1)])
    return jnp.take(yb.reshape(blocks * block, -1), dest, axis=0, mode="fill", fill_value=0)


def torch_loop(x, w, g):
    """transformers' MoE loop: each expert's rows picked, multiplied, added back."""
    import torch

    out = torch.zeros(x.shape[0], w.shape[-1])
    for e in range(w.shape[0]):
        idx = torch.where(g == e)[0]
        out.index_add_(0, idx, x[idx] @ w[e])
    return out


def sides(x, w, g, backward: bool) -> dict:
    """{side: a call that runs it once, to completion}."""
    import jax
    import torch

    from benchmarks.moe_routing import ragged_dot_rows
    from namedmesh.grouped import grouped_rows

    def jitted(rows):
        if not backward:
            return jax.jit(lambda x, w: rows(x, w, g))
        return jax.jit(jax.value_and_grad(lambda x, w: (rows(x, w, g) ** 2).sum(), (0, 1)))

    kernels = {
        "namedmesh": grouped_rows,
        "earlier kernel (gathered blocks)": gathered_blocks,
        "ragged_dot": ragged_dot_rows,
        "one dense matmul": lambda x, w, g: x @ w[0],
    }
    jx, jw = jax.device_put(x), jax.device_put(w)  # not copied from NumPy each call
    done = lambda f: lambda: jax.block_until_ready(f(jx, jw))  # noqa: E731
    tx, tw, tg = (torch.tensor(a) for a in (x, w, g))
    tx.requires_grad_(backward)
    tw.requires_grad_(backward)

    def torch_side():
        out = torch_loop(tx, tw, tg)
        if backward:
            (out**2).sum().backward()
        else:
            out.sum().item()

    runs = {k: done(jitted(f)) for k, f in kernels.items()}
    return {"namedmesh": runs.pop("namedmesh"), "PyTorch loop": torch_side} | runs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__.split("\n\n")[0])
    for flag, default in (("rows", 1024), ("d-in", 256), ("d-out", 1024), ("experts", 8)):
        ap.add_argument(f"--{flag}", type=cli.count, default=default)
    ap.add_argument("--rounds", type=cli.count, default=7)
    a = ap.parse_args(argv)
    threads = fair.single_threaded()  # before jax's first computation
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.rows, a.d_in), np.float32)
    w = (rng.standard_normal((a.experts, a.d_in, a.d_out)) * 0.05).astype(np.float32)
    uniform = rng.integers(0, a.experts, a.rows).astype(np.int32)
    skewed = np.where(rng.random(a.rows) < 0.9, 0, uniform).astype(np.int32)
    before = fair.load()
    rows = {}
    for label, g, backward in (
        ("forward and backward, uniform", uniform, True),
        ("forward and backward, 90% on one expert", skewed, True),
        ("forward, uniform", uniform, False),
    ):
        rows[label] = fair.alternate(sides(x, w, g, backward), a.rounds)
    print(f"grouped matmul, {a.rows} rows x {a.d_in} -> {a.d_out}, {a.experts} experts, "
          f"float32; {threads}")  # fmt: skip
    print(fair.METHOD.format(flags=fair.XLA_SINGLE_THREAD, rounds=a.rounds, before=before,
                             after=fair.load()))  # fmt: skip
    print("\n".join(fair.table(rows, "rows' experts, pass")))


if __name__ == "__main__":
    sys.exit(cli.run(main))
