"""The rates a step time is weighed at: flop/s, bytes/s per collective kind, a latency
per collective, memory per device; measured on a mesh's devices or from a hardware table.

`Rates.seconds(report)` turns a cost report (lowering/cost.py) into a step time,

    overhead + flops / flop rate + collectives * latency + sum over kinds of bytes / rate

a roofline: no memory traffic of elementwise ops, rates that do not change with a
buffer's size; compute at `efficiency` of the peak (1 unless given), and communication
added to compute unless `overlap` says it hides under it (then a step is the larger).
A hardware spec may have two levels (`h100,node=8`: the mesh's innermost axes, up to 8
devices, on NVLink, the rest over InfiniBand; `tpu_v5p,slice=4096`: ICI inside a slice,
DCN across): a collective over axes of both levels is costed hierarchically
(`Rates.collective_seconds`). `measure(mesh)` times
microbenchmarks on the mesh's own devices (a float32 matmul run by every device at
once; each collective kind with 4 MiB per device over all of them; an all-reduce of
one float for the latency; a step that does nothing), once per device kind and mesh
shape in memory, and, given `cache_dir`, in a JSON file there. `HARDWARE` holds the
published figures of TPU v2/v3/v4/v5e/v5p/v6e, A100, H100, H200 and B200, each with its
source, and `ACROSS` the second level of those that have one.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lowering.cost import Report, traffic
from lowering.mesh import Mesh
from lowering.ops import MEASURED, OPS, rate_of
from namedmesh.checks import did_you_mean
from namedmesh.errors import NamedMeshError

KINDS = MEASURED  # the collectives measured, each at its own rate (lowering/ops.py)


class RatesError(NamedMeshError, ValueError):
    """An unknown hardware name, a malformed Rates, or rates asked of a mesh without
    devices."""


@dataclass(frozen=True)
class Rates:
    """What one device does per second. `bytes_per_s`: per collective kind, the bytes one
    device sends per second as the ring formulas of lowering/cost.py count them."""

    name: str
    flops_per_s: float
    bytes_per_s: Mapping[str, float]
    latency_s: float  # one collective, besides its bytes
    memory_bytes: int | None = None  # per device (HBM); None: unknown
    overhead_s: float = 0.0  # a step that does nothing (dispatch)
    source: str = field(default="", compare=False)
    # Levels: the innermost `node` devices of a mesh (its last axes, up to `node`
    # devices) talk over `bytes_per_s` (NVLink, a slice's ICI); the rest across nodes or
    # slices at `outer_bytes_per_s` (InfiniBand, DCN) with `outer_latency_s` more per
    # collective. None: every device on the first level.
    node: int | None = None
    outer_bytes_per_s: float | None = None
    outer_latency_s: float = 0.0
    level_names: tuple[str, str] = ("in node", "across nodes")
    efficiency: float = 1.0  # the share of peak flop/s the step's compute reaches
    overlap: bool = False  # communication hidden under compute: a step is their max

    def __post_init__(self):
        object.__setattr__(self, "level_names", tuple(self.level_names))  # JSON gives a list
        faults = [
            *_fault("flops_per_s", self.flops_per_s, "> 0"),
            *_fault("latency_s", self.latency_s, ">= 0"),
            *_fault("overhead_s", self.overhead_s, ">= 0"),
        ]
        if self.memory_bytes is not None:
            faults += _fault("memory_bytes", self.memory_bytes, "> 0")
        bad = _fault("efficiency", self.efficiency, "> 0")
        if bad or self.efficiency > 1:
            faults.append(f"efficiency must be a number in (0, 1], got {self.efficiency!r}")
        if self.node is not None:
            if not isinstance(self.node, int) or isinstance(self.node, bool) or self.node < 1:
                faults.append(f"node must be a positive int (devices per node), got {self.node!r}")
            if self.outer_bytes_per_s is None:
                faults.append("node= needs outer_bytes_per_s (the rate across nodes)")
            else:
                faults += _fault("outer_bytes_per_s", self.outer_bytes_per_s, "> 0")
            faults += _fault("outer_latency_s", self.outer_latency_s, ">= 0")
        if not isinstance(self.bytes_per_s, Mapping):
            faults.append(
                f"bytes_per_s must map each of {KINDS} to bytes/s, got {self.bytes_per_s!r}"
            )
        else:
            bw = self.bytes_per_s
            faults += [f"bytes_per_s has unknown kind {k!r}{did_you_mean(k, KINDS)}"
                       for k in bw if k not in KINDS]  # fmt: skip
            for k in KINDS:
                faults += (
                    _fault(f"bytes_per_s[{k!r}]", bw[k], "> 0")
                    if k in bw
                    else [f"bytes_per_s lacks {k!r}"]
                )
        if faults:
            raise RatesError(f"Rates {self.name!r}: " + "; ".join(faults))

    def compute_seconds(self, rep: Report) -> float:
        """Flops of the forward and backward passes and remat's recomputation, at
        `efficiency` of the peak rate."""
        flops = rep.flops + rep.backward_flops + rep.recompute_flops
        return flops / (self.flops_per_s * self.efficiency)

    def comm_seconds(self, rep: Report) -> float:
        """Latency and bytes of every collective of the report, forward and backward;
        with levels (`node`), each costed hierarchically (`collective_seconds`)."""
        coll = [*rep.collectives.items(), *rep.backward.items()]
        if self.node is None or not rep.mesh:
            return sum(
                n * self.latency_s + b / self.bytes_per_s[rate_of(k)] for (k, _), (n, b) in coll
            )
        split = levels(rep.mesh, self.node)
        return sum(self.collective_seconds(k, axes, n, b, split) for (k, axes), (n, b) in coll)

    def sync_seconds(self, rep: Report, data_axes) -> float:
        """The part of `comm_seconds` that is the data-parallel gradient all-reduce: the
        backward pass's psums over mesh axes that split the batch only. A psum there is
        the transpose of a cast to varying over them, and a value not varying over the
        batch's axes is made of parameters alone, so its cotangent is a gradient's
        partial sum: the sync that gradient accumulation (and a pipeline's microbatches)
        runs once per step, summing locally between. FSDP's reduce-scatters (the
        transposes of its parameters' all-gathers) are not in it: they run per
        microbatch, the gathered gradient never held whole."""
        data = set(data_axes)
        sync = {k: v for k, v in rep.backward.items() if k[0] == "psum" and set(k[1]) <= data}
        if not sync or not data:
            return 0.0
        if self.node is None or not rep.mesh:
            return sum(n * self.latency_s + b / self.bytes_per_s[rate_of(k)]
                       for (k, _), (n, b) in sync.items())  # fmt: skip
        split = levels(rep.mesh, self.node)
        return sum(self.collective_seconds(k, axes, n, b, split)
                   for (k, axes), (n, b) in sync.items())  # fmt: skip

    def collective_seconds(self, kind: str, axes, count: int, sent: float, split: dict) -> float:
        """Seconds of `count` collectives of `kind` over mesh `axes` that send `sent`
        bytes per device in all (the ring formulas over every device), on two levels:
        `split` gives each axis's (devices in a node, nodes). Hierarchically: an
        all-reduce reduce-scatters in the node, all-reduces the 1/n_in piece across
        nodes and all-gathers in the node; a reduce-scatter and an all-gather likewise
        in one direction; an all-to-all sends (n_in-1)/n of its bytes in the node and
        (n-n_in)/n across, on both links at once; a ppermute that crosses nodes crosses
        at the slower rate."""
        inner = math.prod(split[a][0] for a in axes)
        outer = math.prod(split[a][1] for a in axes)
        rate = rate_of(kind)
        fast, slow = self.bytes_per_s[rate], self.outer_bytes_per_s
        if outer == 1:
            return count * self.latency_s + sent / fast
        if inner == 1:
            return count * (self.latency_s + self.outer_latency_s) + sent / slow
        n = inner * outer
        put = sent / OPS[kind].traffic(n, 1.0)  # bytes put in per device, all calls
        if rate == "psum":
            t = 2 * (inner - 1) / inner * put / fast + 2 * (outer - 1) / outer * put / inner / slow
        elif rate == "psum_scatter":
            t = (inner - 1) / inner * put / fast + (outer - 1) / outer * put / inner / slow
        elif rate == "all_gather":
            t = (inner - 1) * outer * put / fast + (outer - 1) * put / slow
        elif rate == "all_to_all":
            t = max((inner - 1) / n * put / fast, (n - inner) / n * put / slow)
        else:  # ppermute: a ring that crosses nodes waits on its slowest link
            t = sent / slow
        return count * (self.latency_s + self.outer_latency_s) + t

    def step_seconds(self, compute: float, comm: float) -> float:
        """A step's seconds from its compute and communication: their sum, or (with
        `overlap`) the larger, plus the empty step's overhead."""
        return self.overhead_s + (max(compute, comm) if self.overlap else compute + comm)

    def seconds(self, rep: Report) -> float:
        """The predicted seconds of the step `rep` reports (with its backward pass)."""
        return self.step_seconds(self.compute_seconds(rep), self.comm_seconds(rep))

    def __str__(self) -> str:
        bw = self.bytes_per_s
        if len(set(bw.values())) == 1:
            links = f"{next(iter(bw.values())) / 1e9:.3g} GB/s sent per device (every collective)"
        else:
            links = "GB/s sent per device: " + ", ".join(f"{k} {bw[k] / 1e9:.3g}" for k in KINDS)
        mem = f"{self.memory_bytes / 2**30:.3g} GiB per device" if self.memory_bytes else "memory ?"
        if self.node is not None:
            inside, across = self.level_names
            links = (
                f"{inside} (up to {self.node} devices): {links}; {across}: "
                f"{self.outer_bytes_per_s / 1e9:.3g} GB/s, +{self.outer_latency_s * 1e6:.3g} µs"
            )
        eff = f" at {self.efficiency:.0%} of peak" if self.efficiency != 1 else ""
        return (
            f"{self.name}: {self.flops_per_s / 1e12:.4g} TFLOP/s per device{eff}; {links}; "
            f"{self.latency_s * 1e6:.3g} µs per collective; {mem}; communication "
            + ("overlaps compute" if self.overlap else "does not overlap compute")
            + (f"; {self.overhead_s * 1e3:.3g} ms per empty step" if self.overhead_s else "")
        )


