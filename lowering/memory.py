"""The per-device peak-memory estimate of a lowered program: of its forward pass
(inputs and the most values live at once) and of a training step (`training_peak`:
inputs, gradients, and where the backward pass peaks, the saved values it has not yet
read, as each scan's remat policy keeps them, beside its working set there, remat's
recomputed iteration included), and the forward pass of such a step
(`training_forward`: what the backward will read, made so far, beside what an op holds
while it runs). An operand a step gathers before its local op (an FSDP weight) is saved
and has its cotangent at its gathered size (`Read`). What a primitive declares its jax
implementation makes inside it is found at its local op's shapes (`Made`).

`local_bytes(v)` gives the per-device bytes of a graph value under the plan's layout.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax

from lowering.caches import per_object
from namedmesh.control import UNROLL_BUDGET, equations
from namedmesh.primitive import (
    READS_BOTH,
    READS_CONSTANT,
    READS_INPUTS,
    READS_OTHERS,
    READS_OUTPUT,
    is_inexact,
)
from namedmesh.trace import evaluate


class Read(NamedTuple):
    """Input `k` (the value `v`) of equation `e` as its local op reads it: gathered
    (an FSDP weight, a sequence-split key) it is a buffer of its own, larger than its
    layout's shard, which the backward pass saves for `e` (jax's residual is the
    gathered operand) and whose cotangent it makes at that size before reducing it.
    `extra`: the bytes beyond `v`'s own shard (a saved term: the shard is held or
    saved apart); else all of them (a working-set cotangent). Sized by
    `training_parts`' `reads`; without one, as `v`'s shard."""

    e: object
    k: int
    v: object
    extra: bool


class Operand(NamedTuple):
    """Input `k` (the value `v`) of equation `e` as its forward pass reads it, live
    while `e` runs: the bytes beyond `v`'s shard where the plan gathers it (an FSDP
    weight), else none. Sized by `training_parts`' `reads`."""

    e: object
    k: int
    v: object


class Made(NamedTuple):
    """What the jax implementation of equation `e` makes inside it, as its primitive
    declares it: `factor` times the bytes of `v` (its first input), or a function of
    the inputs and params giving that factor (`backward_saves`, `backward_working`,
    `forward_working`: a grouped FFN's sorted rows and products), found at the shapes
    its local op runs on where the plan says them (`_sizer`): a kernel's buffers are
    rounded up per device (the grouped FFN's rows to its blocks)."""

    factor: float | object
    v: object
    e: object = None


def active_values(graph, active: set) -> set:
    """The values of `graph` a gradient flows through from the `active` inputs: the
    inexact values computed from them, except through stop_gradient. A scan's carries
    are active once any iteration makes them so."""
    return set(_active_values(graph, frozenset(active)))


def live_values(graph) -> set:
    """The values of `graph` a gradient of its outputs reaches: back from its inexact
    outputs through every equation but stop_gradient, to inexact inputs only (a
    comparison's or a cast's integer or bool input ends the path; a scan is passed
    whole: all its inexact inputs once any of its outputs is reached)."""
    live = {v for v in graph.outputs if is_inexact(v.dtype)}
    for e in reversed(graph.eqns):
        if not e.primitive.stops_gradient and any(v in live for v in e.outputs):
            live |= {v for v in e.inputs if is_inexact(v.dtype)}
    return live


@per_object  # of the program alone, not of the layout: once for all candidates
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
    held, schedule = _lifetimes(graph)
    base = sum(map(local_bytes, held))
    live, peak = 0, base
    for made, freed in schedule:
        live += sum(map(local_bytes, made))
        peak = max(peak, base + live)
        live -= sum(map(local_bytes, freed))
    return int(peak)


@per_object
def _last_readers(graph) -> dict:
    """Each value's last reader, an equation's index: len(eqns) for the graph's results
    (never freed); a value no equation reads is absent."""
    last = {v: len(graph.eqns) for v in graph.outputs}
    for i, e in enumerate(graph.eqns):
        for v in e.inputs:
            last[v] = max(last.get(v, i), i)
    return last


