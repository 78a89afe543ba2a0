"""SPMD rules: how each primitive runs on local shards, and which collectives it needs.

A rule takes (ctx, eqn, [(local array, layout), ...]) and returns the outputs as
[(local array, layout), ...]. `@rule(name, ...)` stores it in the primitive's
`spmd_rule` slot (namedmesh.REGISTRY). Primitives without a rule of their own use
`replicated_rule`: gather every input, run the op whole, leave the result
replicated (correct for every primitive, and the baseline the others improve on).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from lowering import collectives as col
from lowering.layout import local_shape
from namedmesh.primitive import REGISTRY


def rule(*names):
    """Fill the `spmd_rule` slot of the named primitives."""

    def register(fn):
        for n in names:
            REGISTRY[n].spmd_rule = fn  # a KeyError here is a typo in a primitive name
        return fn

    return register


def rule_for(prim):
    return prim.spmd_rule or replicated_rule


def replicated_rule(ctx, eqn, args):
    xs = [ctx.relayout(x, lay, ((),) * len(lay)) for x, lay in args]
    outs = ctx.local(eqn.primitive, *xs, **eqn.params)
    outs = outs if eqn.primitive.multiple_results else (outs,)
    return [(o, ((),) * len(v.dims)) for o, v in zip(outs, eqn.outputs, strict=True)]


def _layout_in(dims, layout_of):
    return tuple(layout_of.get(d, ()) for d in dims)


ELEMENTWISE = (
    "negative abs sign square reciprocal exp log log1p expm1 sqrt rsqrt sin cos tan tanh erf "
    "sigmoid relu gelu silu floor ceil round logical_not isnan isfinite add subtract multiply "
    "divide floor_divide mod power maximum minimum arctan2 equal not_equal less less_equal "
    "greater greater_equal logical_and logical_or logical_xor where"
).split()


@rule(*ELEMENTWISE)
def elementwise_rule(ctx, eqn, args):
    """Inputs relaid to the output's layout; the op runs on matching shards."""
    (out,) = eqn.outputs
    want = ctx.wanted[out]
    by_dim = dict(zip(out.dims, want, strict=True))
    xs = [
        ctx.relayout(x, lay, _layout_in(v.dims, by_dim))
        for (x, lay), v in zip(args, eqn.inputs, strict=True)
    ]
    return [(ctx.local(eqn.primitive, *xs, **eqn.params), want)]


@rule("convert", "stop_gradient", "rename")
def same_layout_rule(ctx, eqn, args):
    """Ops that act on each element alone and keep the dims' order: any layout will do."""
    ((x, lay),) = args
    return [(ctx.local(eqn.primitive, x, **eqn.params), lay)]


@rule("constrain")
def constrain_rule(ctx, eqn, args):
    """The value moved to the layout the constraint pins."""
    ((x, lay),) = args
    want = ctx.wanted[eqn.outputs[0]]
    return [(ctx.relayout(x, lay, want), want)]


@rule("einsum")
def einsum_rule(ctx, eqn, args):
    """Compute layout from the rules over all the einsum's dims (so each mesh axis splits at
    most one of them); a summed dim split on an axis leaves partial sums, combined by
    psum_scatter into an output dim the output wants split on that axis, else by psum."""
    (out,) = eqn.outputs
    sizes = {d: n for v in eqn.inputs for d, n in zip(v.dims, v.shape, strict=True)}
    all_dims = tuple(dict.fromkeys(d for v in eqn.inputs for d in v.dims))
    comp = dict(zip(all_dims, ctx.soft_layout(all_dims, [sizes[d] for d in all_dims]), strict=True))
    xs = [
        ctx.relayout(x, lay, _layout_in(v.dims, comp))
        for (x, lay), v in zip(args, eqn.inputs, strict=True)
    ]
    y = ctx.local(eqn.primitive, *xs, **eqn.params)
    cur = list(_layout_in(out.dims, comp))
    want = ctx.wanted[out]
    summed = [a for d in all_dims if d not in out.dims for a in comp[d]]
    reduce = []
    for a in summed:
        j = next((j for j, w in enumerate(want) if a in w), None)
        if j is not None and tuple(want[j][: len(cur[j]) + 1]) == tuple(cur[j]) + (a,):
            y = col.psum_scatter(y, (a,), j, ctx.log)
            cur[j] = tuple(cur[j]) + (a,)
        else:
            reduce.append(a)
    y = col.psum(y, tuple(reduce), ctx.log)
    return [(ctx.relayout(y, tuple(cur), want), want)]


def _reduced(eqn, lay):
    axes = eqn.params["axes"]
    split = tuple(a for i in axes for a in lay[i])
    kept = tuple(lay[i] for i in range(len(lay)) if i not in axes)
    return split, kept