def levels(mesh: tuple[tuple[str, int], ...], node: int) -> dict[str, tuple[int, int]]:
    """Each mesh axis's (devices inside a node, nodes it spans), for a mesh given as its
    (axis, size) items major to minor and `node` devices per node: the innermost axes
    fill a node first (devices are numbered with the last axis fastest, as a node's
    GPUs or a slice's chips are); an axis that does not fit the node's remaining room
    whole keeps the part of it that divides that room inside."""
    room, out = node, {}
    for axis, n in reversed(mesh):
        inside = math.gcd(n, room)
        out[axis] = (inside, n // inside)
        room = room // inside if inside == n else 1  # a split axis: the rest is across
    return out


def _fault(name: str, value, bound: str) -> list[str]:
    """`[why]` when `value` is not a finite real number `bound` ("> 0" or ">= 0"), else []."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if real and math.isfinite(value) and (value > 0 if bound == "> 0" else value >= 0):
        return []
    return [f"{name} must be a finite number {bound}, got {value!r}"]


def uniform(name, flops, bandwidth, latency, memory, source) -> Rates:
    """Rates with one bandwidth for every collective kind (a hardware table's row)."""
    return Rates(name, flops, dict.fromkeys(KINDS, bandwidth), latency, memory, 0.0, source)


_GIB = 2**30
# Peak dense bf16 flop/s and HBM per JAX device; bandwidth is what one device sends along
# one mesh axis. TPU: a ring along one axis of the torus uses about one ICI port per
# device each way, so a device sends at about one port's rate. GPU: NVLink within a node,
# one direction. Latency: an order of magnitude only (no published per-collective
# figure was found): ~10 µs for an ICI collective, ~15 µs for NCCL's small all-reduce.
HARDWARE: dict[str, Rates] = {
    "tpu_v2": uniform("tpu_v2", 45e12 / 2, 62e9, 10e-6, 8 * _GIB,
        "a JAX device is one TensorCore: 45 TFLOP/s and 16 GiB HBM per 2-core chip "
        "(cloud.google.com/tpu/docs/v2; elektroniknet.de TPUv2 figure); ~62 GB/s per ICI "
        "port, 4 ports per chip (brendanjameslynskey.github.io, Google TPU series)"),
    "tpu_v3": uniform("tpu_v3", 123e12 / 2, 340e12 / 1024 / 4, 10e-6, 16 * _GIB,
        "one TensorCore: 123 TFLOP/s bf16 and 32 GiB HBM per 2-core chip; 340 TB/s "
        "all-reduce bandwidth per 1024-chip pod (cloud.google.com/tpu/docs/v3), taken as 4 "
        "ports per chip: 83 GB/s per port"),
    "tpu_v4": uniform("tpu_v4", 275e12, 300e9 / 6, 10e-6, 32 * _GIB,
        "one chip (megacore): 275 TFLOP/s bf16, 32 GiB HBM, 2400 Gbps = 300 GB/s of ICI "
        "over 6 ports of a 3-D torus (cloud.google.com/tpu/docs/v4): 50 GB/s per port"),
    "tpu_v5e": uniform("tpu_v5e", 197e12, 200e9 / 4, 10e-6, 16 * _GIB,
        "one chip: 197 TFLOP/s bf16, 16 GiB HBM, 1600 Gbps = 200 GB/s of ICI over 4 ports "
        "of a 2-D torus (cloud.google.com/tpu/docs/v5e): 50 GB/s per port"),
    "a100": uniform("a100", 312e12, 300e9, 15e-6, 80 * 10**9,
        "A100 SXM 80GB: 312 TFLOP/s dense bf16, 80 GB HBM2e, NVLink 600 GB/s "
        "bidirectional = 300 GB/s each way (NVIDIA A100 datasheet); within one node"),
    "h100": uniform("h100", 989e12, 450e9, 15e-6, 80 * 10**9,
        "H100 SXM: 989 TFLOP/s dense bf16, 80 GB HBM3, NVLink 900 GB/s bidirectional = "
        "450 GB/s each way (NVIDIA H100 datasheet); within one node"),
    "h200": uniform("h200", 989e12, 450e9, 15e-6, 141 * 10**9,
        "H200 SXM: 989 TFLOP/s dense bf16 (1,979 with sparsity), 141 GB HBM3e, NVLink 900 "
        "GB/s bidirectional = 450 GB/s each way (NVIDIA H200 datasheet); within one node"),
    "b200": uniform("b200", 2.25e15, 900e9, 15e-6, 180 * 10**9,
        "B200 in HGX/DGX B200: 2.25 PFLOP/s dense bf16 (4.5 dense FP8), 180 GB HBM3e (1,440 "
        "GB per 8 GPUs), NVLink 5 1.8 TB/s bidirectional = 900 GB/s each way (NVIDIA DGX "
        "B200 and Blackwell datasheets); within one node"),
    "tpu_v5p": uniform("tpu_v5p", 459e12, 1200e9 / 2 / 6, 10e-6, 95 * _GIB,
        "one chip: 459 TFLOP/s bf16, 95 GiB HBM2e, 1200 GB/s bidirectional ICI over 6 ports "
        "of a 3-D torus = 100 GB/s per port each way (cloud.google.com/tpu/docs/v5p)"),
    "tpu_v6e": uniform("tpu_v6e", 918e12, 800e9 / 2 / 4, 10e-6, 32 * 10**9,
        "one chip (Trillium): 918 TFLOP/s bf16, 32 GB HBM, 800 GB/s bidirectional ICI over "
        "4 ports of a 2-D torus = 100 GB/s per port each way (cloud.google.com/tpu/docs/v6e)"),
}  # fmt: skip

# The second level of each hardware that has one: (names of the levels, bytes/s one
# device sends across nodes or slices, latency added per collective that crosses), for
# `node=` / `slice=` specs (`h100,node=8`). Latency: an order of magnitude (a network
# hop, ~10 µs over InfiniBand, ~50 µs over the data-center network).
_NVLINK_IB = ("NVLink", "InfiniBand")
_ICI_DCN = ("ICI", "DCN")
ACROSS: dict[str, tuple[tuple[str, str], float, float, str]] = {
    "a100": (_NVLINK_IB, 200e9 / 8, 10e-6, "DGX A100: one 200 Gb/s HDR InfiniBand port per GPU"),
    "h100": (_NVLINK_IB, 400e9 / 8, 10e-6,
             "DGX H100: one 400 Gb/s NDR ConnectX-7 port per GPU"),
    "h200": (_NVLINK_IB, 400e9 / 8, 10e-6,
             "DGX H200: one 400 Gb/s NDR ConnectX-7 port per GPU"),
    "b200": (_NVLINK_IB, 400e9 / 8, 10e-6,
             "DGX B200: eight 400 Gb/s ConnectX-7 ports, one per GPU"),
    "tpu_v5e": (_ICI_DCN, 2 * 100e9 / 8 / 8, 50e-6,
                "v5e: 2 x 100 Gbps NICs per host of 8 chips (cloud.google.com/tpu/docs/v5e)"),
    "tpu_v5p": (_ICI_DCN, 50e9 / 8, 50e-6,
                "v5p: 50 Gbps of data-center network per chip (cloud.google.com/tpu/docs/v5p)"),
    "tpu_v6e": (_ICI_DCN, 4 * 200e9 / 8 / 8, 50e-6,
                "v6e: 4 x 200 Gbps NICs per host of 8 chips (cloud.google.com/tpu/docs/v6e)"),
}  # fmt: skip


def hardware(name: str) -> Rates:
    """The table's Rates called `name` (RatesError naming the known ones otherwise)."""
    key = name.lower().replace("-", "_").replace(" ", "_")
    if key not in HARDWARE:
        raise RatesError(
            f"unknown hardware {name!r}{did_you_mean(key, HARDWARE)} Known: {', '.join(HARDWARE)}"
        )
    return HARDWARE[key]


# parse's keys and the Rates field each sets ("bandwidth": every collective kind's rate)
_KEYS = {
    "flops": "flops_per_s",
    "latency": "latency_s",
    "memory": "memory_bytes",
    "overhead": "overhead_s",
    "bandwidth": "bytes_per_s",
    **dict.fromkeys(KINDS, "bytes_per_s"),
    "node": "node",
    "slice": "node",
    "outer": "outer_bytes_per_s",
    "outer_latency": "outer_latency_s",
    "efficiency": "efficiency",
    "overlap": "overlap",
}


def parse(text: str) -> Rates:
    """Rates from text, as `--rates` takes them: a hardware name of `HARDWARE`
    (`tpu_v4`), optionally followed by `key=value` pairs in SI units that replace its
    figures (`tpu_v4,latency=2e-5`), or pairs alone (`flops=1e12,bandwidth=1e10,
    latency=1e-5`). Keys: flops (flop/s per device), bandwidth (bytes/s a device sends,
    every collective kind) or one kind's rate (psum, psum_scatter, all_gather,
    all_to_all, ppermute), latency (s per collective), memory (bytes per device),
    overhead (s per step); node (or slice: devices inside a node or a TPU slice, the
    mesh's innermost axes; past them collectives cross at the hardware's second level,
    `ACROSS`), outer (bytes/s a device sends across), outer_latency (s added per crossing
    collective), efficiency (the share of peak flop/s reached, (0, 1]), overlap (1:
    communication overlaps compute). `bandwidth` and then one kind's key set that kind
    apart; a key given twice is an error. RatesError names the part at fault."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise RatesError(
            f"rates {text!r}: expected a hardware name ({', '.join(HARDWARE)}) or key=value pairs"
        )
    fields: dict = {"name": text, "bytes_per_s": {}, "source": "given"}
    if "=" not in parts[0]:
        fields = {**_stored(hardware(parts[0])), "name": text}
        key = parts[0].lower().replace("-", "_").replace(" ", "_")
        if key in ACROSS:  # its second level, used when node= / slice= is given
            names, rate, latency, source = ACROSS[key]
            fields.update(level_names=names, outer_bytes_per_s=rate, outer_latency_s=latency,
                          source=f"{fields['source']}; across: {source}")  # fmt: skip
        parts = parts[1:]
    pairs = [_pair(text, part) for part in parts]
    given = [key for key, _ in pairs]
    twice = sorted({k for k in given if given.count(k) > 1})
    if twice:
        raise RatesError(f"rates {text!r}: {', '.join(twice)} given more than once")
    if "node" in given and "slice" in given:
        raise RatesError(f"rates {text!r}: node= and slice= name one thing; give one")
    if (
        ("node" in given or "slice" in given)
        and "outer" not in given
        and not fields.get("outer_bytes_per_s")
    ):
        raise RatesError(
            f"rates {text!r}: node=/slice= needs the rate across nodes: outer=BYTES_PER_S "
            f"(or a hardware with a second level: {', '.join(ACROSS)})"
        )
    for key, value in pairs:
        if key in ("node", "slice", "overlap"):
            bad = value not in (0, 1) if key == "overlap" else value != int(value) or value < 1
            if bad:
                raise RatesError(
                    f"rates {text!r}: {key}={value:g} must be "
                    + ("0 or 1" if key == "overlap" else "a whole number of devices >= 1")
                )
            fields[_KEYS[key]] = bool(value) if key == "overlap" else int(value)
        elif _KEYS[key] != "bytes_per_s":
            whole = key == "memory" and math.isfinite(value)  # bytes: an int
            fields[_KEYS[key]] = int(value) if whole else value
        else:
            kinds = KINDS if key == "bandwidth" else (key,)
            fields["bytes_per_s"] = {**fields["bytes_per_s"], **dict.fromkeys(kinds, value)}
    lacking = [k for k in ("flops", "latency") if _KEYS[k] not in fields]
    if lacking:
        raise RatesError(
            f"rates {text!r}: no {' or '.join(lacking)}= given (nor a hardware name first)"
        )
    return Rates(**fields)


def _pair(text: str, part: str) -> tuple[str, float]:
    """`key=value` of `parse` as (key, number); RatesError naming the part otherwise."""
    key, eq, value = (x.strip() for x in part.partition("="))
    if not eq or key not in _KEYS:
        raise RatesError(
            f"rates {text!r}: {part!r} is not key=value with a key of {', '.join(_KEYS)}"
            + did_you_mean(key, _KEYS)
        )
    try:
        return key, float(value)
    except ValueError:
        raise RatesError(
            f"rates {text!r}: {key}={value!r} is not a number (SI units: 2e-5, 8e9)"
        ) from None


def median_seconds(fns: dict, repeats: int) -> dict:
    """Median wall time of each (fn, args), the implementations taking turns per repeat."""
    times: dict = {k: [] for k in fns}
    for _ in range(repeats):
        for k, (fn, args) in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[k].append(time.perf_counter() - start)
    return {k: float(np.median(v)) for k, v in times.items()}


def _median(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    return median_seconds({"fn": (fn, args)}, repeats)["fn"]


def _runner(devices):
    """(k, place, run): `devices` as one mesh axis "all"; place an array split over it;
    run a function of the local shard under jit(shard_map)."""
    mesh = jax.sharding.Mesh(np.array(devices), ("all",))
    spec = PartitionSpec("all")
    place = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))
    return len(devices), place, run


def collective_rates(
    n_bytes: int, repeats: int = 9, latency_s: float = 0.0, only=None, devices=None
) -> dict:
    """Per collective kind (or those in `only`) over `devices` (default: all of jax's),
    with `n_bytes` put in by each device: the bytes per second one device sends (ring
    formulas), the time less `latency_s` per call (at most halved)."""
    k, place, run = _runner(list(jax.devices() if devices is None else devices))
    buf = place(np.ones((k * n_bytes // 4,), np.float32))
    out = {}
    for kind in KINDS:
        if only is not None and kind not in only:
            continue
        op = OPS[kind]  # its microbenchmark keeps the local shape, for out_specs `spec`
        put_in = op.measure_in(n_bytes, k)
        sent = max(traffic(kind, ("all",), put_in, {"all": k}), 1.0)  # one device: no traffic
        t = _median(run(lambda x, op=op: op.measure(x, k)), [buf], repeats)
        # less the latency, but never below half the time: on a busy machine the latency
        # measured can be near the whole time, and the rate would then be absurd
        out[kind] = sent / max(t - latency_s, t / 2, 1e-9)
    return out


def calibrate(
    devices=None, n_matmul: int = 512, n_bytes: int = 1 << 22, repeats: int = 9, name: str = ""
) -> Rates:
    """Rates measured on `devices` (default: all of jax's) as one mesh axis."""
    devices = list(jax.devices() if devices is None else devices)
    k, place, run = _runner(devices)
    idle = _median(run(lambda x: x), [place(np.zeros((k, 1), np.float32))], repeats)
    a = place(np.random.default_rng(0).normal(size=(k * n_matmul, n_matmul)).astype(np.float32))
    matmul = _median(run(lambda x: x @ x), [a], repeats)
    tiny = _median(run(lambda x: jax.lax.psum(x, "all")), [place(np.ones(k, np.float32))], repeats)
    return Rates(
        name or f"measured on {k} x {devices[0].device_kind}",
        float(2 * n_matmul**3 / max(matmul - idle, 1e-9)),
        collective_rates(n_bytes, repeats, tiny, devices=devices),
        max(tiny - idle, 0.0),
        _device_memory(devices[0]),
        idle,
        f"microbenchmarks on {k} devices: float32 {n_matmul}^3 matmul, collectives with "
        f"{n_bytes} bytes per device, median of {repeats}",
    )


def _device_memory(device) -> int | None:
    try:
        stats = device.memory_stats()  # None or missing on CPU
    except Exception:  # noqa: BLE001 - backends without memory stats raise various errors
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


_MEASURED: dict = {}


def measure(mesh: Mesh, cache_dir: str | os.PathLike | None = None, repeats: int = 9) -> Rates:
    """The Rates of `mesh`'s devices, timed on first use and kept, keyed by device kind and
    mesh shape, in memory and (with `cache_dir`) in `cache_dir/rates.json`."""
    if mesh.abstract:
        raise RatesError(
            f"{mesh} has no devices to measure: pass rates= a hardware name "
            f"({', '.join(HARDWARE)}) or a Rates"
        )
    devices = list(mesh.jax_mesh.devices.flat)
    key = f"{devices[0].platform}:{devices[0].device_kind}:" + "x".join(
        f"{a}={n}" for a, n in mesh.sizes.items()
    )
    path = Path(cache_dir) / "rates.json" if cache_dir is not None else None
    if key in _MEASURED:
        return _MEASURED[key]
    stored = _read_cache(path) if path is not None else {}
    if key not in stored:
        stored[key] = calibrate(devices, repeats=repeats, name=f"measured: {key}")
        if path is not None:
            _write_cache(path, stored)
    _MEASURED[key] = stored[key]
    return stored[key]


def _read_cache(path: Path) -> dict[str, Rates]:
    """The Rates stored in `path` by key. A cache, so an entry that cannot be read (a
    file cut short, edited, or written by another version) is measured again, with a
    warning naming the file, rather than failing the search."""
    if not path.exists():
        return {}
    try:
        table = json.loads(path.read_text())
        return {k: Rates(**v) for k, v in table.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        warnings.warn(
            f"measured rates cache {path} is unreadable ({type(e).__name__}: {e}); "
            f"measuring again and rewriting it",
            stacklevel=3,
        )
        return {}


def _stored(r: Rates) -> dict:
    return {**asdict(r), "bytes_per_s": dict(r.bytes_per_s), "level_names": tuple(r.level_names)}


def _write_cache(path: Path, table: dict[str, Rates]) -> None:
    """`table` written to `path` whole, by os.replace, so a process killed while writing
    leaves the old file, not half of a new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({k: _stored(r) for k, r in table.items()}, indent=1))
    os.replace(tmp, path)


def clear_cache() -> None:
    """Forget the rates `measure` holds in memory (the files in cache dirs stay)."""
    _MEASURED.clear()


def user_cache_dir() -> Path:
    """Where the CLI keeps measured rates: $XDG_CACHE_HOME/namedmesh (~/.cache/namedmesh)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "namedmesh"


def resolve(rates, mesh: Mesh, cache_dir=None) -> Rates:
    """`rates` as Rates: a Rates as is, a hardware name from `HARDWARE`, or None: measured
    on `mesh`'s devices (`measure`)."""
    if isinstance(rates, Rates):
        return rates
    if isinstance(rates, str):
        return parse(rates)
    if rates is None:
        return measure(mesh, cache_dir)
    raise RatesError(f"rates must be a Rates, a hardware name or None, got {rates!r}")


def describe(r: Rates) -> str:
    """One line: the rates with their units (used by benchmark pages)."""
    return str(r) + (f" ({r.source})" if r.source else "")
