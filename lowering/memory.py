"""The per-device peak-memory estimate of a lowered program: of its forward pass
(inputs and the most values live at once) and of a training step (`training_peak`:
inputs, gradients, the values saved for the backward pass as each scan's remat policy
keeps them, and one recomputed iteration's working set).

`local_bytes(v)` gives the per-device bytes of a graph value under the plan's layout.
"""

from __future__ import annotations

import jax.numpy as jnp


def active_values(graph, active: set) -> set:
    """The values of `graph` a gradient flows through from the `active` inputs: the
    inexact values computed from them, except through stop_gradient. A scan's carries
    are active once any iteration makes them so."""
    active = set(active)
    for e in graph.eqns:
        flows = [v in active for v in e.inputs]
        if e.primitive.name == "scan":
            active |= _active_scan(e, flows)
        elif any(flows) and e.primitive.name != "stop_gradient":
            active |= {v for v in e.outputs if jnp.issubdtype(v.dtype, jnp.inexact)}
    return active


def _active_scan(e, flows: list) -> set:
    body, nc = e.params["body"], e.params["n_carry"]
    carry = flows[:nc]
    while True:
        inner = active_values(
            body, {b for b, f in zip(body.inputs, carry + flows[nc:], strict=True) if f}
        )
        grown = [c or v in inner for c, v in zip(carry, body.outputs[:nc], strict=True)]
        if grown == carry:
            break
        carry = grown
    outs = carry + [v in inner for v in body.outputs[nc:]]
    return inner | {v for v, f in zip(e.outputs, outs, strict=True) if f}


def peak_memory(graph, local_bytes) -> int:
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


def training_peak(graph, local_bytes, active: set, wrt) -> int:
    """Per-device bytes of a step that returns the gradients of `wrt`: the inputs, the
    gradients, every value a gradient flows through (saved by the forward pass for the
    backward one), of a scan's body as its `remat` policy keeps it (all of it per
    iteration; only the carry; the carry and the matmul outputs), and the working set
    of one iteration that the backward pass recomputes."""
    base = sum(local_bytes(v) for v in (*graph.inputs, *graph.consts))
    saved, working = _saved(graph, local_bytes, active)
    return int(base + sum(local_bytes(v) for v in wrt) + saved + working)


def _saved(graph, local_bytes, active: set) -> tuple[int, int]:
    """(bytes of the graph's values saved for the backward pass, the largest working set
    of one scan iteration's backward pass)."""
    saved, working = 0, 0
    for e in graph.eqns:
        if e.primitive.name == "scan":
            kept, work = _scan_saved(e, local_bytes, active)
            saved, working = saved + kept, max(working, work)
        saved += sum(local_bytes(v) for v in e.outputs if v in active)
    return saved, working


def _scan_saved(e, local_bytes, active: set) -> tuple[int, int]:
    body, nc, n = e.params["body"], e.params["n_carry"], e.params["length"]
    inner = active_values(
        body, {b for b, v in zip(body.inputs, e.inputs, strict=True) if v in active}
    )
    per_step, work = _saved(body, local_bytes, inner)
    carry = sum(local_bytes(v) for v in body.inputs[:nc])
    remat = e.params.get("remat", "none")
    if remat == "none":
        return n * per_step, work
    dots = sum(
        local_bytes(v) for b in body.eqns if b.primitive.matmul for v in b.outputs if v in inner
    )
    return n * (carry + (dots if remat == "dots" else 0)), per_step + work
