"""The cost model's step time on this machine: a roofline from a few constants.

The constants are measured once per run by microbenchmarks on the same simulated
devices, never fitted to the benchmark cases: the flop rate of a float32 matmul run by
every device at once; per collective kind, the bytes per second one device sends (as
the ring formulas of lowering/cost.py count them) with 4 MiB per device; the latency of
a collective (an all-reduce of one float); and the time of a step that does nothing
(dispatch). The predicted time of a training step is then

    overhead + flops / flop rate + collectives * latency + sum over kinds of bytes / rate

with flops, collectives and bytes per device from `Lowered.report(wrt=...)`. It is a
roofline, so a lower bound in spirit: the memory traffic of elementwise ops, the
overlap of compute with collectives, a small matmul's lower efficiency, and rates that
change with a buffer's size are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from benchmarks.collectives import median_seconds
from lowering.cost import Report, traffic


@dataclass(frozen=True)
class Machine:
    flops_per_s: float  # per device, every device computing at once
    bytes_per_s: dict  # collective kind -> bytes per second one device sends
    latency_s: float  # one collective, besides its bytes
    overhead_s: float  # one step that does nothing

    def seconds(self, rep: Report) -> float:
        """The predicted seconds of the step `rep` reports (with its backward pass)."""
        coll = [*rep.collectives.items(), *rep.backward.items()]
        return (
            self.overhead_s
            + (rep.flops + rep.backward_flops) / self.flops_per_s
            + sum(n for _, (n, _) in coll) * self.latency_s
            + sum(b / self.bytes_per_s[_KIND.get(k, k)] for (k, _), (_, b) in coll)
        )


_KIND = {"pmax": "psum", "pmin": "psum"}  # all-reduces too


def _median(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    return median_seconds({"fn": (fn, args)}, repeats)["fn"]


def _mesh_runner():
    devices = np.array(jax.devices())
    mesh = jax.sharding.Mesh(devices, ("all",))
    spec = PartitionSpec("all")
    place = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))
    return len(devices), place, run


def rates(n_bytes: int, repeats: int = 9, latency_s: float = 0.0, only=None) -> dict:
    """Per collective kind (or those in `only`) over all devices, with `n_bytes` put in
    by each device: the bytes per second one device sends (ring formulas), less
    `latency_s` per call."""
    k, place, run = _mesh_runner()
    ring = [(j, (j + 1) % k) for j in range(k)]
    kinds = {  # each keeps the local shape, so that out_specs can be `spec`
        "psum": lambda x: jax.lax.psum(x, "all"),
        "psum_scatter": lambda x: jnp.tile(jax.lax.psum_scatter(x, "all", tiled=True), k),
        "all_gather": lambda x: jax.lax.all_gather(x[: x.size // k], "all", tiled=True),
        "all_to_all": lambda x: jax.lax.all_to_all(x, "all", 0, 0, tiled=True),
        "ppermute": lambda x: jax.lax.ppermute(x, "all", ring),
    }
    buf = place(np.ones((k * n_bytes // 4,), np.float32))
    out = {}
    for kind, f in kinds.items():
        if only is not None and kind not in only:
            continue
        put_in = n_bytes // k if kind == "all_gather" else n_bytes
        sent = traffic(kind, ("all",), put_in, {"all": k})
        out[kind] = sent / max(_median(run(f), [buf], repeats) - latency_s, 1e-9)
    return out


def calibrate(n_matmul: int = 512, n_bytes: int = 1 << 22, repeats: int = 9) -> Machine:
    """The constants, on all of jax's devices as one mesh axis."""
    k, place, run = _mesh_runner()
    idle = _median(run(lambda x: x), [place(np.zeros((k, 1), np.float32))], repeats)
    a = place(np.random.default_rng(0).normal(size=(k * n_matmul, n_matmul)).astype(np.float32))
    matmul = _median(run(lambda x: x @ x), [a], repeats)
    tiny = _median(run(lambda x: jax.lax.psum(x, "all")), [place(np.ones(k, np.float32))], repeats)
    return Machine(float(2 * n_matmul**3 / max(matmul - idle, 1e-9)),
                   rates(n_bytes, repeats, tiny), max(tiny - idle, 0.0), idle)  # fmt: skip


def describe(m: Machine) -> str:
    rates = ", ".join(f"{k} {r / 1e9:.2f}" for k, r in m.bytes_per_s.items())
    return (
        f"{m.flops_per_s / 1e9:.1f} GFLOP/s per device (float32 matmul, all devices at once); "
        f"GB/s sent per device with 4 MiB each: {rates}; {m.latency_s * 1e6:.0f} µs per "
        f"collective; {m.overhead_s * 1e3:.2f} ms per step that does nothing"
    )
