"""The MoE layer's routings compared by the compiled program's flops (XLA's
cost_analysis of forward and backward, one CPU device): dropless by
`jax.lax.ragged_dot` (which XLA's CPU backend lowers to a dense product over every
expert) and capacity routing's one-hot dispatch, beside the exact expert matmuls'
flops (the gradient is the parameters': each of wi and wo costs its forward product
and its weight gradient's, and wo its input gradient's too: 5 x 2·tokens·k·d·f).
`nm.grouped_matmul`'s kernel loops over the experts and their rows' blocks, whose trip
counts XLA's count cannot know (it counts a loop's body once): its time against
PyTorch's is benchmarks/grouped_kernel.py's.

    python -m benchmarks.moe_routing --batch 16 --length 128 --d-model 256 --d-ff 1024 \\
        --experts 8

and, on 8 devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8` on a CPU), the
bytes the expert FFN's grouped matmuls send per device when `experts` and the tokens are
split over one mesh axis (`batch:data;experts:data`): the plan's and the compiled HLO's
all-to-all rounds (lowering/expert_routes.py), as many as this routing needs, beside the
route that gathers every token (computed) and the least any route sends (each row that
chose another device's expert goes there and its result comes back).

Prints two markdown tables.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

import namedmesh as nm
from benchmarks import cli
from lowering import Mesh, expert_routes, lower
from lowering.cost import traffic
from lowering.hlo import collectives
from models import architecture as config
from models import transformer
from models.layers import moe
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
    ap = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__.split("\n\n")[0])
    for flag, default in (("batch", 16), ("length", 128), ("d-model", 256), ("d-ff", 1024)):
        ap.add_argument(f"--{flag}", type=cli.count, default=default)
    ap.add_argument("--experts", type=cli.count, default=8)
    a = ap.parse_args(argv)
    cfg = config.Config(
        d_model=a.d_model, d_ff=a.d_ff, length=a.length, batch=a.batch, experts=a.experts,
        ffn="relu",
    )  # fmt: skip
    exact = 5 * 2 * a.batch * a.length * cfg.experts_per_token * a.d_model * a.d_ff
    with rows_by(ragged_dot_rows):
        ragged = flops(cfg)
    rows = [
        ("dropless: jax.lax.ragged_dot", ragged),
        ("capacity 1.25: one-hot dispatch einsums", flops(cfg.replace(routing="capacity"))),
    ]
    print("| routing | GFLOP | / the exact expert matmuls |")
    print("|---|---|---|")
    for name, f in rows:
        print(f"| {name} | {f / 1e9:.2f} | {f / exact:.2f} |")
    print(f"| the exact expert matmuls | {exact / 1e9:.2f} | 1.00 |")
    if len(jax.devices()) > 1 and a.experts % len(jax.devices()) == 0:
        expert_parallel(cfg)


def expert_parallel(cfg: config.Config) -> None:
    """The bytes table of the module's docstring, on all of jax's devices as `data`."""
    n = len(jax.devices())
    p = transformer.init(moe.moe_params(cfg), 0)
    dims = ("batch", "length", "d_model")
    x = nm.tensor(np.random.default_rng(0).normal(size=(cfg.batch, cfg.length, cfg.d_model))
                  .astype(np.float32), dims)  # fmt: skip
    choice = jax.jit(lambda p, x: moe.route(x, p, cfg)[0])(p, x)
    ffn = lambda p, x, c: moe.expert_ffn(x, p, cfg, lambda t, w, _: nm.grouped_matmul(t, w, c))  # noqa: E731
    ffn = lower(ffn, Mesh({"data": n}), "batch:data;experts:data")
    args = (p, x, choice)
    plan_bytes = ffn.report(*args, show=False).bytes
    hlo = collectives(ffn.compile(*args).as_text())
    kind = {"all-to-all": "all_to_all", "all-reduce": "psum"}
    sent = {k: 0.0 for k in kind}
    for k, b, _ in hlo:
        sent[k] += traffic(kind[k], ("data",), b, {"data": n})
    # this routing's rounds: the busiest (device, expert's device) pair over a round's slots
    g = np.asarray(choice.data).reshape(n, -1)  # each device's rows (its batch block)
    own, per = g.shape[1], cfg.experts // n
    pairs = np.stack([np.bincount(r // per, minlength=n) for r in g])
    rounds = math.ceil(pairs.max() / expert_routes.capacity(own, n))
    away = pairs.sum() - np.trace(pairs)  # rows whose expert is on another device
    d, f, tokens = cfg.d_model, cfg.d_ff, cfg.batch * cfg.length // n
    least = away / n * 2 * (d + f) * 4  # wi and wo: out and back, per device on average
    k = cfg.experts_per_token
    gather = (n - 1) * tokens * 4 * (d + k * f + k * f + k * d)  # x and h gathered, results
    rows = [  # reduce-scattered, for wi and wo
        ("all-to-all, one round: the plan (cost model)", plan_bytes),
        ("all-to-all, one round: the compiled HLO", sum(sent.values())),
        (
            f"all-to-all, the {rounds} round(s) this routing needs",
            sum(sent.values()) + (rounds - 1) * sent["all-to-all"],
        ),
        ("every token gathered, results reduce-scattered (computed)", gather),
        ("least: each row to its expert's device and back", least),
    ]
    print(f"\n| expert FFN, {n} devices, `batch:data;experts:data` | bytes sent per device "
          "| / least |\n|---|---|---|")  # fmt: skip
    for name, b in rows:
        print(f"| {name} | {b:,.0f} | {b / least:.2f} |")


if __name__ == "__main__":
    sys.exit(cli.run(main))