@per_object
def _lifetimes(graph) -> tuple[tuple, tuple]:
    """(the values held throughout: inputs, then constants; per equation, (the values it
    makes, the values whose last use it is)), results never freed."""
    last = _last_readers(graph)
    ends: dict[int, list] = {}
    for i, e in enumerate(graph.eqns):
        for v in e.outputs:
            ends.setdefault(last.get(v, i), []).append(v)
    held = (*graph.inputs, *graph.consts)
    return held, tuple((tuple(e.outputs), tuple(ends.get(i, ()))) for i, e in enumerate(graph.eqns))


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


def training_peak(graph, local_bytes, active: set, wrt, shares: dict | None = None,
                  reads=None) -> int:  # fmt: skip
    """Per-device bytes of a step that returns the gradients of `wrt`: the inputs, the
    gradients, and the most the backward pass holds at once (`_peak`): at an equation,
    the values it and the equations before it saved for the backward pass (each
    primitive's `backward_reads`, each value once; of a scan's body as its `remat`
    policy keeps them: every iteration's; only the carry; the carry and the matmul
    outputs) beside that equation's working set (the cotangents of its inputs and
    outputs, and what its backward makes inside it, `Made`; a scan's, under remat one
    recomputed iteration's values beside its working set). What the equations after
    it saved is read and freed by then (a loss head's, before the layer stack's
    backward runs). `shares` {scan Eqn: float} scales
    what a scan saves: a pipelined one's device keeps that share
    (`PipelinePlan.activation_share`)."""
    return int(sum(training_parts(graph, local_bytes, active, wrt, shares, reads).values()))


def training_parts(graph, local_bytes, active: set, wrt, shares: dict | None = None,
                   reads=None, cpu: bool = False, local_ins=None) -> dict:  # fmt: skip
    """`training_peak`'s terms apart, in bytes per device: `inputs` (the parameters and
    the batch, held throughout), `gradients` (of `wrt`), `saved` (what the backward pass
    has yet to read where it peaks) and `working` (its working set there, with remat's
    recomputed iteration). `reads(e, k)`: the bytes per device of input `k` of equation
    `e` as its local op reads it (None: as its layout has it; `Read`). `cpu`: the
    program runs on XLA:CPU, which holds its low-precision intermediates in float32
    (`cpu_bytes`). `local_ins(e)`: the input avals of `e`'s local op, at which a
    primitive's declared buffers are found (`Made`; None: at the graph's shapes)."""
    held = frozenset((*graph.inputs, *graph.consts))
    base = sum(local_bytes(v) for v in held)
    terms = _saved_terms(graph, frozenset(active), held, False, False)
    size = _sizer(local_bytes, reads, local_ins)
    size = cpu_bytes(size, _converted(graph)) if cpu else size
    saved, working = _peak(terms, size, shares or {})
    grads = sum(local_bytes(v) for v in wrt)
    return {"inputs": base, "gradients": grads, "saved": saved, "working": working}


def training_forward(graph, local_bytes, active: set, shares: dict | None = None,
                     reads=None, cpu: bool = False, local_ins=None) -> int:  # fmt: skip
    """The most the forward pass of a training step holds at once beside its inputs,
    in bytes per device (`_forward`: at an equation, the values the backward pass will
    read that the equations before it made, the others until their last reader, and
    what the equation holds while it runs; a scan's stacked saves whole from its start,
    beside one iteration). A step peaks here where its forward holds more than its
    backward and the gradients: in none of docs/benchmarks.md's step rows, against
    XLA's forward within 15% (tests/test_step_memory_edges.py). `training_parts`'
    arguments."""
    held = frozenset((*graph.inputs, *graph.consts))
    steps = _forward_terms(graph, frozenset(active), held, False, False)
    size = _sizer(local_bytes, reads, local_ins)
    size = cpu_bytes(size, _converted(graph)) if cpu else size
    return _forward(steps, size, True, shares or {})


