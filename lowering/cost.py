"""The cost report of a plan: per-device flops, collective bytes and peak memory.

Collective traffic per device follows ring algorithms over n devices, with S the
bytes each device contributes: all-reduce (psum, pmax, pmin) 2(n-1)/n S, reduce-scatter
(psum_scatter) (n-1)/n S, all-gather (n-1) S (= (n-1)/n of the gathered output),
all-to-all (n-1)/n S, a ppermute S.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_TRAFFIC = {
    "psum": lambda n, s: 2 * (n - 1) / n * s,
    "pmax": lambda n, s: 2 * (n - 1) / n * s,
    "pmin": lambda n, s: 2 * (n - 1) / n * s,
    "psum_scatter": lambda n, s: (n - 1) / n * s,
    "all_gather": lambda n, s: (n - 1) * s,
    "all_to_all": lambda n, s: (n - 1) / n * s,
    "ppermute": lambda n, s: s,
}
# The HLO op each collective becomes, and its result bytes from the bytes S put in by
# each of n devices.
_HLO = {
    "psum": ("all-reduce", lambda n, s: s),
    "pmax": ("all-reduce", lambda n, s: s),
    "pmin": ("all-reduce", lambda n, s: s),
    "psum_scatter": ("reduce-scatter", lambda n, s: s // n),
    "all_gather": ("all-gather", lambda n, s: s * n),
    "all_to_all": ("all-to-all", lambda n, s: s),
    "ppermute": ("collective-permute", lambda n, s: s),
}


def expected_hlo(plan, sizes) -> list[tuple[str, int, int]]:
    """(HLO kind, result bytes, group size) of every collective the plan issues, as
    `lowering.hlo.collectives` reads them from compiled HLO (permutes have no groups).
    A scan's body is counted once, as its loop holds it once."""
    out = []
    for step in plan:
        for kind, axes, nbytes in step.collectives:
            n = math.prod(sizes[a] for a in axes)
            hlo, result = _HLO[kind]
            out.append((hlo, result(n, nbytes), 0 if kind == "ppermute" else n))
    return out


def traffic(kind: str, axes: tuple[str, ...], nbytes: int, sizes: dict[str, int]) -> float:
    """Bytes one device sends for one collective (ring algorithms)."""
    return _TRAFFIC[kind](math.prod(sizes[a] for a in axes), nbytes)


@dataclass
class Report:
    """Per-device cost of one call of a lowered program."""

    flops: float
    collectives: dict = field(default_factory=dict)  # (kind, axes) -> (count, bytes sent)
    peak_memory: int = 0  # bytes: inputs + the most live values at once, per device

    @property
    def bytes(self) -> float:
        return sum(b for _, b in self.collectives.values())

    def __str__(self) -> str:
        lines = [
            f"per-device flops: {self.flops:,.0f}",
            f"per-device peak memory (estimate): {self.peak_memory:,} bytes",
            f"per-device collective bytes sent: {self.bytes:,.0f}",
        ]
        for (kind, axes), (count, b) in sorted(self.collectives.items()):
            lines.append(f"    {kind:<13} over {','.join(axes):<12} x{count}: {b:,.0f} bytes")
        return "\n".join(lines)


def report(plan, graph, local_bytes, sizes) -> Report:
    """The Report of `plan`; `local_bytes(v)` is the per-device size of a graph value."""
    flops = 0.0
    coll: dict = {}
    for step in plan:
        for prim, params, ins, outs in step.local:
            flops += prim.cost_rule(ins, outs, params).flops * step.repeat
        for kind, axes, nbytes in step.collectives:
            count, b = coll.get((kind, axes), (0, 0.0))
            sent = traffic(kind, axes, nbytes, sizes) * step.repeat
            coll[(kind, axes)] = (count + step.repeat, b + sent)
    return Report(flops, coll, _peak_memory(graph, local_bytes))


def _peak_memory(graph, local_bytes) -> int:
    """Inputs and constants held throughout; each intermediate from its equation to its
    last use (results to the end)."""
    last = {v: len(graph.eqns) for v in graph.outputs}
    for i, e in enumerate(graph.eqns):
        for v in e.inputs:
            last[v] = max(last.get(v, i), i)
    base = sum(local_bytes(v) for v in graph.inputs) + sum(local_bytes(v) for v in graph.consts)
    live, peak = 0, base
    ends: dict[int, int] = {}
    for i, e in enumerate(graph.eqns):
        for v in e.outputs:
            live += local_bytes(v)
            ends[last.get(v, i)] = ends.get(last.get(v, i), 0) + local_bytes(v)
        peak = max(peak, base + live)
        live -= ends.pop(i, 0)
    return int(peak)
