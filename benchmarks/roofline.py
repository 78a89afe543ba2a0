"""The cost model's step time on this machine: a roofline from three constants.

The constants are measured once per run by microbenchmarks on the same simulated
devices, never fitted to the benchmark cases: the flop rate of a float32 matmul run by
every device at once, the latency of a collective (an all-reduce of one float) and the
bytes per second one device sends in a large all-reduce over all devices, and the time
of a step that does nothing (dispatch). The predicted time of a training step is then

    overhead + flops / flop rate + collectives * latency + bytes / byte rate

with flops and bytes per device from `Lowered.report(wrt=...)`. It is a roofline, so a
lower bound in spirit: the memory traffic of elementwise ops, the overlap of compute
with collectives and a small matmul's lower efficiency are not modelled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lowering.cost import Report, traffic


@dataclass(frozen=True)
class Machine:
    flops_per_s: float  # per device, every device computing at once
    bytes_per_s: float  # per device, sent in an all-reduce over all devices
    latency_s: float  # one collective, besides its bytes
    overhead_s: float  # one step that does nothing

    def seconds(self, rep: Report) -> float:
        """The predicted seconds of the step `rep` reports (with its backward pass)."""
        count = sum(n for n, _ in [*rep.collectives.values(), *rep.backward.values()])
        return (
            self.overhead_s
            + (rep.flops + rep.backward_flops) / self.flops_per_s
            + count * self.latency_s
            + (rep.bytes + rep.backward_bytes) / self.bytes_per_s
        )


def _median(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def calibrate(n_matmul: int = 512, n_bytes: int = 1 << 22, repeats: int = 9) -> Machine:
    """The three constants, on all of jax's devices as one mesh axis."""
    devices = np.array(jax.devices())
    mesh = jax.sharding.Mesh(devices, ("all",))
    k = len(devices)
    spec = PartitionSpec("all")
    place = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))

    idle = _median(run(lambda x: x), [place(np.zeros((k, 1), np.float32))], repeats)
    a = place(np.random.default_rng(0).normal(size=(k * n_matmul, n_matmul)).astype(np.float32))
    matmul = _median(run(lambda x: x @ x), [a], repeats)
    flops = 2 * n_matmul**3
    psum = run(lambda x: jax.lax.psum(x, "all"))
    tiny = _median(psum, [place(np.ones((k,), np.float32))], repeats)
    reduce = _median(psum, [place(np.ones((k * n_bytes // 4,), np.float32))], repeats)
    sent = traffic("psum", ("all",), n_bytes, {"all": k})
    return Machine(
        flops_per_s=flops / max(matmul - idle, 1e-9),
        bytes_per_s=sent / max(reduce - tiny, 1e-9),
        latency_s=max(tiny - idle, 0.0),
        overhead_s=idle,
    )


def describe(m: Machine) -> str:
    return (
        f"{m.flops_per_s / 1e9:.2f} GFLOP/s per device (float32 matmul, all devices at once), "
        f"{m.latency_s * 1e6:.0f} µs per collective and "
        f"{m.bytes_per_s / 1e9:.2f} GB/s per device (all-reduce over all), "
        f"{m.overhead_s * 1e3:.2f} ms per step that does nothing"
    )