@per_object  # of the program alone, not of the layout: once for all candidates
def _saved_terms(graph, active: frozenset, held: frozenset, fused: bool, loop: bool) -> tuple:
    """What `_saved` and `_peak` sum, as graph values whose bytes the layout decides:
    (per equation in order, (its index, a scan's terms ("scan", eqn, length, remat,
    body terms, carry, matmul outputs, loop invariants) or ("save", factor, value));
    (each value the backward pass reads, less the `held` ones (held anyway), and the
    index of the first equation reading it: its last reader backward, which frees it);
    per equation, its cotangents, live at once).
    `fused`: the graph is an unrolled stack's body, whose elementwise primitives' own
    values (`backward_saves`: gelu's tanh and products) XLA fuses into the backward
    pass's ops (the whole training step's rows in docs/benchmarks.md); elsewhere they
    count.
    `loop`: the graph is the body of a scan that runs as a loop, one XLA computation
    per iteration: a primitive that declares what it must read at the least
    (`least_reads`) holds just that (a softmax its probabilities, which the einsum
    after it reads too: one buffer; unrolled, XLA keeps the logits beside them).
    A scan's body (`fused` or `loop`: a loop's, remat's recomputed iteration, an unrolled
    stack's) has an op's backward write its input's cotangent over its output's
    (`_in_place`): at attention's softmax XLA holds the probabilities and one cotangent
    (tiny 1024 full/full, besides the mask; full/none on one device, beside the saved
    values). The top-level program (neither) keeps both at its loss head."""
    in_place = fused or loop
    adds, working, first = [], [], {}
    active = active & _reaching(graph)
    for i, e in enumerate(graph.eqns):
        if e.primitive.loop:
            adds.append((i, _scan_terms(e, active)))
        least = loop and e.primitive.least_reads is not None
        for v in backward_reads(e, active, least):
            if v not in held:
                first.setdefault(v, i)
            if not e.primitive.loop:  # a gathered operand is saved as read, apart
                k = e.inputs.index(v) if v in e.inputs else None
                if k is not None:
                    adds.append((i, ("save", 1, Read(e, k, v, True))))
        stored = not (fused and e.primitive.elementwise) and not least
        if stored and e.primitive.backward_saves and any(v in active for v in e.inputs):
            saves = e.primitive.backward_saves
            what = Made(saves, e.inputs[0], e) if callable(saves) else e.inputs[0]
            adds.append((i, ("save", 1 if callable(saves) else saves, what)))
        made = ()
        if e.primitive.backward_working and any(v in active for v in e.inputs):
            made = (Made(e.primitive.backward_working, e.inputs[0], e),)
        ends = (*e.inputs, *e.outputs)
        if e.primitive.loop and _unrolled(e):  # its layers' cotangents, each its own:
            n = e.params["n_carry"]  # of the carry, beside the body's (`_scan_saved`)
            ends = (*e.inputs[:n], *e.outputs[:n])  # and the gradients themselves
        elif e.primitive.loop:  # a held input's cotangent is its gradient, counted apart
            ends = tuple(v for v in ends if v not in held)
        elif in_place and not e.primitive.matmul:
            ends = _in_place(e, active)
        ends = tuple(v for v in ends if v in active)
        working.append(ends if e.primitive.loop else (*_reads(e, active, ends), *made))
    return tuple(adds), tuple(first.items()), tuple(working)


