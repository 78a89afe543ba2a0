"""The table of SPMD rules, keyed by primitive, and the rule every primitive can fall
back on.

A rule takes (ctx, eqn, [(local array, layout), ...]) and returns the outputs as
[(local array, layout), ...]. `@rule(prim, ...)` files it in `SPMD_RULES`, keyed by
the primitive object (as jax keeps one table of lowerings per interpreter).
Primitives without a rule of their own use `elementwise_rule` when they declare
`elementwise`, else `replicated_rule`: gather every input, run the op whole, leave
the result replicated (correct for every primitive, and the baseline the others
improve on).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

from namedmesh.primitive import REGISTRY, Primitive

SPMD_RULES: dict[Primitive, Callable] = {}

# The primitives the rules of this package lower, by their registry entries (a KeyError
# at import is a primitive that was renamed or removed).
P = SimpleNamespace(**REGISTRY)


def rule(*prims: Primitive):
    """File the decorated function as the SPMD rule of `prims` in `SPMD_RULES`. A rule
    uses the context's operations alone (lowering/plan.py RuleContext): the Planner runs
    it on abstract local values, without jax."""

    def register(fn):
        SPMD_RULES.update((p, fn) for p in prims)
        return fn

    return register


def replicated_rule(ctx, eqn, args):
    """Every input gathered, the op run whole, the result replicated."""
    xs = [ctx.relayout(x, lay, ((),) * len(lay)) for x, lay in args]
    outs = ctx.local(eqn.primitive, *xs, **eqn.params)
    outs = outs if eqn.primitive.multiple_results else (outs,)
    return [(o, ((),) * len(v.dims)) for o, v in zip(outs, eqn.outputs, strict=True)]


def layout_in(dims, layout_of):
    return tuple([layout_of.get(d, ()) for d in dims])
