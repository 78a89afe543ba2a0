"""The SPMD rule of `nm.scan`: one `jax.lax.scan` over local shards whose body runs the
scanned graph by the same rules, so the plan, the HLO and the compile time hold the
body once however long the loop.

The carry keeps one layout across iterations: the rules' layout of the scan's carry
outputs; the body's carry is relaid to it at the end of each iteration. The scanned
dim of `xs` is never split inside the loop: a layout that splits it over mesh axes
makes the scan a pipeline over them (lowering/pipeline.py), each device running its
stage's iterations. The scan's `remat` policy wraps the loop's body in
jax.checkpoint, so the backward pass recomputes what the policy does not keep.
shard_map types each value as varying or not over each mesh axis and a loop carry
must keep its type, so the carry is typed varying over every axis over which the
initial value or the body's result varies.

`scan_rule` plans the loop on `Local`s without jax (`plan_loop`), re-planning the
body until the carry's type settles, and records it as one "scan" instruction holding
the body's steps, which the emitter (lowering/emit.py) runs inside jax.lax.scan. A
pipelined scan (a split scanned dim) is `pipeline.emit` on the context's operations,
given `plan_loop` for its stages' iterations.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from lowering import pipeline
from lowering.caches import per_object
from lowering.collectives import WiderCarry, nbytes
from lowering.plan import Instr, Local, Step
from lowering.rules.registry import P, rule
from namedmesh.trace import Eqn, Graph


def hoisted(ctx, eqn, rest):
    """(the scan equation, its captured inputs) with the values its body makes from no
    input made once before the loop and captured, where one has the microbatched dim (the
    online softmax's initial statistics, `nm.full` over the carry's dims; a constant
    tensor the body closes over). A loop
    constant is the same at every iteration, so this changes no value; made inside the
    body at the whole batch's size, it would not fit a microbatch, where captured it is
    cut into microbatches as any captured input is (pipeline._cut), each taking its own
    examples' entries. Returns the Steps that made them too; their instructions join the
    scan's step, before the pipeline's."""
    p = eqn.params
    body, dim = p["body"], ctx.layout.options.get("microbatch_dim", "batch")
    made = set(body.inputs)  # values made from an input
    for e in body.eqns:
        if any(v in made for v in e.inputs):
            made.update(e.outputs)
    free = [e for e in body.eqns if not any(v in made for v in e.inputs)]
    used = {v for e in body.eqns if e not in free for v in e.inputs} | set(body.outputs)
    constants = [v for v in body.consts if v in used and dim in v.dims]
    constants += [v for e in free for v in e.outputs if v in used]
    if not any(dim in v.dims for v in constants):
        return eqn, rest, []
    ctx.plan_layouts(body)
    for e in free:  # made whole on every device: no collective moves a value made from
        for v in e.outputs:  # nothing (XLA folds a gather of a constant away; so do we)
            ctx.wanted[v] = ((),) * len(v.dims)
            ctx.free.discard(v)
    outer, made = ctx.step, []
    read = {v for e in free for v in e.inputs} | set(constants)
    env = {v: (_constant(ctx, c), ((),) * len(v.dims)) for v, c in body.consts.items()
           if v in read}  # fmt: skip
    ctx.run_graph(Graph((), (), free, None, None, {}), env, made, outer.repeat, outer.depth + 1)
    ctx.step = outer
    outer.ops.extend(op for step in made for op in step.ops)
    consts = {v: c for v, c in body.consts.items() if v not in constants}
    inner = Graph(body.inputs + tuple(constants), body.outputs,
                  [e for e in body.eqns if e not in free], body.in_tree, body.out_tree,
                  consts)  # fmt: skip
    eqn = Eqn(eqn.primitive, eqn.inputs + tuple(constants), eqn.outputs, {**p, "body": inner})
    return eqn, [*rest, *(env[v] for v in constants)], made


def _constant(ctx, c):
    """The constant array `c` as a local value the plan makes (every device, whole)."""
    c = np.asarray(c)
    return ctx.call(_array, value=c, shape=c.shape, dtype=c.dtype, vma=set())


def _array(value):
    return jnp.asarray(value)


@rule(P.scan)
def scan_rule(ctx, eqn, args):
    """The carry relaid to its layout, the scanned inputs' scanned dim made whole and
    moved first, and the loop planned (`plan_loop`); a split scanned dim makes a
    pipeline (pipeline.emit), its stages' loops planned alike."""
    p = eqn.params
    nc, nx = p["n_carry"], p["n_x"]
    carry_lay = [ctx.wanted[v] for v in eqn.outputs[:nc]]
    carry = [
        ctx.relayout(x, lay, want) for (x, lay), want in zip(args[:nc], carry_lay, strict=True)
    ]
    x_args, rest = args[nc : nc + nx], args[nc + nx :]
    if pipeline.split_axes(x_args, p["x_axes"]):  # a split scanned dim: a pipeline
        outer = ctx.step
        eqn, rest, made = hoisted(ctx, eqn, rest)
        outs = pipeline.emit(ctx, eqn, carry, carry_lay, x_args, rest, plan_loop)
        outer.body[:0] = made  # (their costs; their instructions are the step's own)
        return outs
    xs, x_lays = [], []
    for (x, lay), ax in zip(x_args, p["x_axes"], strict=True):
        whole = ctx.relayout(x, lay, lay[:ax] + ((),) + lay[ax + 1 :])
        shape = (whole.shape[ax], *whole.shape[:ax], *whole.shape[ax + 1 :])
        xs.append(ctx.call(jnp.moveaxis, whole, source=ax, destination=0, shape=shape,
                           dtype=whole.dtype))  # fmt: skip
        x_lays.append(lay[:ax] + lay[ax + 1 :])
    final, ys, y_lays = plan_loop(ctx, eqn, carry, carry_lay, xs, x_lays, rest, p["length"])
    return [
        *zip(final, carry_lay, strict=True),
        *((y, ((),) + lay) for y, lay in zip(ys, y_lays, strict=True)),
    ]