@per_object  # of the program alone, not of the layout: once for all candidates
def _forward_terms(graph, active: frozenset, held: frozenset, fused: bool, loop: bool) -> tuple:
    """What the forward pass of a graph holds, per equation in order, as `_forward`
    sums it: (what the equation makes that the backward pass reads: its `_saved_terms`
    adds and its outputs among the kept values; its other outputs, each with the index
    of its last forward reader, where the forward frees it (the graph's results: never);
    what it holds only while it runs: its inputs' gathered copies (`Operand`; those the
    backward keeps are counted as kept instead), and its jax implementation's own
    values (`forward_working`, `Made`))."""
    terms = _saved_terms(graph, active, held, fused, loop)
    adds, kept, _ = terms
    keep = {v for v, _ in kept}
    last = _last_readers(graph)
    saves = [[] for _ in graph.eqns]
    for i, add in adds:
        saves[i].append(add)
    steps = []
    for i, e in enumerate(graph.eqns):
        # a gathered operand is read gathered by the forward, saved or not
        during = [] if e.primitive.loop else [Operand(e, k, v) for k, v in enumerate(e.inputs)]
        if e.primitive.forward_working and any(v in active for v in e.inputs):
            during.append(Made(e.primitive.forward_working, e.inputs[0], e))
        made = tuple(v for v in e.outputs if v in keep)
        temp = tuple((v, last.get(v, i)) for v in e.outputs if v not in keep)
        steps.append((tuple(saves[i]), made, temp, tuple(during)))
    return tuple(steps)


def _forward(steps, size, persist: bool, shares: dict) -> int:
    """The most a graph's forward pass holds at once beyond its inputs, of its
    `_forward_terms` `steps`: at each equation, what the equations before it made and
    the forward still holds (the values the backward pass reads, and the others until
    their last forward reader), beside all it makes and what it holds while it runs. A
    scan allocates its stacked saves whole as it starts (XLA's buffers of the MoE rows:
    the layer loop's residual stacks live through its first iteration), scaled by its
    share in `shares`, and runs one iteration's forward beside them (`_scan_forward`).
    `persist`: what the backward reads stays to the end; else (a loop's iteration,
    whose saves go to the scan's stacks) it is freed as made."""
    live, peak, frees = 0, 0, {}
    for i, (saves, made, temp, during) in enumerate(steps):
        keep, now = sum(map(size, made)), sum(map(size, during))
        # a gathered operand the backward keeps is counted once, as kept
        now -= sum(size(a[2]) for a in saves if isinstance(a[2], Read))
        for add in saves:
            if add[0] == "scan":
                stacks, iteration = _scan_saved(add, size)[0], _scan_forward(add, size)
                keep, now = keep + stacks * shares.get(add[1], 1.0), now + iteration
            else:
                keep += round(add[1] * size(add[2]))
        for v, j in temp:
            frees.setdefault(j, []).append(v)
        out = sum(size(v) for v, _ in temp)
        peak = max(peak, live + keep + out + now)
        live += out + (keep if persist else 0) - sum(map(size, frees.pop(i, ())))
    return int(peak)


def _scan_forward(terms, local_bytes) -> int:
    """The most one iteration of a scan (its `_scan_terms` `terms`) holds at once in the
    forward pass beside the scan's stacked saves: its values until their last reader, its
    saves as made (they are written to the stacks, counted apart)."""
    return _forward(terms[8], local_bytes, False, {})


def cpu_bytes(size, converted=frozenset()):
    """`size` of an intermediate as XLA:CPU holds it: a bfloat16 or float16 value as
    float32, but for the `converted` ones (a cast's result: a float32 weight rounded to
    bfloat16 keeps its dtype). Its float normalisation runs the ops it lacks
    low-precision kernels for (the dots among them) in float32, and the values they
    make, the layer loop's stacked residuals too, stay float32: the buffers of a
    bfloat16 Llama step are the float32 step's shapes and dtypes but for the weights'
    bfloat16 copies, and XLA's total is the float32 step's within 1% (the bfloat16 rows
    of docs/benchmarks.md's step-memory section). A program's inputs keep their dtype;
    an accelerator (GPU, TPU) computes in bfloat16 and is not widened."""

    def widened(x):
        v = x.v if isinstance(x, (Read, Made, Operand)) else x
        n, dtype = size(x), v.dtype
        low = is_inexact(dtype) and dtype.itemsize < 4 and v not in converted
        return n * 4 // dtype.itemsize if low else n

    return widened


@per_object  # of the program alone, not of the layout: once for all candidates
def _converted(graph) -> frozenset:
    """The values casts make in `graph` and its scans' bodies."""
    out = set()
    for e in graph.eqns:
        if e.primitive.name == "convert":
            out.update(e.outputs)
        if e.primitive.loop:
            out |= _converted(e.params["body"])
    return frozenset(out)


