"""Collective bytes per device of one training step (forward, backward and gradient
sync), read from compiled HLO, for namedmesh, XLA's automatic partitioner (GSPMD) and
a hand-written `jax.shard_map`, beside the analytical minimum.

The case is the paper's two-layer MLP: y = relu(x w1) w2 with x (batch b, d_model d),
w1 (d_model, d_ff h), w2 (d_ff, d_model), loss = mean(y²), gradients of w1 and w2.
Bytes sent per device follow ring collectives over n devices with S the bytes each
device holds: all-reduce 2(n-1)/n S, reduce-scatter and all-gather (n-1)/n of the
larger side, all-to-all (n-1)/n S (lowering/cost.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import namedmesh as nm
from lowering import Layout, Mesh, lower
from lowering.distributed import place
from lowering.hlo import collectives
from lowering.layout import partition_spec

F32 = 4


def hlo_traffic(hlo_text: str) -> float:
    """Bytes one device sends for all collectives of compiled HLO (ring algorithms)."""
    total = 0.0
    for kind, result, n in collectives(hlo_text):
        if kind == "all-reduce":
            total += 2 * (n - 1) / n * result
        elif kind == "reduce-scatter":
            total += (n - 1) * result
        elif kind in ("all-gather", "all-to-all"):
            total += (n - 1) / n * result
        else:  # collective-permute: the whole buffer
            total += result
    return total


def _ring(n: int, s: float, kind: str) -> float:
    return {"psum": 2 * (n - 1) / n * s, "gather": (n - 1) / n * s, "scatter": (n - 1) / n * s}[
        kind
    ]


@dataclass(frozen=True)
class Case:
    """A layout of the MLP on a mesh, with its analytical minimum bytes per device."""

    name: str
    mesh: dict
    layout: str
    gspmd: dict  # dim -> mesh axis for the partitioner's shardings
    hand: str | None  # the hand-written shard_map variant, if any


def minimum(case: Case, b: int, d: int, h: int) -> float:
    """The least bytes one device must send per step under the layout (Mesh-TensorFlow's
    analysis, ring collectives): data parallelism all-reduces the weight gradients;
    splitting d_ff (Megatron) all-reduces the output activations (b×d, over the batch
    shard) once in the forward pass and nothing in the backward pass (the input needs
    no gradient); FSDP all-gathers each weight for the forward pass and reduce-scatters
    its gradient."""
    sizes = case.mesh
    rules = dict(r.split(":") for r in case.layout.split(";") if r)
    n_batch = sizes.get(rules.get("batch"), 1)
    n_ff = sizes.get(rules.get("d_ff"), 1)
    weights = 2 * d * h * F32 / n_ff  # w1 and w2, as each device holds them for compute
    total = 0.0
    if "d_model" in rules:  # FSDP: weights stored split over the batch axis
        n = sizes[rules["d_model"]]
        total += _ring(n, weights, "gather") + _ring(n, weights, "scatter")
    elif n_batch > 1:
        total += _ring(n_batch, weights, "psum")
    if n_ff > 1:
        total += _ring(n_ff, b // n_batch * d * F32, "psum")
    return total


CASES = [
    Case("data-parallel", {"data": 8}, "batch:data", {"batch": "data"}, None),
    Case("model-parallel", {"model": 8}, "d_ff:model", {"d_ff": "model"}, "megatron"),
    Case(
        "2d",
        {"rows": 2, "cols": 4},
        "batch:rows;d_ff:cols",
        {"batch": "rows", "d_ff": "cols"},
        "megatron",
    ),  # fmt: skip
    Case(
        "2d",
        {"rows": 4, "cols": 2},
        "batch:rows;d_ff:cols",
        {"batch": "rows", "d_ff": "cols"},
        "megatron",
    ),  # fmt: skip
    Case(
        "fsdp", {"data": 8}, "batch:data;d_model:data", {"batch": "data", "d_model": "data"}, None
    ),
]


def mlp(x, w1, w2):
    y = nm.einsum(nm.relu(nm.einsum(x, w1)), w2, out="batch d_model")
    return (y * y).mean()


def _inputs(b, d, h, seed=0):
    r = np.random.default_rng(seed)
    return (
        nm.tensor(r.normal(size=(b, d)).astype(np.float32), "batch d_model"),
        nm.tensor((r.normal(size=(d, h)) * d**-0.5).astype(np.float32), "d_model d_ff"),
        nm.tensor((r.normal(size=(h, d)) * h**-0.5).astype(np.float32), "d_ff d_model"),
    )


def namedmesh_step(case: Case, x, w1, w2):
    """(jitted grad of the lowered loss, its placed inputs)."""
    mesh = Mesh(case.mesh)
    f = lower(mlp, mesh, case.layout)
    grad = jax.jit(jax.grad(lambda x, w1, w2: f(x, w1, w2).data, argnums=(1, 2)))
    return grad, place((x, w1, w2), mesh, Layout(case.layout))


def gspmd_step(case: Case, x, w1, w2):
    """The same loss in jax.numpy, sharded by NamedSharding at the inputs and the hidden
    activation; XLA's partitioner places the collectives."""
    mesh = Mesh(case.mesh)
    layout = Layout(case.layout)  # the same ordered rules give each value its spec
    sh = lambda dims, shape: NamedSharding(
        mesh.jax_mesh, partition_spec(layout.of(dims, shape, mesh))
    )
    b, d, h = x.shape[0], x.shape[1], w1.shape[1]

    def loss(x, w1, w2):
        hid = jax.nn.relu(x @ w1)
        hid = jax.lax.with_sharding_constraint(hid, sh(("batch", "d_ff"), (b, h)))
        y = jax.lax.with_sharding_constraint(hid @ w2, sh(("batch", "d_model"), (b, d)))
        return jnp.mean(y * y)

    shardings = [sh(t.dims, t.shape) for t in (x, w1, w2)]
    grad = jax.jit(
        jax.grad(loss, argnums=(1, 2)),
        in_shardings=shardings,
        out_shardings=(shardings[1], shardings[2]),
    )
    args = [
        jax.device_put(np.asarray(t.data), s) for t, s in zip((x, w1, w2), shardings, strict=True)
    ]
    return grad, args


