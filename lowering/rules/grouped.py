"""The rules of `nm.grouped_matmul` (a mixture of experts' grouped matmul) and
`nm.grouped_ffn` (its whole expert FFN)."""

from __future__ import annotations

import functools
import math

from lowering import expert_routes
from lowering.rules.einsum import combine
from lowering.rules.registry import P, layout_in, rule
from lowering.rules.selection import minus_block, wide_indices
from namedmesh.grouped import roles


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


@rule(P.grouped_ffn)
def grouped_ffn_rule(ctx, eqn, args):
    """The rows (the groups' dims) and wo's output dims take the output's splits, the
    hidden dims keep wi's splits on axes nothing else takes (each device its block of
    the hidden layer; the result summed over those axes), x's contracted dims are
    gathered. Weights split along their group dim stay split: where the output splits
    the rows over those axes too, each row goes to its group's device, through the whole
    FFN there, and back, by one route (lowering/expert_routes.py); else each device
    runs the rows whose group falls in its block (the others are zero rows) and the
    result is summed over those axes too."""
    (x, xl), (wi, wil), (wo, wol), (g, gl), *gate = args
    vx, vwi, vwo, vg, *vwg = eqn.inputs
    (out,) = eqn.outputs
    dim, want = eqn.params["dim"], ctx.wanted[out]
    axis = vwi.dims.index(dim)
    split = tuple(wil[axis])
    rows = {a for d, lay in zip(out.dims, want, strict=True) if d in vg.dims for a in lay}
    routed = bool(split) and rows >= set(split)
    by_dim = {
        d: tuple(a for a in lay if routed or a not in split)
        for d, lay in zip(out.dims, want, strict=True)
    }
    taken = set(split).union(*by_dim.values())
    hidden = roles(vx.dims, vwi.dims, dim)[1]
    hid = {d: tuple(a for a in wil[vwi.dims.index(d)] if a not in taken) for d in hidden}

    def weight(a, src, v, outs: bool):
        lay = [split if d == dim else hid.get(d, by_dim.get(d, ()) if outs else ()) for d in v.dims]
        return ctx.relayout(a, src, tuple(lay))

    wi, wo = weight(wi, wil, vwi, False), weight(wo, wol, vwo, True)
    wg = [weight(a, src, v, False) for (a, src), v in zip(gate, vwg, strict=True)]
    x = ctx.relayout(x, xl, tuple(by_dim.get(d, ()) if d in vg.dims else () for d in vx.dims))
    g = ctx.relayout(g, gl, layout_in(vg.dims, by_dim))
    summed = tuple(a for d in hidden for a in hid[d])
    if routed:
        local = dict(zip(vwi.dims, wi.shape, strict=True)) | dict(
            zip(vwo.dims, wo.shape, strict=True)
        )
        c = math.prod(local[d] for d in vwi.dims if d in vx.dims)
        o = math.prod(local[d] for d in out.dims if d not in vg.dims)
        p = eqn.params
        prepare = functools.partial(expert_routes.ffn_prepare, **p)
        kernel = functools.partial(expert_routes.ffn_kernel, activation=p["activation"])
        y = expert_routes.send(ctx, eqn, split, (x, wi, wo, g, *wg), g, wi.shape[axis], (c, o),
                               prepare, kernel)  # fmt: skip
    else:
        if split:  # this device's groups: the others' rows are zero here
            g = wide_indices(ctx, g)
            me = ctx.axis_index(split)
            g = ctx.call(minus_block, g, me, n=wi.shape[axis], shape=g.shape, dtype=g.dtype)
            summed = split + summed
        y = ctx.local(eqn.primitive, x, wi, wo, g, *wg, **eqn.params)
    scatter, reduce, cur = combine(summed, layout_in(out.dims, by_dim), want)
    for a, j in scatter:
        y = ctx.psum_scatter(y, (a,), j)
    return [(ctx.relayout(ctx.psum(y, reduce), cur, want), want)]