def _sizer(local_bytes, reads, local_ins=None):
    """`local_bytes` that also sizes a `Read` and an `Operand` by `reads` (the plan's
    local operands), and a `Made` at `local_ins(e)`, its local op's input avals."""

    def size(x):
        if isinstance(x, Made):
            return _made_bytes(x, local_bytes, local_ins)
        if isinstance(x, Operand):
            x = Read(x.e, x.k, x.v, True)
        if not isinstance(x, Read):
            return local_bytes(x)
        own = local_bytes(x.v)
        read = own if reads is None else reads(x.e, x.k)
        read = own if read is None else read
        return max(read - own, 0) if x.extra else max(read, own)

    return size


def _made_bytes(x: Made, local_bytes, local_ins=None) -> int:
    """Bytes per device of `x`: its factor of its first input's bytes, a declared
    function's found at the local op's inputs (`local_ins`) where known."""
    if not callable(x.factor):
        return round(x.factor * local_bytes(x.v))
    ins = None if local_ins is None else local_ins(x.e)
    if ins is None:
        return round(x.factor(x.e.inputs, x.e.params) * local_bytes(x.v))
    first = ins[0]
    return round(x.factor(ins, x.e.params) * math.prod(first.shape) * first.dtype.itemsize)


def _value(x):
    """The graph value a term is of (a `Made`'s first input)."""
    return x.v if isinstance(x, Made) else x


def _reads(e, active: set, values) -> tuple:
    """`values` (of `e`'s inputs and outputs), each input as `e` reads it (`Read`)."""
    pos = {v: k for k, v in enumerate(e.inputs)}
    return tuple(Read(e, pos[v], v, False) if v in pos else v for v in values)


def _in_place(e, active: set) -> tuple:
    """The values whose cotangents `e`'s backward holds at once, less an output whose
    cotangent an input's of its size and dims takes over: the backward of an op that is
    not a matmul is elementwise in that cotangent, and XLA writes it in place of the
    cotangent, which dies there (a softmax's or a scaling's, attention's largest)."""
    ins = [v for v in e.inputs if v in active]
    outs = list(e.outputs)
    for v in ins:
        same = [o for o in outs if (o.dims, o.shape, o.dtype) == (v.dims, v.shape, v.dtype)]
        if same:
            outs.remove(same[0])
    return (*ins, *outs)


def _saved(terms, local_bytes) -> tuple[int, int]:
    """(bytes of all the values its backward pass reads, the largest working set of its
    backward pass), of a graph's `_saved_terms`: what a loop without remat keeps of each
    iteration, stacked, and the most one iteration's backward adds to it."""
    adds, kept, cotangents = terms
    saved, working = 0, 0
    for _, add in adds:
        if add[0] == "scan":
            scan_kept, work = _scan_saved(add, local_bytes)
            saved, working = saved + scan_kept, max(working, work)
        else:
            saved += round(add[1] * local_bytes(add[2]))  # (a factor may be a fraction)
    for values in cotangents:
        working = max(working, sum(map(local_bytes, values)))
    return saved + sum(local_bytes(v) for v, _ in kept), working


def _peak(terms, local_bytes, shares: dict) -> tuple[int, int]:
    """(bytes of the saved values live, the working set) where their sum peaks in the
    backward pass of a graph's `_saved_terms`.
    The backward runs the equations in reverse: when it reaches equation i, what the
    equations after i saved for it has been read and freed (at the first equation that
    reads it, its last reader backward: a loss head's logits are gone before the layer
    stack's backward starts), and what equations up to i saved is live. A scan's saved
    bytes are scaled by its share in `shares`."""
    adds, kept, cotangents = terms
    saved_at = [0] * len(cotangents)  # the bytes whose last backward reader is i
    work = [sum(map(local_bytes, values)) for values in cotangents]
    for i, add in adds:
        if add[0] == "scan":
            scan_kept, inner = _scan_saved(add, local_bytes)
            saved_at[i] += scan_kept * shares.get(add[1], 1.0)
            # a loop's backward holds its own cotangents (its carry's, its stacked
            # outputs', its stacked inputs' that are not the step's gradients) beside
            # one iteration's working set; unrolled, each layer's are within it
            work[i] = work[i] + inner if not _unrolled(add[1]) else max(work[i], inner)
        else:
            saved_at[i] += round(add[1] * local_bytes(add[2]))  # (a factor may be a fraction)
    for v, i in kept:
        saved_at[i] += local_bytes(v)
    live, best = 0, (0, 0)
    for made, w in zip(saved_at, work, strict=True):
        live += made
        if live + w > sum(best):
            best = (live, w)
    return best