def _put(tensors, shardings):
    return [jax.device_put(np.asarray(t.data), s) for t, s in zip(tensors, shardings, strict=True)]


def hand_step(case: Case, x, w1, w2):
    """Megatron's MLP written by hand: w1 split on columns and w2 on rows over the d_ff
    axis, one psum of the output; batch over the other axis, weight gradients psummed
    over it."""
    mesh = Mesh(case.mesh).jax_mesh
    ff, batch = case.gspmd["d_ff"], case.gspmd.get("batch")
    n = x.shape[0] * x.shape[1]

    def local(x, w1, w2):
        y = jax.lax.psum(jax.nn.relu(x @ w1) @ w2, ff)
        part = jnp.sum(y * y) / n
        return part if batch is None else jax.lax.psum(part, batch)

    specs = (P(batch, None), P(None, ff), P(ff, None))
    f = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P())
    shardings = [NamedSharding(mesh, s) for s in specs]
    grad = jax.jit(jax.grad(f, argnums=(1, 2)), out_shardings=tuple(shardings[1:]))
    args = [
        jax.device_put(np.asarray(t.data), s) for t, s in zip((x, w1, w2), shardings, strict=True)
    ]
    return grad, args


def measure(case: Case, b: int, d: int, h: int) -> dict:
    """Bytes per device per step for each implementation, and a check that their
    gradients agree with each other."""
    x, w1, w2 = _inputs(b, d, h)
    out, grads = {"minimum": minimum(case, b, d, h)}, {}
    makers = {"namedmesh": namedmesh_step, "gspmd": gspmd_step}
    if case.hand:
        makers["hand"] = hand_step
    for name, make in makers.items():
        fn, args = make(case, x, w1, w2)
        out[name] = hlo_traffic(fn.lower(*args).compile().as_text())
        g = fn(*args)
        grads[name] = [np.asarray(getattr(t, "data", t)) for t in g]
    ref = grads["gspmd"]
    for name, g in grads.items():
        for a, r in zip(g, ref, strict=True):
            if not np.allclose(a, r, rtol=1e-4, atol=1e-6):
                raise AssertionError(f"{case.name}: {name}'s gradients differ from gspmd's")
    return out


def rows(b: int = 64, d: int = 256, h: int = 1024, cases=CASES) -> list[dict]:
    """One row per (case, metric) in the results schema of benchmarks/run.py."""
    out = []
    for case in cases:
        m = measure(case, b, d, h)
        ratio = lambda k, m=m: None if m.get(k) in (None, 0) else round(m["namedmesh"] / m[k], 4)
        out.append(
            {
                "bench": "collective_bytes",
                "case": f"mlp b={b} d={d} h={h}",
                "layout": f"{case.name}: {case.layout}",
                "mesh": "x".join(f"{a}={s}" for a, s in case.mesh.items()),
                "metric": "bytes sent per device per training step",
                "namedmesh": m["namedmesh"],
                "minimum": m["minimum"],
                "gspmd": m["gspmd"],
                "hand": m.get("hand"),
                "ratio_to_min": ratio("minimum") if m["minimum"] else None,
                "ratio_to_gspmd": ratio("gspmd"),
                "ratio_to_hand": ratio("hand"),
            }
        )
    return out
