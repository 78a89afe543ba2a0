"""Peak memory per device of a training step, the ideal it is held against, and why
a row misses it.

`peak_bytes` reads XLA's memory analysis of a compiled step. `ideal_bytes` derives
what one device must hold from the model's traced graph and the layout, not from
what jax or XLA happen to keep. `CAUSES` names, per (model kind, layout name), what
the compiled step holds beyond the ideal (`REASONS`), found with
`temporaries_at_peak` (XLA's buffer assignment and live ranges) and by compiling
variants of the step.
"""

from __future__ import annotations

import math
import re
import tempfile
from pathlib import Path

import namedmesh as nm
from lowering import Mesh
from lowering.layout import local_shape
from lowering.lower import rule_layouts
from lowering.memory import active_values, backward_reads


def peak_bytes(compiled) -> int:
    """Per-device peak from XLA's memory analysis: arguments + outputs + temporaries,
    less the outputs that reuse argument buffers."""
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)  # fmt: skip


def ideal_bytes(loss, params: dict, x: nm.Tensor, mesh: dict, rules: str) -> int:
    """Bytes one device must hold for a step that returns the gradients of `loss(params,
    x)` (no optimizer state): its shards of the parameters, of their gradients (laid out
    alike) and of x, plus its shards of the activations the backward pass reads, each
    counted once and not when it is a parameter or x; every value of the traced graph
    is divided as the layout's rules divide it (the layout namedmesh's planner wants
    for it). The activations are those textbook reverse mode keeps per primitive (its
    declared `least_reads`, else `backward_reads`: lowering.memory.backward_reads), not
    jax's choice of residuals; a step can hold less only by recomputing or by putting
    activations in the gradients' buffers before writing them. Scan bodies are not
    looked into (the benchmarked models have none)."""
    mesh_ = Mesh(mesh, devices="abstract")
    graph = nm.trace(loss, params, x)
    layouts = rule_layouts(graph, mesh_, rules)
    replicated = lambda v: ((),) * len(v.dims)  # a constant
    lay = lambda v: layouts.get(v) or replicated(v)
    local = lambda v: math.prod(local_shape(lay(v), v.shape, mesh_)) * v.dtype.itemsize
    *weights, data = graph.inputs  # x is the last input leaf
    needs_grad, kept = active_values(graph, set(weights)), set()
    for e in graph.eqns:
        kept |= backward_reads(e, needs_grad, least=True)
    kept -= set(graph.inputs)
    return 2 * sum(map(local, weights)) + local(data) + sum(map(local, kept))


# Why a row's peak is more than 10% off the ideal, by (model kind, layout name): names
# of REASONS. Found by reading the temporaries live at XLA's worst instruction
# (`temporaries_at_peak`) for every row, namedmesh's and GSPMD's, and by compiling each
# step again with the mesh axes that split only the batch set to 1 (the batch divided
# by them), which removes the gradient all-reduce and leaves the rest.
CAUSES = {
    ("mlp", "data-parallel"): ("gradient all-reduce",),
    ("mlp", "model-parallel"): ("small output",),
    ("mlp", "2d"): ("gradient all-reduce",),
    ("mlp", "fsdp"): ("FSDP",),
    ("mlp", "3d"): ("FSDP", "gradient all-reduce"),
    ("attention", "data-parallel"): ("softmax",),
    ("attention", "model-parallel"): ("replicated", "softmax"),
    ("attention", "2d"): ("replicated", "softmax"),
    ("attention", "sequence-parallel"): ("softmax", "gathered x", "packing"),
    ("attention", "3d"): ("softmax", "gathered x"),
    ("layer", "data-parallel"): ("softmax", "GELU"),
    ("layer", "model-parallel"): ("replicated", "softmax"),
    ("layer", "2d"): ("replicated", "softmax"),
    ("layer", "fsdp"): ("FSDP", "softmax", "GELU"),
    ("layer", "sequence-parallel"): ("softmax", "GELU", "gathered x"),
    ("layer", "3d"): ("softmax", "GELU", "gathered x"),
    ("moe", "data-parallel"): ("gradient all-reduce",),
    ("moe", "expert-parallel"): ("expert hidden",),
    ("moe", "2d expert-parallel"): ("expert hidden", "gradient all-reduce"),
    ("moe", "3d"): ("expert hidden", "gradient all-reduce"),
}
REASONS = {
    "gradient all-reduce": "XLA:CPU all-reduces the gradients over the axes that split "
    "only the batch out of place, in one all-reduce combined at the end of the step, so "
    "every un-reduced gradient is a temporary beside the outputs: as many bytes again as "
    "the all-reduced gradients. Compiled with those axes set to 1 (no all-reduce), the "
    "MLP and moe data-parallel steps come to within a few percent of the ideal",
    "FSDP": "the backward pass holds full-size weight matrices that the layout divides: "
    "gathered weights and full-size gradients before their reduce-scatter, two at once "
    "(in the MLP, XLA computes wi's full gradient before reduce-scattering wo's, which "
    "waits in a transposed copy); the forward pass holds one gathered weight at a time "
    "(GSPMD holds more in the MLP)",
    "softmax": "the attention matrix (batch, heads, length, length; the device's shard) "
    "is live several times in the backward pass where the ideal keeps it once: at the "
    "full size, the probabilities, the un-normalised exponentials from which XLA "
    "recomputes them (fused) in the softmax's backward, and their cotangent. XLA:CPU's "
    "fusion choices, and so the count, change with the length; it is so on one device too",
    "GELU": "in the FFN's backward pass XLA keeps GELU's tanh beside its input, and two "
    "(batch, length, d_ff) cotangents are live with them, where the ideal keeps GELU's "
    "input and output",
    "replicated": "Megatron splits heads and d_ff, not the (batch, length, d_model) values, "
    "which are whole on every device of the model axis, and the backward pass holds more "
    "of them at once than the ideal keeps: the output's cotangent and a transposed copy "
    "of it for the output projection's gradient (attention); the residual stream beside "
    "the LayerNorm's intermediates and the FFN all-reduce's result (layer)",
    "gathered x": "sequence parallelism gathers x over the length axis for the keys and "
    "values and keeps the gathered copy (every position) through the backward pass for "
    "their weight gradients; the ideal has x divided by length",
    "expert hidden": "the experts' hidden layer (experts, capacity, d_ff; the device's "
    "shard) is live three times in the backward pass where the ideal keeps relu's output "
    "once: relu's input (XLA's derivative compares it with 0), a transposed copy of the "
    "output for wo's gradient, and its cotangent",
    "small output": "at the smallest size only, where the weights are small: the output's "
    "cotangent and the forward all-reduce's result, each a replicated (batch, d_model), "
    "are temporaries",
    "packing": "namedmesh only: XLA packs its temporaries with slack, their arena larger "
    "than the most bytes live at once, where GSPMD's has none",
}


