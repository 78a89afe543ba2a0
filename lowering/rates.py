"""The rates a step time is weighed at: flop/s, bytes/s per collective kind, a latency
per collective, memory per device; measured on a mesh's devices or from a hardware table.

`Rates.seconds(report)` turns a cost report (lowering/cost.py) into a step time,

    overhead + flops / flop rate + collectives * latency + sum over kinds of bytes / rate

a roofline: no overlap of compute with communication, no memory traffic of elementwise
ops, rates that do not change with a buffer's size. `measure(mesh)` times
microbenchmarks on the mesh's own devices (a float32 matmul run by every device at
once; each collective kind with 4 MiB per device over all of them; an all-reduce of
one float for the latency; a step that does nothing), once per device kind and mesh
shape in memory, and, given `cache_dir`, in a JSON file there. `HARDWARE` holds the
published figures of TPU v2/v3/v4/v5e, A100 and H100, each with its source.
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

    def __post_init__(self):
        faults = [
            *_fault("flops_per_s", self.flops_per_s, "> 0"),
            *_fault("latency_s", self.latency_s, ">= 0"),
            *_fault("overhead_s", self.overhead_s, ">= 0"),
        ]
        if self.memory_bytes is not None:
            faults += _fault("memory_bytes", self.memory_bytes, "> 0")
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
        """Flops of the forward and backward passes and remat's recomputation."""
        return (rep.flops + rep.backward_flops + rep.recompute_flops) / self.flops_per_s

    def comm_seconds(self, rep: Report) -> float:
        """Latency and bytes of every collective of the report, forward and backward."""
        coll = [*rep.collectives.items(), *rep.backward.items()]
        return sum(n * self.latency_s + b / self.bytes_per_s[rate_of(k)] for (k, _), (n, b) in coll)

    def seconds(self, rep: Report) -> float:
        """The predicted seconds of the step `rep` reports (with its backward pass)."""
        return self.overhead_s + self.compute_seconds(rep) + self.comm_seconds(rep)

    def __str__(self) -> str:
        bw = self.bytes_per_s
        if len(set(bw.values())) == 1:
            links = f"{next(iter(bw.values())) / 1e9:.3g} GB/s sent per device (every collective)"
        else:
            links = "GB/s sent per device: " + ", ".join(f"{k} {bw[k] / 1e9:.3g}" for k in KINDS)
        mem = f"{self.memory_bytes / 2**30:.3g} GiB per device" if self.memory_bytes else "memory ?"
        return (
            f"{self.name}: {self.flops_per_s / 1e12:.4g} TFLOP/s per device; {links}; "
            f"{self.latency_s * 1e6:.3g} µs per collective; {mem}"
            + (f"; {self.overhead_s * 1e3:.3g} ms per empty step" if self.overhead_s else "")
        )


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
}


def parse(text: str) -> Rates:
    """Rates from text, as `--rates` takes them: a hardware name of `HARDWARE`
    (`tpu_v4`), optionally followed by `key=value` pairs in SI units that replace its
    figures (`tpu_v4,latency=2e-5`), or pairs alone (`flops=1e12,bandwidth=1e10,
    latency=1e-5`). Keys: flops (flop/s per device), bandwidth (bytes/s a device sends,
    every collective kind) or one kind's rate (psum, psum_scatter, all_gather,
    all_to_all, ppermute), latency (s per collective), memory (bytes per device),
    overhead (s per step). `bandwidth` and then one kind's key set that kind apart; a key
    given twice is an error. RatesError names the part at fault."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise RatesError(
            f"rates {text!r}: expected a hardware name ({', '.join(HARDWARE)}) or key=value pairs"
        )
    fields: dict = {"name": text, "bytes_per_s": {}, "source": "given"}
    if "=" not in parts[0]:
        fields = {**_stored(hardware(parts[0])), "name": text}
        parts = parts[1:]
    pairs = [_pair(text, part) for part in parts]
    given = [key for key, _ in pairs]
    twice = sorted({k for k in given if given.count(k) > 1})
    if twice:
        raise RatesError(f"rates {text!r}: {', '.join(twice)} given more than once")
    for key, value in pairs:
        if _KEYS[key] != "bytes_per_s":
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
    return {**asdict(r), "bytes_per_s": dict(r.bytes_per_s)}


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
