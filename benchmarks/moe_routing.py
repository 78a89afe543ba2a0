"""The MoE layer's routings compared by the compiled program's flops (XLA's
cost_analysis of forward and backward, one CPU device): dropless by sorted blocks
(`nm.grouped_matmul`), dropless by `jax.lax.ragged_dot` (which XLA's CPU backend
lowers to a dense product over every expert), and capacity routing's one-hot
dispatch, beside the exact expert matmuls' flops (the gradient is the parameters':
each of wi and wo costs its forward product and its weight gradient's, and wo its
input gradient's too: 5 x 2·tokens·k·d·f).

    python -m benchmarks.moe_routing --batch 16 --length 128 --d-model 256 --d-ff 1024 \\
        --experts 8

Prints one markdown table.
"""

from __future__ import annotations

import argparse
import contextlib

import jax
import jax.numpy as jnp
import numpy as np

import namedmesh as nm
from models import config, moe, transformer
from namedmesh import grouped


def ragged_dot_rows(x, w, g):
    """`grouped.grouped_rows` by jax.lax.ragged_dot: rows sorted by group, then unsorted."""
    order = jnp.argsort(g, stable=True)
    sizes = jnp.zeros(w.shape[0], jnp.int32).at[g].add(1)
    y = jax.lax.ragged_dot(jnp.take(x, order, axis=0), w, sizes)
    return jnp.zeros_like(y).at[order].set(y)


@contextlib.contextmanager
def rows_by(fn):
    """grouped_matmul's row kernel replaced by `fn` while the program is traced."""
    kept = grouped.grouped_rows
    grouped.grouped_rows = fn
    try:
        yield
    finally:
        grouped.grouped_rows = kept


def flops(cfg: config.Config) -> float:
    """Compiled flops of the MoE layer's loss mean(out²) and its gradients."""
    p = transformer.init(moe.moe_params(cfg), 0)
    x = np.random.default_rng(0).normal(size=(cfg.batch, cfg.length, cfg.d_model))
    x = jnp.asarray(x.astype(np.float32))
    dims = ("batch", "length", "d_model")
    loss = lambda p, x: (moe.moe(nm.tensor(x, dims), p, cfg).out ** 2).mean().data
    compiled = jax.jit(jax.value_and_grad(loss)).lower(p, x).compile()
    return float(compiled.cost_analysis()["flops"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in (("batch", 16), ("length", 128), ("d-model", 256), ("d-ff", 1024)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--experts", type=int, default=8)
    a = ap.parse_args(argv)
    cfg = config.Config(
        d_model=a.d_model, d_ff=a.d_ff, length=a.length, batch=a.batch, experts=a.experts,
        ffn="relu",
    )  # fmt: skip
    exact = 5 * 2 * a.batch * a.length * cfg.experts_per_token * a.d_model * a.d_ff
    with rows_by(ragged_dot_rows):
        ragged = flops(cfg)
    rows = [
        ("dropless: nm.grouped_matmul (sorted blocks)", flops(cfg)),
        ("dropless: jax.lax.ragged_dot", ragged),
        ("capacity 1.25: one-hot dispatch einsums", flops(cfg.replace(routing="capacity"))),
    ]
    print("| routing | GFLOP | / the exact expert matmuls |")
    print("|---|---|---|")
    for name, f in rows:
        print(f"| {name} | {f / 1e9:.2f} | {f / exact:.2f} |")
    print(f"| the exact expert matmuls | {exact / 1e9:.2f} | 1.00 |")


if __name__ == "__main__":
    main()
