"""SPMD rules: how each primitive runs on local shards, and which collectives it needs,
one module per op family (mirroring namedmesh's op modules): `registry` holds the
table keyed by primitive (`SPMD_RULES`, `@rule`) and the replicated fallback;
elementwise, einsum, reductions, structural, selection, creation, spatial (conv, pool)
and grouped (grouped_matmul) hold the families' rules. nm.scan's rule is
lowering/scan.py (a pipeline when its scanned dim is split: lowering/pipeline.py).
"""

from __future__ import annotations

from collections.abc import Callable

from lowering.rules import creation, einsum, grouped, reductions, selection, spatial, structural
from lowering.rules.elementwise import elementwise_rule
from lowering.rules.registry import (
    PLAN_RULES,
    SPMD_RULES,
    P,
    layout_in,
    plan_rule,
    replicated_rule,
    rule,
)
from namedmesh.primitive import Primitive

__all__ = ["P", "PLAN_RULES", "SPMD_RULES", "layout_in", "plan_rule", "plan_rule_for",
           "plannable", "replicated_rule", "rule", "rule_for"]  # fmt: skip
# (the family modules are imported for the rules they file)
_FAMILIES = (creation, einsum, grouped, reductions, selection, spatial, structural)


def rule_for(prim: Primitive) -> Callable:
    """The SPMD rule that lowers `prim`: its own, else by its declared flags."""
    if prim in SPMD_RULES:
        return SPMD_RULES[prim]
    return elementwise_rule if prim.elementwise else replicated_rule


def plan_rule_for(prim: Primitive) -> Callable:
    """The rule that plans `prim` without jax (KeyError: it has none)."""
    return PLAN_RULES[prim] if prim in SPMD_RULES else rule_for(prim)


def plannable(graph) -> bool:
    """Whether every op of `graph` (and of its scans' bodies) has a plan rule, under any
    layout: a scan whose scanned dim the layout splits (a pipeline, lowering/pipeline.py)
    is planned too. False only for a primitive registered with an impure rule."""
    for e in graph.eqns:
        if e.primitive in SPMD_RULES and e.primitive not in PLAN_RULES:
            return False
        if e.primitive.loop and not plannable(e.params["body"]):
            return False
    return True
