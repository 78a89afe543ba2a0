"""The rules of ops that make values from no input (random draws, full, iota): each
device makes its own block, and nothing moves."""

from __future__ import annotations

import jax.numpy as jnp

from lowering.layout import local_shape
from lowering.rules.registry import P, rule


@rule(P.random)
def random_rule(ctx, eqn, args):
    """Each device draws only its own block, from the block's global offsets: the values
    equal the single-device ones under every layout, and nothing moves."""
    ((key, lay),) = args
    key = ctx.relayout(key, lay, ((),))
    (out,) = eqn.outputs
    want = ctx.wanted[out]
    local = local_shape(want, out.shape, ctx.mesh)
    p = eqn.params
    index = [ctx.axis_index(axes) for axes in want if axes]
    y = ctx.call(_random_block, key, *index, split=tuple(bool(a) for a in want), block=local,
                 full=p["shape"], dist=p["dist"], to=p["dtype"], params=p["args"],
                 shape=local, dtype=out.dtype)  # fmt: skip
    return [(y, want)]


def _random_block(key, *index, split, block, full, dist, to, params):
    """The block `block` of a draw of shape `full`: each split dim's block starts at this
    device's position (`index`, one per split dim) times the block's size."""
    from namedmesh.random import random_values

    it = iter(index)
    offsets = [next(it) * n if s else 0 for s, n in zip(split, block, strict=True)]
    return random_values(key, full, dist, to, params, xp=jnp, offsets=offsets, shape=block)


@rule(P.full)
def full_rule(ctx, eqn, args):
    """Each device makes its block of the constant: the primitive itself, over the
    block's shape (its shape rule gives the result's)."""
    (out,) = eqn.outputs
    want = ctx.wanted[out]
    block = local_shape(want, out.shape, ctx.mesh)
    return [(ctx.local(eqn.primitive, **{**eqn.params, "shape": block}), want)]


@rule(P.iota)
def iota_rule(ctx, eqn, args):
    """Each device makes its block of the range, from the block's offset."""
    (out,) = eqn.outputs
    want = ctx.wanted[out]
    (n,) = local_shape(want, out.shape, ctx.mesh)
    offset = (ctx.axis_index(want[0]),) if want[0] else ()
    p = eqn.params
    y = ctx.call(_iota, *offset, n=n, start=p["start"], step=p["step"], to=p["dtype"],
                 shape=(n,), dtype=out.dtype)  # fmt: skip
    return [(y, want)]


def _iota(*offset, n, start, step, to):
    """start + step * (the global positions of this device's block of n), in `to`."""
    off = offset[0] * n if offset else 0
    return (start + step * (jnp.arange(n) + off)).astype(to)
