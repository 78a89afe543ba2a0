"""Expert parallelism by all-to-all: each row goes to the device holding its group's
weight and back, exactly (dropless), in buffers of static size.

Under a layout that splits a grouped matmul's weight along its group dim (`experts:e`)
and its rows (the groups' dims) over the same mesh axes, each device holds its own
rows and its block of the groups. A round sends each device's next `capacity` rows
per destination by one all_to_all (and their groups' local ids by a second), multiplies
the rows it receives by its own groups' weights (`grouped_rows`), and returns the
results by a third all_to_all. Rounds repeat until every row is done: how many the
busiest (source, destination) pair needs, agreed by a pmax of each device's largest
count, so buffers keep a static size and nothing is dropped whatever the load. A
balanced load takes one round, whose bytes are `slack` times the least that moving
each row to its expert and back can send; the worst (every row to one device) takes
ceil(rows / capacity) rounds. (`jax.lax.ragged_all_to_all` sends exact counts in one
go, but XLA:CPU does not implement it: "HLO opcode `ragged-all-to-all` is not
supported by XLA:CPU ThunkEmitter", jax 0.10.)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from lowering.layout import local_shape
from lowering.shards import Local, all_to_all
from namedmesh.contract import varying_axes
from namedmesh.grouped import as_rows, grouped_rows

SLACK = 1.5  # a round's slots per destination, over an even share of the rows


def capacity(rows: int, devices: int, slack: float = SLACK) -> int:
    """Slots per destination of one round, for `rows` rows on each of `devices`."""
    return max(1, min(rows, math.ceil(slack * rows / devices)))


def destinations(g, groups: int, devices: int):
    """(destination device of each row, or `devices` for a group outside [0, groups x
    devices): a zero row sent nowhere; the row's rank among those sent there)."""
    inside = (g >= 0) & (g < groups * devices)
    dest = jnp.where(inside, g // groups, devices)
    first = jax.nn.one_hot(dest, devices + 1, dtype=jnp.int32)
    rank = jnp.take_along_axis(jnp.cumsum(first, 0) - 1, dest[:, None], axis=1)[:, 0]
    return dest, rank


def busiest(g, groups: int, devices: int):
    """The most rows this device sends to one device (int32), from its rows' groups."""
    dest, _ = destinations(g.reshape(-1).astype(jnp.int32), groups, devices)
    return jnp.max(jnp.zeros(devices + 1, jnp.int32).at[dest].add(1)[:devices])


def routed(x, w, g, most, *, axes, devices, capacity, dim, dims, dtype, shape=None):
    """The grouped matmul of this device's rows `x` (`dims`: x's, w's and g's dims) with
    the devices' blocks of groups along mesh `axes` (`w` this device's), by rounds of
    all_to_all; `most` is the busiest pair's count over all devices (invariant).
    `shape`: the result's, which the planner reads (lowering/ops.py)."""
    x, w, g, shape = as_rows(jnp, x, w, g, dim, *dims)
    x, w = x.astype(dtype), w.astype(dtype)
    groups, (n, c), o = w.shape[0], x.shape, w.shape[-1]
    dest, rank = destinations(g, groups, devices)
    local = g - dest * groups  # the group's index in its device's block
    move = lambda a: all_to_all(a, axes, 0, 0)  # noqa: E731 (the all_to_all row's)
    k = devices * capacity

    def one_round(t, out):
        first = t * capacity
        sent = (dest < devices) & (rank >= first) & (rank < first + capacity)
        slot = jnp.where(sent, dest * capacity + rank - first, k)  # k: not this round
        rows = move(jnp.zeros((k, c), dtype).at[slot].set(x, mode="drop"))
        ids = move(jnp.full((k,), -1, jnp.int32).at[slot].set(local, mode="drop"))
        back = move(grouped_rows(rows, w, ids))
        got = jnp.take(back, slot, axis=0, mode="fill", fill_value=0)
        return out + jnp.where(sent[:, None], got, jnp.zeros((), dtype))

    rounds = (most + capacity - 1) // capacity
    out = jnp.zeros((n, o), dtype)  # the carry varies as every round's result does
    vary = tuple(set().union(*(varying_axes(a) for a in (x, w, g))))
    out = jax.lax.pcast(out, vary, to="varying") if vary else out

    def body(out, t):
        return jax.lax.cond(t < rounds, one_round, lambda t, out: out, t, out), None

    out, _ = jax.lax.scan(body, out, jnp.arange(math.ceil(n / capacity)))
    return out.reshape(shape)


def route(ctx, eqn, args, split: tuple[str, ...]):
    """The grouped matmul rule's expert-parallel route (lowering/rules/grouped.py): rows stay
    split as the result wants them, over the weight's group split `split` too, and
    travel to their groups' devices by `routed`. Planned: the busiest pair's count
    (pmax), three all_to_all per round (logged for one round, the balanced load's), and
    one round's grouped matmul (its flops)."""
    (x, xl), (w, wl), (g, gl) = args
    (vx, vw, vg), (out,) = eqn.inputs, eqn.outputs
    dim, want = eqn.params["dim"], ctx.wanted[out]
    by_dim = dict(zip(out.dims, want, strict=True))
    lay = lambda dims: tuple(split if d == dim else by_dim.get(d, ()) for d in dims)  # noqa: E731
    w, x, g = (
        ctx.relayout(a, src, lay(v.dims)) for a, src, v in ((w, wl, vw), (x, xl, vx), (g, gl, vg))
    )
    devices = math.prod(ctx.sizes[a] for a in split)
    groups, rows = w.shape[vw.dims.index(dim)], math.prod(g.shape)
    cap = capacity(rows, devices)
    most = _busiest(ctx, g, groups, devices)
    local = dict(zip(vw.dims, w.shape, strict=True))
    c = math.prod(local[d] for d in vw.dims if d in vx.dims)
    o = math.prod(local[d] for d in vw.dims if d != dim and d not in vx.dims)
    k, size = devices * cap, np.dtype(out.dtype).itemsize
    for nbytes, transposes in ((k * c * size, True), (k * 4, False), (k * o * size, True)):
        ctx.log("all_to_all", split, nbytes, transposes=transposes)
    shape = local_shape(want, out.shape, ctx.mesh)
    p = eqn.params
    y = ctx.instruction("routed", x, w, g, most, axes=split, devices=devices, capacity=cap,
                        dim=dim, dims=p["dims"], dtype=out.dtype, shape=shape)  # fmt: skip
    one = [Local(_flat(len(v.dims), k, n), a.dtype) for v, a, n in ((vx, x, c), (vg, g, 1))]
    ctx.note_local(
        eqn.primitive, p, [one[0], w, one[1]], [Local(_flat(len(out.dims), k, o), y.dtype)]
    )
    return [(y, want)]


def _busiest(ctx, g, groups: int, devices: int):
    """The busiest pair's count over every device (invariant), once per groups `g`:
    the grouped matmuls of one layer route the same groups, and XLA would merge their
    pmaxes."""
    key = (id(g), "busiest", groups, devices)
    done = ctx.moved.get(key)
    if done is None:
        most = ctx.call(busiest, g, groups=groups, devices=devices, shape=(), dtype=np.int32)
        most = ctx.pmax(most, tuple(a for a in ctx.sizes if a in ctx.vma(most)))
        done = ctx.moved[key] = (g, most)  # g is kept, so that its id stays its own
    return done[1]


def _flat(ndim: int, rows: int, last: int) -> tuple[int, ...]:
    """A shape of `ndim` dims holding `rows` rows of `last` values (a round's buffer, as
    the cost rule of the grouped matmul reads an operand)."""
    return (rows,) if ndim == 1 else (rows, *(1,) * (ndim - 2), last)
