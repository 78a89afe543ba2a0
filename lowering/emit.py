"""The emitter: a Plan's instructions run on local arrays inside jit(shard_map).

Each `Instr` of a planned step (lowering/plan.py) names an instruction of
lowering/ops.py's table, whose jax implementation `OPS` holds (or is a function of
local arrays, a rule's own arithmetic) and the local values it reads
and makes; `run_steps` runs them in order, binding each planned `Local` to the jax
array it stands for. The emitter decides nothing: layouts, collectives, casts and
local ops are all the plan's. `emit(..., check=True)` (`lower(..., check=True)`)
holds every value it makes to the plan's Local for it (shape, dtype, the mesh axes
shard_map types it varying over) and raises PlanMismatch naming the first step and
instruction that differ: the planner's oracle, beside NumPy's values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lowering import ops
from namedmesh.contract import varying_axes

OPS = {name: op.run for name, op in ops.OPS.items()}  # each instruction's jax implementation


def run_op(op, *xs, **params):
    """Operation `op` (a name of OPS, or a function) on local arrays."""
    fn = op if callable(op) else OPS[op]
    return fn(*xs, **params)


def run_steps(steps, env: dict, check: bool = False) -> None:
    """Run the instructions of `steps` (a plan, or a scan's body) on local arrays; `env`
    maps each planned Local to its array and receives the values made. `check`: each
    value made is held to its Local (`check_values`)."""
    for step in steps:
        for i, ins in enumerate(step.ops):
            if ins.op == "scan":
                res = _scan(ins, env, check)
            else:
                res = run_op(ins.op, *(env[x] for x in ins.ins), **ins.params)
            res = res if isinstance(res, tuple) else (res,)
            if check:
                check_values(ins.outs, res, functools.partial(_where, step, i, ins))
            env.update(zip(ins.outs, res, strict=True))


def emit(plan, local_inputs, check: bool = False) -> list:
    """The local outputs of the planned program on `local_inputs` (inside shard_map).
    `check`: the emitter checks the plan as it runs (`check_values`): the inputs, then
    every value each instruction makes, a loop body's carry and slices in included."""
    if check:
        check_values(plan.inputs, local_inputs, lambda: "the program's inputs")
    env = dict(zip(plan.inputs, local_inputs, strict=True))
    env.update((x, jnp.asarray(c)) for x, c in plan.consts.items())
    run_steps(plan.program, env, check)
    return [env[x] for x in plan.outputs]


class PlanMismatch(AssertionError):
    """A jax value the emitter made differs from the plan's Local for it (shape, dtype or
    the mesh axes shard_map types it varying over): a rule or the planner is wrong, not
    the program. Raised by the check mode, naming the step and instruction."""


def check_values(locals_, arrays, where) -> None:
    """PlanMismatch unless each array has its Local's shape, dtype and varying axes;
    `where()` names the instruction for the message."""
    for k, (x, a) in enumerate(zip(locals_, arrays, strict=True)):
        got = (tuple(a.shape), np.dtype(a.dtype), frozenset(varying_axes(a)))
        want = (tuple(x.shape), np.dtype(x.dtype), frozenset(x.vma))
        if got != want:
            fmt = lambda t: f"{t[1]}{list(t[0])} varying over {sorted(t[2]) or 'no axis'}"
            raise PlanMismatch(f"{where()}, value {k}: jax made {fmt(got)}, the plan says "
                               f"{fmt(want)}")  # fmt: skip


def _where(step, i: int, ins) -> str:
    op = ins.op if isinstance(ins.op, str) else getattr(ins.op, "__name__", repr(ins.op))
    if op == "local":
        op = f"local {ins.params['local_op'][0].name}"
    return f"step {step.name!r}, instruction {i} ({op})"


def _scan(ins, env: dict, check: bool = False):
    """A planned loop (a scan's, or a pipeline's ticks: RuleContext.loop): jax.lax.scan
    whose body runs the body's planned steps; values of the enclosing program the body
    reads are closed over."""
    from namedmesh.control import loop

    p = ins.params
    nc, nx = p["n_carry"], p["n_x"]
    init = [env[x] for x in ins.ins[:nc]]
    xs = [env[x] for x in ins.ins[nc : nc + nx]]

    def step(c, x):
        if check:  # the body's inputs as jax types them: the carry's type is the plan's
            check_values(p["carry_in"], c, lambda: "a loop's carry in")
            check_values(p["x_in"], x, lambda: "a loop's slices in")
        inner = dict(env)
        inner.update(zip(p["carry_in"], c, strict=True))
        inner.update(zip(p["x_in"], x, strict=True))
        inner.update((v, jnp.asarray(c)) for v, c in p["consts"].items())
        run_steps(p["steps"], inner, check)
        return [inner[v] for v in p["carry_out"]], [inner[v] for v in p["ys"]]

    if p.get("skip"):
        step = _skipping(step, p["ys"])
    final, ys = loop(step, init, xs, p["length"], p["remat"], p.get("unroll", False))
    return (*final, *ys)


def _skipping(step, ys):
    """`step` run only where its last slice (a bool: uneven stages' real-layer flags,
    namedmesh.uneven.Masked) is True; elsewhere, a pad, the carry passes through and its
    results (`ys`, the Locals of the body's, which the caller drops) are zeros: a
    jax.lax.cond, whose untaken branch does no work, forward or backward (its transpose
    is a cond on the same flag), each device on its own flag under shard_map."""

    def pad(c, x):
        zeros = [jnp.zeros(y.shape, y.dtype) for y in ys]
        return list(c), [jax.lax.pcast(z, tuple(sorted(y.vma)), to="varying") if y.vma else z
                         for z, y in zip(zeros, ys, strict=True)]  # fmt: skip

    return lambda c, x: jax.lax.cond(x[-1], step, pad, c, x)
