"""`auto_layout`: the rule set with the least estimated step time that fits memory.

Candidates give each mesh axis to one dim of the program, to a pair of dims that no
value has together (Megatron's `heads` and `d_ff` share the model axis), or to none;
two axes on one dim make a multi-axis rule. Each candidate is planned (no compilation) and
costed from its report: time = flops / flops_per_s + collective bytes / bytes_per_s,
of the forward pass, and with `grad_argnums` (the inputs trained) of the backward pass
too, gradient syncs included (`Lowered.report(wrt=...)`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import namedmesh as nm
from lowering.layout import Layout
from lowering.lower import lower
from lowering.mesh import Mesh
from namedmesh.errors import LayoutError


@dataclass
class Candidate:
    layout: Layout
    flops: float = math.nan
    bytes: float = math.nan
    memory: int = 0
    time: float = math.inf
    note: str = ""


class Search(list):
    """The candidates weighed, best first; `str()` is a table."""

    def __str__(self) -> str:
        rows = [f"{'layout':<40} {'flops':>12} {'bytes':>12} {'memory':>10} {'time (s)':>10}  note"]
        for c in self:
            rows.append(
                f"{str(c.layout.rules and repr(c.layout)[8:-2]) or '(replicated)':<40} "
                f"{c.flops:>12.3g} {c.bytes:>12.3g} {c.memory:>10} {c.time:>10.3g}  "
                f"{c.note}"
            )
        return "\n".join(rows)


def _options(graph) -> list[tuple[str, ...]]:
    """What one mesh axis may split: nothing, one dim, or two dims never in one value."""
    values = [v.dims for v in graph.values()]
    dims = list(dict.fromkeys(d for v in values for d in v))
    together = {frozenset(p) for v in values for p in itertools.combinations(v, 2)}
    pairs = [p for p in itertools.combinations(dims, 2) if frozenset(p) not in together]
    return [(), *((d,) for d in dims), *pairs]


def auto_layout(
    fn,
    mesh: Mesh,
    *inputs,
    memory_limit: int | None = None,
    grad_argnums: tuple[int, ...] = (),
    flops_per_s: float = 1e14,
    bytes_per_s: float = 1e11,
) -> tuple[Layout, Search]:
    """Search layouts for `fn(*inputs)` on `mesh`; returns the best Layout and the table."""
    graph = nm.trace(fn, *inputs)
    options = _options(graph)
    axes = list(mesh.sizes)
    table = Search()
    for choice in itertools.product(options, repeat=len(axes)):
        rules: dict[str, tuple[str, ...]] = {}
        for a, ds in zip(axes, choice, strict=True):
            for d in ds:
                rules[d] = rules.get(d, ()) + (a,)
        cand = Candidate(Layout(list(rules.items())))
        table.append(cand)
        try:
            wrt = grad_argnums or None
            rep = lower(fn, mesh, cand.layout).report(*inputs, wrt=wrt, show=False)
        except LayoutError as e:
            cand.note = f"invalid: {str(e).split(':', 1)[-1].strip()[:60]}"
            continue
        cand.flops = rep.flops + rep.backward_flops
        cand.bytes, cand.memory = rep.bytes + rep.backward_bytes, rep.peak_memory
        cand.time = cand.flops / flops_per_s + cand.bytes / bytes_per_s
        if memory_limit is not None and cand.memory > memory_limit:
            cand.note, cand.time = f"over memory limit {memory_limit}", math.inf
    table.sort(key=lambda c: (c.time, c.bytes, len(c.layout.rules)))
    best = table[0]
    if not math.isfinite(best.time):
        raise LayoutError(
            f"auto_layout: no layout on {mesh} is valid and fits memory_limit={memory_limit}"
        )
    best.note = (best.note + " chosen: least estimated time").strip()
    return best.layout, table