def plan_loop(ctx, eqn, carry, carry_lay, xs, x_lays, rest, length: int):
    """(final carry, stacked ys, the ys' layouts) of the scan
    equation `eqn`'s body over the Locals `xs`, `length` iterations, recorded into the
    current step as one "scan" instruction holding the body's steps, re-planning the body
    until the carry's type settles. The body's Steps go into the current step's `body`."""
    p = eqn.params
    body, nc = p["body"], p["n_carry"]
    in_lays = carry_lay + x_lays + [lay for _, lay in rest]
    ctx.wanted.update(zip(body.inputs, in_lays, strict=True))
    laid: list = []  # the body's layouts are planned before its first pass planned here

    def lay_out():  # (not before a pass kept from before, which sets them all again)
        if not laid:
            ctx.plan_layouts(body)
            laid.append(body)

    vma = set().union(*map(ctx.vma, carry))
    widened, key = widenings(body), _pass_key(ctx, body, carry, xs, rest, in_lays, length)
    while True:
        known = widened.get((key, frozenset(vma)))
        if known:  # this very pass widened the carry before (another candidate's)
            vma |= known
            continue
        try:
            planned = _settled_pass(ctx, eqn, key, carry, xs, rest, in_lays, carry_lay, vma,
                                    length, lay_out)  # fmt: skip
            break
        except WiderCarry as e:  # the body's carry varies over more axes: again
            widened[key, frozenset(vma)] = e.axes
            vma |= e.axes
    steps, shown, inner_ins, new, ys, y_lays, consts = planned
    init = [ctx.cast_varying(c, vma) for c in carry]
    final = [Local(c.shape, c.dtype, frozenset(vma)) for c in carry]
    stacked = [Local((length, *y.shape), y.dtype, y.vma) for y in ys]
    ctx.step.ops.append(Instr("scan", (*init, *xs), (*final, *stacked), {
        "n_carry": nc, "n_x": len(xs), "length": length, "remat": p.get("remat", "none"),
        "unroll": p.get("unroll", False), "skip": p.get("skip", False),
        "carry_in": inner_ins[:nc], "x_in": inner_ins[nc:], "steps": steps,
        "carry_out": new, "ys": ys, "consts": consts,
    }))  # fmt: skip
    for c in carry:  # logged once the carry's type is settled: its transpose psums
        if missing := ctx.missing_axes(c, vma):
            ctx.log("pvary", missing, nbytes(c), ctx.source(c))
    ctx.step.body = shown
    return final, stacked, y_lays


def _settled_pass(ctx, eqn, key, carry, xs, rest, in_lays, carry_lay, vma, length, lay_out):
    """`_plan_body`, after `lay_out()` (the body's layouts into `wanted`); in a
    costing-only plan (auto_layout's candidates) a pass planned before under the same
    key, type and enclosing repeat and depth is not planned again: its results are taken
    and the layouts it gave the body's values (`wanted`, `free`: every value `lay_out`
    lays out among them) set again, as planning it would have. A result's Steps are
    shared, never changed after planning; the lists holding them are the caller's own."""
    if ctx.record:  # a plan to emit: planned once, its Steps its own
        lay_out()
        return _plan_body(ctx, eqn, carry, xs, rest, in_lays, carry_lay, vma, length)
    body = eqn.params["body"]
    seen, values = settled(body), body_values(body)
    k = (key, frozenset(vma), ctx.step.repeat, ctx.step.depth)
    if k in seen:
        planned, wanted, free = seen[k]
        ctx.wanted.update(wanted)
        ctx.free.difference_update(values)
        ctx.free.update(free)
        ctx.combined = set()
    else:
        lay_out()
        planned = _plan_body(ctx, eqn, carry, xs, rest, in_lays, carry_lay, vma, length)
        wanted = {v: ctx.wanted[v] for v in values if v in ctx.wanted}
        seen[k] = planned, wanted, values & ctx.free
    steps, shown, *others = planned
    return (list(steps), list(shown), *others)


