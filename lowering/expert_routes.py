"""Expert parallelism by all-to-all: each row goes to the device holding its group's
weight and back, exactly (dropless), in buffers of static size.

Under a layout that splits a grouped matmul's weight (or a grouped FFN's weights) along
its group dim (`experts:e`) and its rows (the groups' dims) over the same mesh axes,
each device holds its own rows and its block of the groups. A round sends each device's
next `capacity` rows per destination, their groups' local ids packed beside them (in
extra lanes of the rows' dtype, `packed`), by one all_to_all, runs
the rows it receives through its own groups' weights (`grouped_rows`; a grouped FFN's
every product and its activation, so the hidden layer never moves), and returns the
results by a second all_to_all; the backward pass's transposes send the results' and
the rows' cotangents (2 more; the id lanes' are zeros). Rounds repeat until
every row is done: how many the busiest (source, destination) pair needs, agreed by a
pmax of each device's largest count, so buffers keep a static size and nothing is
dropped whatever the load. A
balanced load takes one round, whose bytes are `slack` times the least that moving
each row to its expert and back can send; the worst (every row to one device) takes
ceil(rows / capacity) rounds. (`jax.lax.ragged_all_to_all` sends exact counts in one
go, but XLA:CPU does not implement it: "HLO opcode `ragged-all-to-all` is not
supported by XLA:CPU ThunkEmitter", jax 0.10.)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from lowering.layout import local_shape
from lowering.shards import Local, all_to_all
from namedmesh.contract import varying_axes
from namedmesh.grouped import as_rows, grouped_rows
from namedmesh.grouped_ffn import ACTIVATIONS, as_ffn_rows, ffn_rows

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


def routed(most, *arrays, prepare, kernel, axes, devices, capacity, dtype, shape):
    """A grouped product of this device's rows with the devices' blocks of groups along
    mesh `axes`, by rounds of all_to_all: `prepare(*arrays)` gives (rows x (n, c), their
    groups g (n,), this device's weights), `kernel(rows, ids, *weights)` the products of
    rows that arrived (ids: their groups' index in this device's block, -1 for an empty
    slot, whose row must come out zero); `most` is the busiest pair's count over all
    devices (invariant). `shape`: the result's, which the planner reads
    (lowering/ops.py)."""
    x, g, weights = prepare(*arrays)
    x = x.astype(dtype)
    groups, (n, c) = weights[0].shape[0], x.shape
    o = math.prod(shape) // max(n, 1)
    dest, rank = destinations(g, groups, devices)
    local = g - dest * groups  # the group's index in its device's block
    move = lambda a: all_to_all(a, axes, 0, 0)  # noqa: E731 (the all_to_all row's)
    k = devices * capacity

    def one_round(t, out):
        first = t * capacity
        sent = (dest < devices) & (rank >= first) & (rank < first + capacity)
        slot = jnp.where(sent, dest * capacity + rank - first, k)  # k: not this round
        rows = jnp.zeros((k, c), dtype).at[slot].set(x, mode="drop")
        ids = jnp.full((k,), -1, jnp.int32).at[slot].set(local, mode="drop")
        rows, ids = unpacked(move(packed(rows, ids, groups)), c, groups)
        back = move(kernel(rows, ids, *weights))
        got = jnp.take(back, slot, axis=0, mode="fill", fill_value=0)
        return out + jnp.where(sent[:, None], got, jnp.zeros((), dtype))

    rounds = (most + capacity - 1) // capacity
    out = jnp.zeros((n, o), dtype)  # the carry varies as every round's result does
    vary = tuple(set().union(*(varying_axes(a) for a in (x, g, *weights))))
    out = jax.lax.pcast(out, vary, to="varying") if vary else out

    def body(out, t):
        return jax.lax.cond(t < rounds, one_round, lambda t, out: out, t, out), None

    out, _ = jax.lax.scan(body, out, jnp.arange(math.ceil(n / capacity)))
    return out.reshape(shape)


def id_lanes(dtype, groups: int) -> int:
    """Lanes of the float `dtype` that carry a row's group id in [-1, groups) beside it
    (`packed`): one per digit of id + 1 in base 2^(mantissa bits + 1), the integers the
    dtype holds exactly (bfloat16: 256, so two lanes past 255 groups; float32: 2^24)."""
    base, lanes = _base(dtype), 1
    while base**lanes <= groups:
        lanes += 1
    return lanes


def _base(dtype) -> int:
    return 2 ** (int(jnp.finfo(dtype).nmant) + 1)


def packed(rows, ids, groups: int):
    """The rows (k, c) with their group `ids` (k,), each in [-1, groups), in
    `id_lanes` more columns of the rows' dtype, so that one all_to_all moves both. Each
    lane holds a digit of id + 1 as a small whole number, which any float holds and any
    copy keeps. (Not the id's bits: XLA:CPU canonicalises a NaN's bits where it
    concatenates bfloat16, and -1's bits are a NaN's.)"""
    base, code = _base(rows.dtype), ids + 1
    digits = [(code // base**i) % base for i in range(id_lanes(rows.dtype, groups))]
    return jnp.concatenate([rows, jnp.stack(digits, 1).astype(rows.dtype)], axis=1)


def unpacked(buffer, c: int, groups: int):
    """(rows, ids) of a `packed` buffer whose rows are `c` wide."""
    lanes = jax.lax.stop_gradient(buffer[:, c:]).astype(jnp.int32)  # (an id has no cotangent)
    base = _base(buffer.dtype)
    code = sum(lanes[:, i] * base**i for i in range(id_lanes(buffer.dtype, groups)))
    return buffer[:, :c], code - 1


def matmul_rows(x, w, g, *, dim, dims, dtype):
    """`routed`'s `prepare` of a grouped matmul: (rows, groups, (weight,))."""
    x, w, g, _ = as_rows(jnp, x, w, g, dim, *dims)
    return x, g, (w.astype(dtype),)


def matmul_kernel(rows, ids, w):
    """`routed`'s `kernel` of a grouped matmul: the rows that arrived times their groups'
    weights."""
    return grouped_rows(rows, w, ids)


def ffn_prepare(x, wi, wo, g, *wg, dim, dims, activation):
    """`routed`'s `prepare` of a grouped FFN: (rows, groups, (wi, wo[, wg]))."""
    del activation  # (the kernel's)
    x, g, wi, wo, wg, _ = as_ffn_rows(jnp, x, wi, wo, g, *wg or [None], dim, dims)
    return x, g, (wi, wo) if wg is None else (wi, wo, wg)


def ffn_kernel(rows, ids, wi, wo, wg=None, *, activation):
    """`routed`'s `kernel` of a grouped FFN: the whole FFN of the rows that arrived,
    its hidden layers recomputed in the backward pass (jax.checkpoint) rather than saved:
    reverse mode stacks a round loop's residuals for every round it may run, so saved
    they held the hidden layers that many times (the MoE layer's training step of
    benchmarks/expert_ffn_routes.py: 7.4 MB of XLA temporaries saved, 2.6 MB
    recomputed, 4.2 MB for three routed grouped matmuls). Only local work is
    recomputed: the all_to_alls are outside it."""
    act = ACTIVATIONS[activation][1]
    run = lambda rows, ids, *ws: ffn_rows(grouped_rows, act, rows, ids, *ws)  # noqa: E731
    return jax.checkpoint(run)(rows, ids, wi, wo, *([] if wg is None else [wg]))


def route(ctx, eqn, args, split: tuple[str, ...]):
    """The grouped matmul rule's expert-parallel route (lowering/rules/grouped.py): rows stay
    split as the result wants them, over the weight's group split `split` too, and
    travel to their groups' devices by `routed`."""
    (x, xl), (w, wl), (g, gl) = args
    (vx, vw, vg), (out,) = eqn.inputs, eqn.outputs
    dim, want = eqn.params["dim"], ctx.wanted[out]
    by_dim = dict(zip(out.dims, want, strict=True))
    lay = lambda dims: tuple(split if d == dim else by_dim.get(d, ()) for d in dims)  # noqa: E731
    w, x, g = (
        ctx.relayout(a, src, lay(v.dims)) for a, src, v in ((w, wl, vw), (x, xl, vx), (g, gl, vg))
    )
    local = dict(zip(vw.dims, w.shape, strict=True))
    c = math.prod(local[d] for d in vw.dims if d in vx.dims)
    o = math.prod(local[d] for d in vw.dims if d != dim and d not in vx.dims)
    prepare = functools.partial(matmul_rows, dim=dim, dims=eqn.params["dims"], dtype=out.dtype)
    y = send(ctx, eqn, split, (x, w, g), g, w.shape[vw.dims.index(dim)], (c, o), prepare,
             matmul_kernel)  # fmt: skip
    return [(y, want)]


def send(ctx, eqn, split, arrays, g, groups: int, widths, prepare, kernel):
    """The "routed" instruction of local `arrays` (rows, weights and groups `g`, laid out
    for it) and its plan: the busiest pair's count (pmax), two all_to_all per round
    (logged for one round, the balanced load's: rows `widths[0]` wide and their ids'
    lanes out, results `widths[1]` wide back; each transposed in the backward pass,
    the lanes' zero cotangents too), and one round's local op (its flops)."""
    (out,) = eqn.outputs
    devices = math.prod(ctx.sizes[a] for a in split)
    cap = capacity(math.prod(g.shape), devices)
    most = _busiest(ctx, g, groups, devices)
    (c, o), k, size = widths, devices * cap, np.dtype(out.dtype).itemsize
    for width in (c + id_lanes(out.dtype, groups), o):
        ctx.log("all_to_all", split, k * width * size, transposes=True)
    # the rows' sizes are g's local ones (a pipeline's microbatch has fewer than the
    # value's layout gives), the other dims' the layout's
    vg = eqn.inputs[next(i for i, a in enumerate(arrays) if a is g)]
    rows = dict(zip(vg.dims, g.shape, strict=True))
    full = local_shape(ctx.wanted[out], out.shape, ctx.mesh)
    shape = tuple(rows.get(d, n) for d, n in zip(out.dims, full, strict=True))
    y = ctx.instruction("routed", most, *arrays, prepare=prepare, kernel=kernel, axes=split,
                        devices=devices, capacity=cap, dtype=out.dtype, shape=shape)  # fmt: skip
    # one round's local op: the rows and their groups a round's buffer, the weights own
    one = [
        Local(_flat(len(v.dims), k, c if i == 0 else 1), a.dtype) if i == 0 or a is g else a
        for i, (v, a) in enumerate(zip(eqn.inputs, arrays, strict=True))
    ]
    ctx.note_local(eqn.primitive, eqn.params, one, [Local(_flat(len(out.dims), k, o), y.dtype)])
    return y


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
