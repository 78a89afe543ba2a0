"""SPMD rules: how each primitive runs on local shards, and which collectives it needs,
one module per op family (mirroring namedmesh's op modules): `registry` holds the
table keyed by primitive (`SPMD_RULES`, `@rule`) and the replicated fallback;
elementwise, einsum, reductions, structural, selection, creation, spatial (conv, pool),
grouped (grouped_matmul, grouped_ffn) and attention (the fused kernel) hold the families' rules,
and control nm.scan's (a pipeline when its scanned dim is split: lowering/pipeline.py,
beside it).
"""

from __future__ import annotations

from collections.abc import Callable

from lowering.rules import (  # noqa: F401  (imported for the rules they file)
    attention,
    control,
    creation,
    einsum,
    grouped,
    reductions,
    selection,
    spatial,
    structural,
)
from lowering.rules.elementwise import elementwise_rule
from lowering.rules.registry import SPMD_RULES, P, layout_in, replicated_rule, rule
from namedmesh.primitive import Primitive

__all__ = ["P", "SPMD_RULES", "layout_in", "replicated_rule", "rule", "rule_for"]


def rule_for(prim: Primitive) -> Callable:
    """The SPMD rule that lowers `prim`: its own, else by its declared flags."""
    if prim in SPMD_RULES:
        return SPMD_RULES[prim]
    return elementwise_rule if prim.elementwise else replicated_rule
