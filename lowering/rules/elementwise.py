"""The rules of elementwise ops: inputs relaid to the output's layout, the op run on
matching shards."""

from __future__ import annotations

from lowering.rules.registry import P, layout_in, rule


def elementwise_rule(ctx, eqn, args):
    """Inputs relaid to the output's layout; the op runs on matching shards. An output
    whose dims conflict under the rules (`ctx.free`) takes the layout of the first input
    with its dims, so that e.g. an expert FFN's activation stays where its einsum put it."""
    (out,) = eqn.outputs
    want = ctx.wanted[out]
    if out in ctx.free:
        same = (lay for (_, lay), v in zip(args, eqn.inputs, strict=True) if v.dims == out.dims)
        want = ctx.wanted[out] = tuple(next(same, None) or ctx.soft_layout(out.dims, out.shape))
    xs, by_dim = [], None
    for i, v in enumerate(eqn.inputs):  # (indexes: zip's strict= costs more than this)
        x, lay = args[i]
        if v.dims == out.dims:  # (most) the output's dims: its layout as it is
            dst = want
        else:
            by_dim = by_dim or dict(zip(out.dims, want, strict=True))
            dst = layout_in(v.dims, by_dim)
        xs.append(x if lay == dst else ctx.relayout(x, lay, dst))
    return [(ctx.local(eqn.primitive, *xs, **eqn.params), want)]


@rule(P.convert, P.stop_gradient, P.rename)
def same_layout_rule(ctx, eqn, args):
    """Ops that act on each element alone and keep the dims' order: any layout will do."""
    ((x, lay),) = args
    return [(ctx.local(eqn.primitive, x, **eqn.params), lay)]