def causes(kind: str, layout: str) -> tuple[str, ...]:
    """The REASONS that explain the gap of `kind` (mlp, attention, layer, moe) under the
    layout named `layout`; () where none is known."""
    return CAUSES.get((kind, layout), ())


def temporaries_at_peak(lowered) -> tuple[int, int, list[tuple[int, str, str]]]:
    """Compile `lowered` (a jax Lowered) with XLA's dumps on and read the buffer
    assignment and live ranges of its temporaries (the arena that memory_analysis's
    temp_size counts; arguments and outputs have buffers of their own). Returns the
    arena's bytes, the most bytes of temporaries live at one instruction (an op's
    operands and result both count: an upper bound where XLA runs it in place), and the
    temporaries live then, largest first, as (bytes, shape, the jax op that made it).
    Arena minus live, where positive, is XLA's packing slack. A diagnostic for finding a gap's cause
    (`python -m benchmarks.memory`); it parses XLA's debug text, so it may need updating
    with XLA, and the benchmark does not run it."""
    with tempfile.TemporaryDirectory() as d:
        lowered.compile(compiler_options={"xla_dump_to": d})
        ranges = sorted(Path(d).glob("*after_optimizations-live-range.txt"))[-1]
        read = lambda suffix: Path(str(ranges).replace("-live-range", suffix)).read_text()
        text, hlo, assignment = ranges.read_text(), read(""), read("-buffer-assignment")
    arena, temps = 0, {}  # value name -> bytes, for the values in the temporaries' arena
    for block in assignment.split("\nallocation ")[1:]:
        if "preallocated-temp" in block.split("\n")[0]:
            arena = int(re.match(r"\d+: size (\d+)", block).group(1))
            for name, index, size in re.findall(
                r"value: <\d+ (\S+?)(\{[^}]*\})? @\d+> \(size=(\d+)", block
            ):
                temps[name + (index or "{}")] = int(size)
    live_range = {
        n: (int(a), int(b))
        for n, a, b in re.findall(r"^\s+(\S+\{[^}]*\}):(\d+)-(\d+)$", text, re.M)
    }
    at = lambda t: [
        n for n in temps if n in live_range and live_range[n][0] <= t <= live_range[n][1]
    ]
    worst = max(range(max((b for _, b in live_range.values()), default=0) + 1),
                key=lambda t: sum(temps[n] for n in at(t)))  # fmt: skip
    made = {}  # instruction -> (shape, op_name)
    for line in hlo.splitlines():
        if m := re.match(r"\s*(?:ROOT )?%(\S+) = (\S+) ", line):
            op = re.search(r'op_name="([^"]*)"', line)
            made[m.group(1)] = (m.group(2), op.group(1).replace("jit(<lambda>)/", "") if op else "")
    live = sorted(
        ((temps[n], *made.get(n.split("{")[0], ("?", ""))) for n in at(worst)), reverse=True
    )
    return arena, sum(b for b, *_ in live), live


def _main(argv: list[str]) -> None:
    """`python -m benchmarks.memory KIND LAYOUT [gspmd]`: for each size of model KIND
    under the layout named LAYOUT, the peak, the ideal, and the temporaries live at
    once at the worst instruction."""
    from benchmarks import cases, steps

    kind, name, impl = (*argv, "namedmesh")[:3]
    for model in [m for m in cases.models("full") if m.kind == kind]:
        for case in [c for c in model.cases if c.name == name]:
            params, x = model.inputs()
            fn, args = getattr(steps, f"{impl}_step")(model.loss, params, x, case.mesh, case.rules)
            lowered = fn.lower(*args)
            arena, total, live = temporaries_at_peak(lowered)
            print(f"{model.name}, {case.name} on {case.mesh}, {impl}: peak "
                  f"{peak_bytes(lowered.compile()):,}, ideal "
                  f"{ideal_bytes(model.loss, params, x, case.mesh, case.rules):,}, temporaries "
                  f"{arena:,}, of them live at once at most {total:,}:")  # fmt: skip
            for b, shape, op in live:
                print(f"  {b:>12,}  {shape:32s} {op}")


if __name__ == "__main__":
    import os
    import sys

    # read when jax starts its backend, at the first device used, not at import
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    _main(sys.argv[1:])
