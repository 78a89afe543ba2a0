"""The rule of `nm.grouped_matmul` (a mixture of experts' grouped matmul)."""

from __future__ import annotations

from lowering import expert_routes
from lowering.rules.einsum import combine
from lowering.rules.registry import P, layout_in, rule
from lowering.rules.selection import minus_block, wide_indices


@rule(P.grouped_matmul)
def grouped_matmul_rule(ctx, eqn, args):
    """The rows (the groups' dims) and the weight's output dims take the output's splits,
    contracted dims are gathered. A weight split along its group dim (`experts:<axis>`)
    stays split: each device multiplies the rows whose group falls in its block (the
    others are zero rows, which cost nothing), with the rows whole over those axes, and a
    psum_scatter into the dim the output splits on the axis (else a psum) combines.
    Where the output splits its rows over those axes too, each row goes to its group's
    device and back by all_to_all instead (lowering/expert_routes.py)."""
    (x, xl), (w, wl), (g, gl) = args
    (vx, vw, vg), (out,) = eqn.inputs, eqn.outputs
    dim = eqn.params["dim"]
    axis = vw.dims.index(dim)
    split = tuple(wl[axis])
    want = ctx.wanted[out]
    rows = {a for d, lay in zip(out.dims, want, strict=True) if d in vg.dims for a in lay}
    if split and rows >= set(split):
        return expert_routes.route(ctx, eqn, args, split)
    by_dim = {
        d: tuple(a for a in lay if a not in split) for d, lay in zip(out.dims, want, strict=True)
    }
    w_lay = tuple(split if d == dim else by_dim.get(d, ()) for d in vw.dims)
    w = ctx.relayout(w, wl, w_lay)
    x = ctx.relayout(x, xl, tuple(by_dim.get(d, ()) for d in vx.dims))
    g = ctx.relayout(g, gl, layout_in(vg.dims, by_dim))
    cur = layout_in(out.dims, by_dim)
    if not split:
        return [(ctx.relayout(ctx.local(eqn.primitive, x, w, g, **eqn.params), cur, want), want)]
    g = wide_indices(ctx, g)
    me = ctx.axis_index(split)
    n = w.shape[axis]
    g = ctx.call(minus_block, g, me, n=n, like=g)
    y = ctx.local(eqn.primitive, x, w, g, **eqn.params)
    scatter, reduce, cur = combine(split, cur, want)  # as a contraction's partial sums
    for a, j in scatter:
        y = ctx.psum_scatter(y, (a,), j)
    return [(ctx.relayout(ctx.psum(y, reduce), cur, want), want)]
