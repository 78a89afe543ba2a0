"""The SPMD rule of `nm.scan`: one `jax.lax.scan` over local shards whose body runs the
scanned graph by the same rules, so the plan, the HLO and the compile time hold the
body once however long the loop.

The carry keeps one layout across iterations: the rules' layout of the scan's carry
outputs; the body's carry is relaid to it at the end of each iteration. The scanned
dim of `xs` is never split inside the loop (a split one is gathered first: pipeline
parallelism is not a layout). The scan's `remat` policy wraps the loop's body in
jax.checkpoint, so the backward pass recomputes what the policy does not keep.
shard_map types each value as varying or not over each mesh axis and a loop carry
must keep its type, so the carry is typed varying over every axis over which the
initial value or the body's result varies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowering.collectives import missing_axes, nbytes, varying_axes
from lowering.lower import Step, plan_layouts, run_graph
from lowering.rules import P, rule
from namedmesh.control import checkpointed


class _WiderCarry(Exception):
    def __init__(self, axes):
        self.axes = axes


def _pcast(x, vma: set, sizes):
    missing = missing_axes(x, vma, sizes)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


@rule(P.scan)
def scan_rule(ctx, eqn, args):
    p = eqn.params
    body, nc, nx = p["body"], p["n_carry"], p["n_x"]
    outer = ctx.step
    carry_lay = [ctx.wanted[v] for v in eqn.outputs[:nc]]
    carry = [
        ctx.relayout(x, lay, want) for (x, lay), want in zip(args[:nc], carry_lay, strict=True)
    ]
    xs, x_lays = [], []
    for (x, lay), ax in zip(args[nc : nc + nx], p["x_axes"], strict=True):
        whole = lay[:ax] + ((),) + lay[ax + 1 :]
        xs.append(jnp.moveaxis(ctx.relayout(x, lay, whole), ax, 0))
        x_lays.append(lay[:ax] + lay[ax + 1 :])
    rest = args[nc + nx :]
    in_lays = carry_lay + x_lays + [lay for _, lay in rest]
    ctx.wanted.update(zip(body.inputs, in_lays, strict=True))
    plan_layouts(ctx, body)
    steps, y_lays = [], []

    def step(c, x):
        saved = ctx.moved, ctx.sources
        ctx.moved, ctx.sources = {}, {}  # this trace's values must not leak out of the loop
        steps.clear()
        env = dict(
            zip(
                body.inputs, zip([*c, *x, *(a for a, _ in rest)], in_lays, strict=True), strict=True
            )
        )
        run_graph(ctx, body, env, steps, outer.repeat * p["length"], outer.depth + 1)
        ctx.combined = set()
        ctx.step = Step(
            "carry",
            None,
            [(v.dims, env[v][1]) for v in body.outputs[:nc]],
            [],
            repeat=outer.repeat * p["length"],
            depth=outer.depth + 1,
        )
        new = [
            ctx.relayout(*env[v], lay) for v, lay in zip(body.outputs[:nc], carry_lay, strict=True)
        ]
        ctx.step.outputs = [
            (v.dims, lay) for v, lay in zip(body.outputs[:nc], carry_lay, strict=True)
        ]
        wider = set().union(*map(varying_axes, new)) - vma
        if wider:
            (ctx.moved, ctx.sources), ctx.step = saved, outer
            raise _WiderCarry(wider)
        new = [ctx.varying(y, vma) for y in new]  # logged: its transpose psums the carry
        if ctx.step.collectives or ctx.step.casts:
            steps.append(ctx.step)
        (ctx.moved, ctx.sources), ctx.step = saved, outer
        y_lays[:] = [env[v][1] for v in body.outputs[nc:]]
        return new, [env[v][0] for v in body.outputs[nc:]]

    vma = set().union(*map(varying_axes, carry))
    while True:
        try:
            init = [_pcast(c, vma, ctx.sizes) for c in carry]
            body_fn = checkpointed(step, p.get("remat", "none"))
            final, ys = jax.lax.scan(body_fn, init, xs, length=p["length"])
            break
        except _WiderCarry as e:
            vma |= e.axes
    for c in carry:  # logged once the carry's type is settled: its transpose psums
        if missing := missing_axes(c, vma, ctx.sizes):
            ctx.log("pvary", missing, nbytes(c), ctx.source(c))
    ctx.step.body = list(steps)
    return [
        *zip(final, carry_lay, strict=True),
        *((y, ((),) + lay) for y, lay in zip(ys, y_lays, strict=True)),
    ]
