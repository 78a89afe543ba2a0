"""The emitter: a Plan's instructions run on local arrays inside jit(shard_map).

Each `Instr` of a planned step (lowering/plan.py) names an instruction of
lowering/ops.py's table, whose jax implementation `OPS` holds (or is a function of
local arrays, a rule's own arithmetic) and the local values it reads
and makes; `run_steps` runs them in order, binding each planned `Local` to the jax
array it stands for. The emitter decides nothing: layouts, collectives, casts and
local ops are all the plan's. The traced context (lowering/lower.py) runs the same
`OPS` as rules call them, when a program has an op whose rule is not yet plannable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowering import ops

OPS = {name: op.run for name, op in ops.OPS.items()}  # each instruction's jax implementation


def run_op(op, *xs, **params):
    """Operation `op` (a name of OPS, or a function) on local arrays."""
    fn = op if callable(op) else OPS[op]
    return fn(*xs, **params)


def run_steps(steps, env: dict) -> None:
    """Run the instructions of `steps` (a plan, or a scan's body) on local arrays; `env`
    maps each planned Local to its array and receives the values made."""
    for step in steps:
        for ins in step.ops:
            if ins.op == "scan":
                res = _scan(ins, env)
            else:
                res = run_op(ins.op, *(env[x] for x in ins.ins), **ins.params)
            res = res if isinstance(res, tuple) else (res,)
            env.update(zip(ins.outs, res, strict=True))


def emit(plan, local_inputs) -> list:
    """The local outputs of the planned program on `local_inputs` (inside shard_map)."""
    env = dict(zip(plan.inputs, local_inputs, strict=True))
    env.update((x, jnp.asarray(c)) for x, c in plan.consts.items())
    run_steps(plan.program, env)
    return [env[x] for x in plan.outputs]


def _scan(ins, env: dict):
    """A planned loop (a scan's, or a pipeline's ticks: RuleContext.loop): jax.lax.scan
    whose body runs the body's planned steps; values of the enclosing program the body
    reads are closed over."""
    from namedmesh.control import checkpointed

    p = ins.params
    nc, nx = p["n_carry"], p["n_x"]
    init = [env[x] for x in ins.ins[:nc]]
    xs = [env[x] for x in ins.ins[nc : nc + nx]]

    def step(c, x):
        inner = dict(env)
        inner.update(zip(p["carry_in"], c, strict=True))
        inner.update(zip(p["x_in"], x, strict=True))
        inner.update((v, jnp.asarray(c)) for v, c in p["consts"].items())
        run_steps(p["steps"], inner)
        return [inner[v] for v in p["carry_out"]], [inner[v] for v in p["ys"]]

    body = checkpointed(step, p["remat"])
    final, ys = jax.lax.scan(body, init, xs, length=p["length"])
    return (*final, *ys)
