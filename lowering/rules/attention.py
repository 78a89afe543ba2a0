"""The SPMD rule of namedmesh.attention.dot_product_attention: the fused kernel needs
each query's whole sequence of keys and each head's whole features on one device, so
the three dims its `names` param names (length, memory, features: the caller's names)
are made local (relaid out where a layout splits them) and the other dims (batch,
heads) keep the output's layout, each device running the kernel on its own heads and
rows with no collective."""

from __future__ import annotations

from lowering.rules.registry import rule
from namedmesh.attention import dot_product_attention  # noqa: F401  (registers it)
from namedmesh.primitive import REGISTRY


@rule(REGISTRY["dot_product_attention"])
def attention_rule(ctx, eqn, args):
    """Inputs relaid to the output's layout of their dims, with the length, memory and
    features dims whole; the kernel runs on each device's shard."""
    (out,) = eqn.outputs
    local = eqn.params["names"]
    want = ctx.wanted[out]
    by_dim = {d: () if d in local else tuple(w) for d, w in zip(out.dims, want, strict=True)}
    xs = []
    for (x, lay), v in zip(args, eqn.inputs, strict=True):
        dst = tuple(by_dim.get(d, ()) for d in v.dims)
        xs.append(x if tuple(lay) == dst else ctx.relayout(x, lay, dst))
    return [(ctx.local(eqn.primitive, *xs, **eqn.params), tuple(by_dim[d] for d in out.dims))]