@per_object  # of the program alone, not of the layout: once for all candidates
def _reaching(graph) -> set:
    """The values of `graph` its outputs depend on other than through stop_gradient: a
    gradient flows back to these only (the max under an online softmax's stop_gradient
    has no backward pass)."""
    reach = set(graph.outputs)
    for e in reversed(graph.eqns):
        if not e.primitive.stops_gradient and reach.intersection(e.outputs):
            reach.update(e.inputs)
    return reach


def _scan_terms(e, active: set) -> tuple:
    body, nc = e.params["body"], e.params["n_carry"]
    inner = active_values(
        body, {b for b, v in zip(body.inputs, e.inputs, strict=True) if v in active}
    )
    remat = e.params.get("remat", "none")
    unrolled = _unrolled(e)
    # the shared inputs are held whole outside the loop, and so are the scanned slices,
    # but for a loop's forward pass without remat: jax saves each slice its backward
    # reads as a residual, a stacked copy of the scanned input (XLA's buffers of the
    # Megatron table's loop rows: each layer weights' stack twice, beside its gradient's)
    saved = e.params["n_x"] if remat == "none" and not unrolled else 0
    held = frozenset((*body.inputs[nc + saved :], *body.consts))
    # unrolled, the iterations are one program: XLA fuses the elementwise intermediates'
    # recomputation into the backward pass's ops where a loop stores them; and it merges
    # remat's recomputation with the forward pass (nm.scan's `unrolls`), so all is kept
    remat = "none" if unrolled else remat
    terms = _saved_terms(body, frozenset(inner), held, unrolled, not unrolled)
    forward = _forward_terms(body, frozenset(inner), held, unrolled, not unrolled)
    dots = tuple(v for v in _needed_dots(body, terms) if v in inner)
    carry = tuple(body.inputs[:nc])
    products = _stored_products(body, terms) if remat == "dots" else ()
    return ("scan", e, e.params["length"], remat, terms, carry, dots, _invariants(body), forward,
            products)  # fmt: skip


def _stored_products(body, terms) -> tuple:
    """The saves of `body`'s matmul primitives, of its `_saved_terms` `terms`. Remat
    "dots" stores a matmul's own saves with its output, every iteration's
    (`backward_saves`: the grouped FFN's sorted rows and products, made by dots inside
    its kernel; XLA's buffers of a Qwen3-MoE FSDP step: three f32[layers, rows, d]
    stacks), and still recomputes them with the rest of the kernel's forward."""
    return tuple(
        a for i, a in terms[0]
        if a[0] == "save" and not isinstance(a[2], Read) and body.eqns[i].primitive.matmul
    )  # fmt: skip


@per_object  # of the program alone, not of the layout: once for all candidates
def _invariants(body) -> tuple:
    """The values of `body` that no iteration's inputs reach (a causal mask built from
    positions) and an iteration-dependent equation reads: jax computes them once,
    outside the loop, and under remat its backward loop reads them again (XLA's buffer
    assignment: the long sequences' mask held through the backward loop)."""
    varying, made, read = set(body.inputs), set(), set()
    for e in body.eqns:
        if any(v in varying for v in e.inputs):
            varying.update(e.outputs)
            read.update(e.inputs)
        else:
            made.update(e.outputs)
    return tuple(v for e in body.eqns for v in e.outputs if v in made and v in read)