def _plan_body(ctx, eqn, carry, xs, rest, in_lays, carry_lay, vma: set, length: int):
    """The body planned with the carry typed varying over `vma`: (the steps to run, the
    steps to show, the body's input Locals, its carry and y results, the ys' layouts,
    its constants by Local); WiderCarry when the body's carry varies over more axes
    than `vma`."""
    p = eqn.params
    body, nc = p["body"], p["n_carry"]
    outer = ctx.step
    saved = ctx.moved, ctx.sources
    ctx.moved, ctx.sources = {}, {}  # this plan's values must not leak out of the loop
    inner_ins = [Local(c.shape, c.dtype, frozenset(vma)) for c in carry]
    inner_ins += [Local(x.shape[1:], x.dtype, x.vma) for x in xs]
    values = [*inner_ins, *(a for a, _ in rest)]
    env = dict(zip(body.inputs, zip(values, in_lays, strict=True), strict=True))
    shown: list = []
    repeat, depth = outer.repeat * length, outer.depth + 1
    ctx.run_graph(body, env, shown, repeat, depth)
    ctx.combined = set()
    ctx.step = Step("carry", None, [(v.dims, env[v][1]) for v in body.outputs[:nc]], [],
                    repeat=repeat, depth=depth)  # fmt: skip
    new = [ctx.relayout(*env[v], lay) for v, lay in zip(body.outputs[:nc], carry_lay, strict=True)]
    ctx.step.outputs = [(v.dims, lay) for v, lay in zip(body.outputs[:nc], carry_lay, strict=True)]
    wider = set().union(*map(ctx.vma, new)) - vma
    if not wider:
        new = [ctx.varying(y, vma) for y in new]  # logged: its transpose psums the carry
    carry_step = ctx.step
    (ctx.moved, ctx.sources), ctx.step = saved, outer
    if wider:
        raise WiderCarry(wider)
    if carry_step.collectives or carry_step.casts:
        shown.append(carry_step)
    steps = [s for s in shown if s.depth == depth and s is not carry_step] + [carry_step]
    ys = [env[v] for v in body.outputs[nc:]]
    consts = {env[v][0]: c for v, c in body.consts.items()}
    return steps, shown, inner_ins, new, [y for y, _ in ys], [lay for _, lay in ys], consts


@per_object(kind="layouts")
def widenings(body) -> dict:
    """Of a scan body, the axes a pass widened its carry's type by, per `_pass_key` and
    the type the pass began with. Which axes a pass widens the carry by is a function of
    that key alone, so a pass seen to widen (in another candidate of a search, or in an
    earlier pass of an enclosing loop) is not planned again: the loop goes on at once
    with the wider type, as it would have after planning it. Each body is planned about
    twice per loop, nested loops compounding, and most candidates repeat the passes of
    others: this saves about a third of the planning of a search."""
    return {}


@per_object
def body_dims(body) -> frozenset:
    """The dims of every value of `body` and of the bodies nested in it."""
    dims = {d for v in (*body.inputs, *body.outputs) for d in v.dims}
    for e in body.eqns:
        dims.update(d for v in (*e.inputs, *e.outputs) for d in v.dims)
        if isinstance(e.params.get("body"), Graph):
            dims |= body_dims(e.params["body"])
    return frozenset(dims)


def _pass_key(ctx, body, carry, xs, rest, in_lays, length) -> tuple:
    """What one pass of the loop over `body` depends on but the carry's type: the mesh,
    the rules of the dims the body (and those nested in it) holds, in order, the layout's
    options, the local values' shapes, dtypes and types, and their layouts."""
    dims, layout = body_dims(body), ctx.layout
    # (the dtype itself: equal dtypes hash alike, and str() of one costs a search 3%)
    local = lambda x: (tuple(x.shape), x.dtype, frozenset(ctx.vma(x)))
    return (
        tuple(ctx.mesh.sizes.items()), tuple(r for r in layout.rules if r[0] in dims),
        layout.strict, repr(sorted(layout.options.items())), ctx.record, length,
        tuple(map(local, (*carry, *xs, *(a for a, _ in rest)))),
        tuple(tuple(lay) for lay in in_lays),
    )  # fmt: skip


@per_object(kind="layouts")
def settled(body) -> dict:
    """Of a scan body, its passes that settled the carry's type in costing-only plans:
    (`_pass_key`, type, repeat, depth) -> (the pass's results, the layouts of the body's
    values it left in `wanted`, those of them in `free`). Candidates of a search that
    lay out the body's dims alike plan the body alike: most of a search's passes."""
    return {}


@per_object
def body_values(body) -> frozenset:
    """Every value of `body` and of the bodies nested in it."""
    values = {*body.inputs, *body.outputs, *body.consts}
    for e in body.eqns:
        values.update((*e.inputs, *e.outputs))
        if isinstance(e.params.get("body"), Graph):
            values |= body_values(e.params["body"])
    return frozenset(values)


def forget_passes(graph) -> None:
    """Empty the pass memos of `graph`'s scan bodies (and those nested in them): a
    search that is done keeps its program, for `Search.compare`, but not its passes,
    which hold every candidate's planned bodies (gigabytes over a plan's searches)."""
    for e in graph.eqns:
        body = e.params.get("body")
        if isinstance(body, Graph):
            settled(body).clear()
            widenings(body).clear()
            forget_passes(body)
