"""The cost model's step time on this machine: a roofline from a few constants.

The constants are measured once per run by the microbenchmarks of lowering/rates.py on
the same simulated devices, never fitted to the benchmark cases: the flop rate of a
float32 matmul run by every device at once; per collective kind, the bytes per second
one device sends (as the ring formulas of lowering/cost.py count them) with 4 MiB per
device; the latency of a collective (an all-reduce of one float); and the time of a step
that does nothing (dispatch). The predicted time of a training step is then

    overhead + flops / flop rate + collectives * latency + sum over kinds of bytes / rate

with flops, collectives and bytes per device from `Lowered.report(wrt=...)`
(`lowering.rates.Rates.seconds`). It is a roofline, so a lower bound in spirit: the
memory traffic of elementwise ops, the overlap of compute with collectives, a small
matmul's lower efficiency, and rates that change with a buffer's size are not modelled.
"""

from __future__ import annotations

from lowering.rates import Rates as Machine
from lowering.rates import calibrate as _calibrate
from lowering.rates import collective_rates as rates

__all__ = ["Machine", "calibrate", "describe", "rates"]


def calibrate(n_matmul: int = 512, n_bytes: int = 1 << 22, repeats: int = 9) -> Machine:
    """The constants, on all of jax's devices as one mesh axis."""
    return _calibrate(None, n_matmul, n_bytes, repeats)


def describe(m: Machine) -> str:
    rates_ = ", ".join(f"{k} {r / 1e9:.2f}" for k, r in m.bytes_per_s.items())
    return (
        f"{m.flops_per_s / 1e9:.1f} GFLOP/s per device (float32 matmul, all devices at once); "
        f"GB/s sent per device with 4 MiB each: {rates_}; {m.latency_s * 1e6:.0f} µs per "
        f"collective; {m.overhead_s * 1e3:.2f} ms per step that does nothing"
    )