def _needed_dots(body, terms) -> tuple:
    """The matmul outputs of `body` that remat "dots" stores for its backward pass: those
    the backward pass reads (its `_saved_terms` `terms`), or that recomputing a value
    it reads starts from (back through the other equations, to a matmul or an input);
    a matmul's output nothing reads backward (a projection added to the residual) jax
    does not keep."""
    made = {v: e for e in body.eqns for v in e.outputs}
    adds, kept, _ = terms
    todo = [*(v for v, _ in kept), *(_value(a[2]) for _, a in adds if a[0] == "save")]
    todo += [v for _, a in adds if a[0] == "scan" for v in a[1].inputs]
    need, seen = [], set()
    while todo:
        v = todo.pop()
        if v in seen or v not in made:  # an input of the body: held
            continue
        seen.add(v)
        if made[v].primitive.matmul:
            need.append(v)
        else:
            todo.extend(made[v].inputs)
    return tuple(need)


def _unrolled(e) -> bool:
    """Whether the scan equation `e` runs unrolled, as nm.scan's `unrolls` decides: its
    `unroll` when a bool; for "auto", no remat, more than one iteration and the body,
    traced at the graph's shapes, within UNROLL_BUDGET equations in all (the eager
    program's count: a lowered body's collectives may add a few). That trace is the
    planner's one use of jax (once per program): the count depends on how each
    primitive's jax implementation expands (an attention kernel's blocks), which the
    graph does not say."""
    p = e.params
    unroll, length = p.get("unroll", False), p["length"]
    if unroll != "auto":
        return bool(unroll)
    if p.get("remat", "none") != "none" or length <= 1:
        return False
    return length * _equations(p["body"]) <= UNROLL_BUDGET


@per_object  # of the program alone, not of the layout: once for all candidates
def _equations(body) -> int:
    """The jax equations of one iteration of the scan body `body` (`equations`)."""
    avals = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in body.inputs]
    return equations(jax.make_jaxpr(lambda *a: evaluate(body, list(a), "jax"))(*avals))


def _scan_saved(terms, local_bytes) -> tuple[int, int]:
    """(the bytes a scan keeps for its backward pass, the most its backward adds to
    them): without remat every iteration's saved values, stacked, and one iteration's
    working set; under remat the carry (and "dots": the stored matmul outputs, and a
    fused matmul's own saves, `_stored_products`) of every iteration and the loop
    invariants once (`_invariants`), and where one recomputed iteration's backward
    peaks (`_peak`'s walk: it reads its last values first, the first ones are live
    throughout), the stored matmul outputs not made again (read from the stacks:
    counting them as sliced copies put the tiny Megatron dots step at 1.33 of XLA,
    from 1.11). Its forward run again is not walked apart: `_forward` of it, its
    values kept to the end, changed none of the 47 rows of seeds 3-6 but four dense
    ones, upward (Gemma 2 vocab split, remat full: 1.14 -> 1.16 of XLA): XLA recomputes
    a value where its backward reads it, not the whole iteration first."""
    _, _, n, remat, body_terms, carry_values, dots_values, invariants, _, products = terms
    per_step, work = _saved(body_terms, local_bytes)
    carry = sum(local_bytes(v) for v in carry_values)
    if remat == "none":
        return n * per_step, work
    once = sum(local_bytes(v) for v in invariants)
    stored = set(dots_values) if remat == "dots" else set()  # counted per iteration

    # a gathered operand (`Read`) is gathered again where its backward reads it: XLA
    # schedules the recomputed collective there, not at the iteration's start (the FSDP
    # row of the whole step's table: 1.33 when counted as saved, 1.18 without)
    def again_bytes(v):
        return 0 if v in stored or (isinstance(v, Read) and v.extra) else local_bytes(v)

    again = _peak(body_terms, again_bytes, {})
    dots = sum(local_bytes(v) for v in stored)
    dots += sum(round(a[1] * local_bytes(a[2])) for a in products)
    return n * (carry + dots) + once, sum(again)