@rule("sum", "max", "min", "any", "all", "mean", "logsumexp")
def reduction_rule(ctx, eqn, args):
    """The reduction on each shard, then combined over the axes that split reduced dims:
    psum for sum (mean divides by the shard count); max, min, any and all reduce the
    gathered per-shard results (differentiable, unlike pmax); logsumexp is
    m + log(psum(exp(lse - m))) with m the largest per-shard value."""
    ((x, lay),) = args
    split, kept = _reduced(eqn, lay)
    name, out = eqn.primitive.name, eqn.outputs[0]
    y = ctx.local(eqn.primitive, x, **eqn.params)
    if name in ("sum", "mean"):
        y = col.psum(y, split, ctx.log)
        if name == "mean" and split:
            y = y / math.prod(ctx.sizes[a] for a in split)
    elif name in ("max", "min", "any", "all") and split:
        y = getattr(jnp, name)(col.gather_stacked(y, split, ctx.log), axis=0)
    elif split:  # logsumexp
        m = jnp.max(col.gather_stacked(jax.lax.stop_gradient(y), split, ctx.log), axis=0)
        m = jnp.where(jnp.isfinite(m), m, 0)
        y = m + jnp.log(col.psum(jnp.exp(y - m), split, ctx.log))
    want = ctx.wanted[out]
    return [(ctx.relayout(y.astype(out.dtype), kept, want), want)]


@rule("softmax", "log_softmax")
def softmax_rule(ctx, eqn, args):
    """Along split dims: the global max (of the gathered per-shard maxes) is subtracted,
    the shards' sums of exponentials are psum-ed; nothing else moves."""
    ((x, lay),) = args
    out = eqn.outputs[0]
    want = ctx.wanted[out]
    axes = eqn.params["axes"]
    split = tuple(a for i in axes for a in lay[i])
    if not split:
        y = ctx.local(eqn.primitive, x, **eqn.params)
        return [(ctx.relayout(y, lay, want), want)]
    x = x.astype(out.dtype)
    m = jax.lax.stop_gradient(jnp.max(x, axis=axes, keepdims=True))
    m = jnp.max(col.gather_stacked(m, split, ctx.log), axis=0)
    m = jnp.where(jnp.isfinite(m), m, 0)
    total = col.psum(jnp.sum(jnp.exp(x - m), axis=axes, keepdims=True), split, ctx.log)
    if eqn.primitive.name == "softmax":
        y = jnp.exp(x - m) / total
    else:
        y = x - m - jnp.log(total)
    return [(ctx.relayout(y, lay, want), want)]


@rule(
    "cumsum",
    "argmax",
    "argmin",
    "top_k",
    "slice",
    "pad",
    "shift",
    "split",
    "concat",
)
def along_dims_rule(ctx, eqn, args):
    """Ops that act along some dims and are independent across the others: the acted-on
    dims are gathered, every other dim keeps its split, and outputs keep the inputs' dims
    in place (a reduced dim leaves)."""
    p = eqn.params
    acted = set(p["axes"]) if "axes" in p else {p["axis"]}
    xs, kept = [], None
    for x, lay in args:
        lay2 = tuple(() if i in acted else a for i, a in enumerate(lay))
        if kept is None:
            kept = lay2
        xs.append(ctx.relayout(x, lay, kept))
    outs = ctx.local(eqn.primitive, *xs, **p)
    outs = outs if eqn.primitive.multiple_results else (outs,)
    result = []
    for o, v in zip(outs, eqn.outputs, strict=True):
        lay = (
            kept
            if len(v.dims) == len(kept)
            else tuple(a for i, a in enumerate(kept) if i not in acted)
        )
        want = ctx.wanted[v]
        result.append((ctx.relayout(o, lay, want), want))
    return result


def _offsets(ctx, layout, local):
    return [
        col.axis_index(axes, ctx.sizes) * n if axes else 0
        for axes, n in zip(layout, local, strict=True)
    ]


@rule("random")
def random_rule(ctx, eqn, args):
    """Each device draws only its own block, from the block's global offsets: the values
    equal the single-device ones under every layout, and nothing moves."""
    from namedmesh.random import random_values

    ((key, lay),) = args
    key = ctx.relayout(key, lay, ((),))
    (out,) = eqn.outputs
    want = ctx.wanted[out]
    local = local_shape(want, out.shape, ctx.mesh)
    p = eqn.params
    y = random_values(
        key,
        p["shape"],
        p["dist"],
        p["dtype"],
        p["args"],
        xp=jnp,
        offsets=_offsets(ctx, want, local),
        shape=local,
    )
    return [(y, want)]


@rule("full")
def full_rule(ctx, eqn, args):
    (out,) = eqn.outputs
    want = ctx.wanted[out]
    p = eqn.params
    return [(jnp.full(local_shape(want, out.shape, ctx.mesh), p["value"], p["dtype"]), want)]


@rule("iota")
def iota_rule(ctx, eqn, args):
    (out,) = eqn.outputs
    want = ctx.wanted[out]
    (n,) = local_shape(want, out.shape, ctx.mesh)
    (off,) = _offsets(ctx, want, (n,))
    p = eqn.params
    return [((p["start"] + p["step"] * (jnp.arange(n) + off)).astype(p["dtype"]), want)]
