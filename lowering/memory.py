"""The per-device peak-memory estimate of a lowered program: of its forward pass
(inputs and the most values live at once) and of a training step (`training_peak`:
inputs, gradients, the values saved for the backward pass as each scan's remat policy
keeps them, and one recomputed iteration's working set).

`local_bytes(v)` gives the per-device bytes of a graph value under the plan's layout.
"""

from __future__ import annotations

import functools
import weakref

from namedmesh.primitive import (
    READS_BOTH,
    READS_CONSTANT,
    READS_INPUTS,
    READS_OTHERS,
    READS_OUTPUT,
    is_inexact,
)


def per_graph(fn):
    """`fn(graph, *args)` (hashable args), kept per graph while it lives: what depends
    on the program alone, not on the layout, is found once for all the candidate
    layouts auto_layout costs. Callers must not change the result."""
    cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @functools.wraps(fn)
    def cached(graph, *args):
        known = cache.setdefault(graph, {})
        if args not in known:
            known[args] = fn(graph, *args)
        return known[args]

    return cached


def active_values(graph, active: set) -> set:
    """The values of `graph` a gradient flows through from the `active` inputs: the
    inexact values computed from them, except through stop_gradient. A scan's carries
    are active once any iteration makes them so."""
    return set(_active_values(graph, frozenset(active)))


@per_graph
def _active_values(graph, active: frozenset) -> set:
    active = set(active)
    for e in graph.eqns:
        flows = [v in active for v in e.inputs]
        if e.primitive.loop:
            active |= _active_scan(e, flows)
        elif any(flows) and not e.primitive.stops_gradient:
            active |= {v for v in e.outputs if is_inexact(v.dtype)}
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


def backward_reads(e, active: set, least: bool = False) -> set:
    """The values of equation `e` its backward pass reads (what reverse mode saves for
    it) of its inputs and outputs, as its primitive declares (`backward_reads`; the
    values made inside it that it saves, `backward_saves`, are counted apart); none when no gradient
    flows through `e` (no input in `active`). A scan's are its body's (`_scan_saved`).
    `least`: what textbook reverse mode must read at the least (`least_reads`)."""
    ins = e.inputs
    if not any(v in active for v in ins):
        return set()
    reads = e.primitive.backward_reads
    if least and e.primitive.least_reads is not None:
        reads = e.primitive.least_reads
    if reads == READS_OTHERS:
        return {u for i, v in enumerate(ins) if v in active for u in ins[:i] + ins[i + 1 :]}
    if reads == READS_CONSTANT:
        return {v for v in ins if v not in active}
    return {
        READS_INPUTS: set(ins),
        READS_OUTPUT: set(e.outputs),
        READS_BOTH: set(ins) | set(e.outputs),
    }.get(reads, set())


def training_peak(graph, local_bytes, active: set, wrt, shares: dict | None = None) -> int:
    """Per-device bytes of a step that returns the gradients of `wrt`: the inputs, the
    gradients, the values the backward pass reads (each primitive's `backward_reads`,
    each value once), of a scan's body as its `remat` policy keeps them (every
    iteration's; only the carry; the carry and the matmul outputs), and the largest
    working set of the backward pass: the cotangents of one equation's inputs and
    outputs, and under remat one iteration's recomputed values. `shares` {scan Eqn:
    float} scales what a scan saves: a pipelined one's device keeps that share
    (`PipelinePlan.activation_share`)."""
    held = {*graph.inputs, *graph.consts}
    base = sum(local_bytes(v) for v in held)
    saved, working = _saved(graph, local_bytes, active, held, shares=shares or {})
    return int(base + sum(local_bytes(v) for v in wrt) + saved + working)


def _saved(
    graph, local_bytes, active: set, held: set, intermediates=True, shares=None
) -> tuple[int, int]:
    """(bytes of the graph's values its backward pass reads, less the `held` ones (held
    anyway), the largest working set of its backward pass). `intermediates`: count the values
    made inside elementwise primitives (`backward_saves`) too; in an iteration
    recomputed under remat nothing makes XLA store them (they are not stacked for
    later iterations), so it fuses their recomputation into the backward pass's ops.
    A softmax's exponentials it stores either way (its sum is a reduction)."""
    saved, working, kept = 0, 0, set()
    active = active & _reaching(graph)
    for e in graph.eqns:
        if e.primitive.loop:
            scan_kept, work = _scan_saved(e, local_bytes, active)
            scan_kept *= (shares or {}).get(e, 1.0)
            saved, working = saved + scan_kept, max(working, work)
        kept |= backward_reads(e, active)
        stored = intermediates or not e.primitive.elementwise
        if stored and e.primitive.backward_saves and any(v in active for v in e.inputs):
            saved += e.primitive.backward_saves * local_bytes(e.inputs[0])
        cotangents = [v for v in (*e.inputs, *e.outputs) if v in active]
        working = max(working, sum(local_bytes(v) for v in cotangents))
    return saved + sum(local_bytes(v) for v in kept - held), working


@per_graph
def _reaching(graph) -> set:
    """The values of `graph` its outputs depend on other than through stop_gradient: a
    gradient flows back to these only (the max under an online softmax's stop_gradient
    has no backward pass)."""
    reach = set(graph.outputs)
    for e in reversed(graph.eqns):
        if not e.primitive.stops_gradient and reach.intersection(e.outputs):
            reach.update(e.inputs)
    return reach


def _scan_saved(e, local_bytes, active: set) -> tuple[int, int]:
    body, nc, n = e.params["body"], e.params["n_carry"], e.params["length"]
    inner = active_values(
        body, {b for b, v in zip(body.inputs, e.inputs, strict=True) if v in active}
    )
    # the scanned slices and the shared inputs are held whole outside the loop
    held = set(body.inputs[nc:]) | set(body.consts)
    remat = e.params.get("remat", "none")
    per_step, work = _saved(body, local_bytes, inner, held, intermediates=remat == "none")
    carry = sum(local_bytes(v) for v in body.inputs[:nc])
    if remat == "none":
        return n * per_step, work
    dots = sum(
        local_bytes(v) for b in body.eqns if b.primitive.matmul for v in b.outputs if v in inner
    )
    return n * (carry + (dots if remat == "dots" else 0)), per_step + work
