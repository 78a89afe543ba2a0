"""Pipeline parallelism as a layout: a rule that splits the scanned dim of an `nm.scan`
(`layers:stage`) runs the scan as a GPipe pipeline over the mesh axes of that rule.

Each device holds its stage's L/S iterations of the scanned inputs (its layers). The
carry is cut along its microbatched dim (`batch`; layout option `microbatch_dim`) into
M microbatches (layout option `microbatches`, e.g. `"layers:stage;microbatches=8"`).
The pipeline runs M+S-1 ticks; at tick t stage s runs its iterations on microbatch t-s
(stage 0 reads it from the carry, the others receive it from the stage before by
`ppermute`), so (S-1)/(M+S-1) of the ticks are the bubble, where a stage computes on
zeros (or a stale microbatch) whose result is dropped, and whose inputs' gradients are
masked (`_bubble_masked`: a body singular at zero must not make them NaN). The last
stage's results are broadcast to every stage (a psum over the stage axes) as the scan's
final carry; ys stay on the stage whose iterations made them, split along the scanned dim
as the layout says.

Gradients come from jax's transposition of this program: the backward pass runs the
ticks in reverse, each ppermute transposed to one to the stage before, and each
stage's gradients of its own layers stay on that stage.

Two parts: `plan_pipeline` decides the schedule and its cost in plain Python (the
`PipelinePlan`, which `report()` shows); `emit` is the scan's SPMD rule for it, written
against the RuleContext's operations alone (relayout, casts, `collective`, `call` for
the local arithmetic with its shapes stated, `loop` for the ticks): the Planner plans
it on `Local`s without jax (the ticks a "scan" instruction whose body is the tick's
step, the stage's own loop inside it), and the emitter runs that. Every collective is
logged by `ctx.log` as every rule does, so that the plan, the report and the compiled
HLO agree.

The default M is the largest divisor of the carry's local microbatched size up to 4S
(a bubble of at most about 20%) that leaves each microbatch divisible by the body's
constraints on that dim, or 1 where the carry lacks that dim or the body is not
per-example along it; an explicit M that cannot be used is a PipelineError, as is a
constraint in the body on the stages' mesh axes (`_pinned_split`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowering.collectives import WiderCarry
from lowering.cost import traffic
from lowering.layout import Layout
from lowering.plan import Step, nbytes
from namedmesh.errors import PipelineError, fmt_dims
from namedmesh.primitive import is_inexact
from namedmesh.uneven import recorded


@dataclass(frozen=True)
class PipelinePlan:
    """The schedule of one pipelined scan and its cost per device (bytes are per
    device, of one call; `stack_bytes` the scanned inputs' bytes per device were they
    not split into stages)."""

    schedule: str
    axes: tuple[str, ...]  # the mesh axes the stages run along
    stages: int
    microbatches: int
    length: int  # the scan's iterations (layers), L
    dim: str | None  # the carry dim cut into microbatches (None when M = 1 needs none)
    microbatch_bytes: int  # one microbatch of the carry (all its tensors)
    stack_bytes: int
    saved_bytes: int = 0  # activations one iteration keeps for the backward pass
    repeats: int = 1  # circular: each microbatch passes every stage this many times
    averaged: int = 0  # per-iteration results without `dim`: the microbatches' averaged
    deal: object = None  # uneven stages: the real layers' namedmesh.uneven.Deal (None: all real)

    @property
    def ticks(self) -> int:
        """Pipeline iterations, R*M + S - 1: each stage runs `layers_per_tick` layers once
        per tick (R = 1 for GPipe)."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def layers_per_stage(self) -> int:
        return self.length // self.stages

    @property
    def layers_per_tick(self) -> int:
        """L/S for GPipe; L/(S*R) for the circular schedule: one of a stage's R chunks."""
        return self.length // (self.stages * self.repeats)

    @property
    def bubble(self) -> float:
        """The fraction of ticks a stage idles (computes on zeros): (S-1)/(R*M+S-1)."""
        return (self.stages - 1) / self.ticks

    @property
    def reorder_bytes(self) -> float:
        """Sent per device and direction to deal the stage's layers out circularly (an
        all_to_all of its share of the stack); 0 for GPipe."""
        if self.repeats == 1:
            return 0.0
        return traffic("all_to_all", ("stage",), self.parameter_bytes, {"stage": self.stages})

    @property
    def broadcast_bytes(self) -> float:
        """Sent to give every stage the last stage's result (an all-reduce)."""
        carry = self.microbatches * self.microbatch_bytes
        return traffic("psum", ("stage",), carry, {"stage": self.stages})

    @property
    def forward_bytes(self) -> float:
        """Sent per device forward: one microbatch to the next stage per tick, then the
        broadcast of the result (and the circular schedule's reorder of the layers)."""
        return self.ticks * self.microbatch_bytes + self.broadcast_bytes + self.reorder_bytes

    @property
    def backward_bytes(self) -> float:
        """Sent per device backward: one microbatch's gradient to the stage before per
        tick, then the all-reduce that sums the carry's gradient (only stage 0 read it)."""
        return self.ticks * self.microbatch_bytes + self.broadcast_bytes + self.reorder_bytes

    @property
    def minimum_bytes(self) -> int:
        """Sent per device and direction at the least: the carry, once across its stage
        boundary (what `forward_bytes` and `backward_bytes` are held against)."""
        return self.microbatches * self.microbatch_bytes

    @property
    def parameter_bytes(self) -> int:
        """Per device: its stage's share of the scanned inputs (1/S of the stack)."""
        return self.stack_bytes // self.stages

    @property
    def activation_share(self) -> float:
        """The share of the scan's saved activations at the per-device batch (every
        iteration's, as were it not pipelined) that a device keeps: its L/S iterations
        for M+S-1 ticks of one microbatch, (M+S-1)/(S*M) (circular: L/(S*R) iterations
        for R*M+S-1 ticks). The memory estimate scales the scan's saved bytes by it
        (lowering/memory.py: `training_peak`)."""
        return self.ticks / (self.stages * self.repeats * self.microbatches)

    @property
    def activation_bytes(self) -> int:
        """Per device, kept for the backward pass: every tick's iterations."""
        return self.ticks * self.layers_per_tick * self.saved_bytes

    def lines(self) -> list[str]:
        """The plan in words, as `report()` prints it."""
        over = ",".join(self.axes)
        cut = f" of {self.dim!r}" if self.dim else ""
        return [
            f"pipeline ({self.schedule}) over {over}: {self.stages} stages x "
            f"{self.layers_per_stage} of {self.length} iterations"
            + (f" in {self.repeats} rounds" if self.repeats > 1 else "")
            + f", {self.microbatches} "
            f"microbatches{cut}, {self.ticks} ticks, bubble {self.bubble:.1%}",
            f"    bytes sent per device: forward {self.forward_bytes:,.0f}, backward "
            f"{self.backward_bytes:,.0f} (the activations' minimum: "
            f"{self.minimum_bytes:,.0f} each way)",
            f"    per device: stage parameters {self.parameter_bytes:,} bytes (stack "
            f"{self.stack_bytes:,}), activations kept {self.activation_bytes:,} bytes",
        ] + ([f"    {self.averaged} per-iteration result(s) without {self.dim!r}: each "
              "microbatch's own, averaged"] if self.averaged else []) + self.pads()  # fmt: skip

    def pads(self) -> list[str]:
        """Uneven stages: each stage's real layers and pads, and what the pads cost."""
        if self.deal is None:
            return []
        slots = sum(self.deal.slots)
        return [
            f"    uneven stages, {slots} layer slots each: {self.deal.words(self.deal.names)}",
            f"    pads skipped (a cond per slot, no layer work): {self.deal.pad_share:.1%} of "
            f"the layer slots; the stages of fewer layers idle {self.deal.idle_share:.1%} of "
            f"the layer time, besides the bubble's {self.bubble:.1%} of the ticks",
        ]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def default_microbatches(stages: int, size: int) -> int:
    """The largest divisor of `size` (the carry's local microbatched size) up to 4S."""
    return max(m for m in range(1, min(size, 4 * stages) + 1) if size % m == 0)


def plan_pipeline(
    *,
    axes: tuple[str, ...],
    stages: int,
    length: int,
    dim: str,
    local_size: int | None,
    mixing: str | None,
    requested: int | None,
    carry_bytes: int,
    stack_bytes: int,
    where: str = "scan",
    schedule: str = "gpipe",
    repeats: int | None = None,
    ys: bool = False,
) -> PipelinePlan:
    """The schedule of a scan of `length` iterations over `stages` stages along the
    mesh `axes`: its microbatches (`requested`, or the default) of the carry's dim
    `dim`, whose local size is `local_size` (None: a carry tensor lacks it) and along
    which `mixing` (None, or the body's op that mixes examples) says whether the body
    is per-example. `schedule` "gpipe", or "circular" with `repeats` rounds (default
    S) through the stages, for a body without per-iteration results (`ys` False).
    PipelineError, naming `where` and the rule, when it cannot run."""
    rule = f"layers rule over {','.join(axes)}"
    if length % stages:
        raise PipelineError(
            f"{where}: {length} iterations are not divisible by the {stages} stages of "
            f"mesh axes {axes} ({rule})"
        )
    if requested is None:
        m = 1 if local_size is None or mixing else default_microbatches(stages, local_size)
    else:
        m = requested
        if m > 1 and local_size is None:
            raise PipelineError(
                f"{where}: microbatches={m} cuts the carry along {dim!r}, which a carry "
                f"tensor lacks ({rule}); set microbatch_dim=, or microbatches=1"
            )
        if m > 1 and mixing:
            raise PipelineError(
                f"{where}: microbatches={m} needs a body that treats each {dim!r} entry on "
                f"its own, but {mixing}; set microbatches=1"
            )
        if m > 1 and local_size % m:
            raise PipelineError(
                f"{where}: dim {dim!r} of local size {local_size} (per device) is not "
                f"divisible by microbatches={m}"
            )
    plan = PipelinePlan(
        "gpipe", tuple(axes), stages, m, length, dim if m > 1 else None,
        carry_bytes // m, stack_bytes,
    )  # fmt: skip
    if schedule == "gpipe":
        return plan
    if schedule != "circular":
        raise PipelineError(f"{where}: schedule={schedule!r} is not gpipe or circular ({rule})")
    r = _circular_repeats(plan, repeats, ys, f"{where}: the circular schedule ({rule})")
    return dataclasses.replace(plan, schedule="circular", repeats=r)


def _circular_repeats(plan: PipelinePlan, repeats: int | None, ys: bool, where: str) -> int:
    """The circular schedule's rounds R (default S), or the PipelineError that forbids
    it: stage s holds the layers of chunks s, S+s, 2S+s, ... of L/(S*R) layers, dealt
    out from the layout's contiguous blocks by one all_to_all, which needs one stage
    axis and S | R; a microbatch's next round starts on stage 0 M ticks after its last,
    which needs M >= S."""
    s, m = plan.stages, plan.microbatches
    r = s if repeats is None else repeats
    if len(plan.axes) != 1:
        raise PipelineError(f"{where} runs over one mesh axis, not {plan.axes}")
    if r % s or plan.length % (s * r):
        raise PipelineError(
            f"{where}: repeats={r} must be a multiple of the {s} stages and divide the "
            f"{plan.length} iterations into {s}*{r} equal chunks"
        )
    if m < s:
        raise PipelineError(f"{where} needs at least {s} microbatches (one per stage), has {m}")
    if ys:
        raise PipelineError(f"{where} keeps no per-iteration results (ys); use schedule=gpipe")
    return r


def constraints(body):
    """The rules of every nm.constrain in `body` and the bodies nested in it."""
    for e in body.eqns:
        if e.primitive.name == "constrain":
            yield from e.params["layout"]
        if e.params.get("body") is not None:
            yield from constraints(e.params["body"])


def _like_carry(lay, v, carry_lay, carry_values, dim: str):
    """The layout of a captured input `v` (in `lay`) inside the stages: its microbatched
    `dim`, if it has it, split as the carry's, so that cutting both into microbatches
    gives each device's microbatch the same examples of each. (A value the body makes
    from no input is hoisted before the loop whole on every device, scan.hoisted: a
    random draw over the batch, cut from the whole batch, gave a device whose carry holds
    the second half of the batch the first half's draws.)"""
    split = next((c[u.dims.index(dim)] for c, u in zip(carry_lay, carry_values, strict=True)
                  if dim in u.dims), None)  # fmt: skip
    if split is None or dim not in v.dims:
        return lay
    i = v.dims.index(dim)
    free = lambda axes: tuple(a for a in axes if a not in split)
    return tuple(split if j == i else free(axes) for j, axes in enumerate(lay))


def _pinned_split(ctx, body, axes, dim: str, where: str) -> int:
    """How many ways the body's constraints split the microbatched `dim` (1: none).
    PipelineError for a constraint on the stages' own mesh axes: inside a stage they
    number the stages, which run different microbatches at each tick (and skip an
    uneven stage's pads), so a collective over them would mix microbatches or wait
    forever for a stage that skips it."""
    k = 1
    for d, on in constraints(body):
        if clash := [a for a in on if a in axes]:
            raise PipelineError(
                f"{where}: an nm.constrain in the body puts {d!r} on mesh axis {clash[0]!r}, "
                f"which the pipeline's stages run along (layers rule over {','.join(axes)}); "
                "constrain it over other mesh axes"
            )
        if d == dim:
            k = max(k, math.prod(ctx.sizes[a] for a in on))
    return k


def split_axes(x_args, x_axes) -> tuple[str, ...]:
    """The mesh axes that split the scanned dim of the first scanned input where any do
    (its stages), else ()."""
    for (_, lay), ax in zip(x_args, x_axes, strict=True):
        if lay[ax]:
            return tuple(lay[ax])
    return ()


def without_axes(layout: Layout, axes) -> Layout:
    """`layout` with the mesh `axes` taken out of every rule: inside a stage they split
    nothing, as every device along them runs other iterations."""
    rules = [(d, tuple(a for a in ax if a not in axes)) for d, ax in layout.rules]
    return Layout([(d, ax) for d, ax in rules if ax], layout.strict, shared=True)


def _acts_along(e, dim: str) -> bool:
    """Whether equation `e`'s parameters name `dim` (by name, or by its position in the
    first input as an `axis`/`axes` parameter): an op along it, such as a softmax."""
    if e.params.get("dim") == dim:
        return True
    if not e.inputs or dim not in e.inputs[0].dims:
        return False
    i = e.inputs[0].dims.index(dim)
    axes = e.params.get("axes", e.params.get("axis"))
    return i == axes or (isinstance(axes, tuple | list) and i in axes)


def mixing_op(body, n_carry: int, n_x: int, dim: str) -> str | None:
    """How `body` (a scan's Graph) is not per-example along `dim`, in words, or None when
    it is: every value made from a carry or captured value with `dim` keeps `dim`, none
    gets it otherwise, no op acts along it, and every carry (and each per-iteration
    result that has `dim`) has it. Only then may microbatches of the carry run through
    it apart. A per-iteration result without `dim` (a MoE layer's balancing loss, a mean
    over the batch) may be made by ops along it: each microbatch makes its own and the
    pipeline averages them (`averaged_ys`; Megatron's and DeepSeek's rule for the
    auxiliary loss). (Values made from no input are loop constants, which the scan's
    rule makes before the loop and captures: scan.hoisted.)"""
    for v in body.inputs[n_carry : n_carry + n_x]:
        if dim in v.dims:
            return f"a scanned input {fmt_dims(v.dims)} has {dim!r}"
    kept = [*body.outputs[:n_carry], *(v for v in body.outputs[n_carry:] if dim in v.dims)]
    batched = {v for v in body.inputs if dim in v.dims}
    why = _mixing(_Eqns(_needed(body.eqns, kept)), batched, dim)
    if why:
        return why
    for v in kept:
        if v not in batched:
            return f"the body returns {fmt_dims(v.dims)} without it"
    return None


def averaged_ys(body, n_carry: int, dim: str | None) -> list[bool]:
    """Per per-iteration result of `body`: whether it lacks the microbatched `dim`, so
    that the pipeline averages the microbatches' own (`mixing_op`)."""
    return [dim is not None and dim not in v.dims for v in body.outputs[n_carry:]]


class _Eqns(NamedTuple):
    """A body's equations alone, as `_mixing` reads them."""

    eqns: list


def _needed(eqns: list, outputs) -> list:
    """The equations of `eqns` that `outputs` are made from, in order."""
    need, out = set(outputs), []
    for e in reversed(eqns):
        if any(o in need for o in e.outputs):
            need.update(e.inputs)
            out.append(e)
    return out[::-1]


def _mixing(body, batched: set, dim: str) -> str | None:
    """`mixing_op`'s check of `body`'s equations, given the `batched` values (updated
    with those they make). A loop inside (nm.scan) is checked through its body: its
    results made from batched values must keep `dim`, the others (a ring's key
    positions, carried beside the batch) need not have it. Its per-iteration results
    without `dim` (a MoE layer's balancing loss, in a stage of scan_chain's stacks) may
    be made along it, as the body's own may, if only the body's own results read them."""
    mixed: set = set()  # such results: what reads them is made along `dim`
    for e in body.eqns:
        if any(v in mixed for v in e.inputs):
            return f"{e.primitive.name} {fmt_dims(e.outputs[0].dims)} reads a result made along it"
        has = any(v in batched for v in e.inputs)
        if has and e.primitive.loop and not _acts_along(e, dim):
            inner, nc, outs = e.params["body"], e.params["n_carry"], e.outputs
            start = {i for i, v in zip(inner.inputs, e.inputs, strict=True) if v in batched}
            free = [i for i, v in enumerate(inner.outputs) if i >= nc and dim not in v.dims]
            kept = [v for i, v in enumerate(inner.outputs) if i not in free]
            mixed.update(outs[i] for i in free)
            while True:  # until no carry becomes batched in an iteration that was not
                inside = set(start)
                why = _mixing(_Eqns(_needed(inner.eqns, kept)), inside, dim)
                if why:
                    return why
                more = {inner.inputs[i] for i in range(nc) if inner.outputs[i] in inside}
                if more <= start:
                    break
                start |= more
            for i, (v, o) in enumerate(zip(inner.outputs, outs, strict=True)):
                through = v in inside or (i < nc and inner.inputs[i] in inside)
                if through and dim not in o.dims:
                    return f"{e.primitive.name} {fmt_dims(o.dims)} acts along it"
                if through:
                    batched.add(o)
            continue
        if has and (_acts_along(e, dim) or any(dim not in v.dims for v in e.outputs)):
            return f"{e.primitive.name} {fmt_dims(e.outputs[0].dims)} acts along it"
        if not has and any(dim in v.dims for v in e.outputs):
            return f"{e.primitive.name} makes {fmt_dims(e.outputs[0].dims)} from no input with it"
        if has:
            batched.update(e.outputs)
    return None


# --- local arithmetic of the pipeline, run by `ctx.call` (emitted from the plan) ---
def _to_micro(x, ax: int, m: int):
    """(M, ...): `x` cut into m microbatches along axis `ax`, microbatch first."""
    shape = x.shape[:ax] + (m, x.shape[ax] // m) + x.shape[ax + 1 :]
    return jnp.moveaxis(x.reshape(shape), ax, 0)


def _from_micro(x, ax: int):
    """The inverse of `_to_micro`: microbatches (leading) joined along axis `ax`."""
    x = jnp.moveaxis(x, 0, ax)
    return x.reshape(x.shape[:ax] + (x.shape[ax] * x.shape[ax + 1],) + x.shape[ax + 2 :])


def _index(x, i):
    return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _put(buf, x, i, valid):
    """`buf` with entry i set to x where `valid` (a bool scalar), else kept."""
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(valid, x, _index(buf, i)), i, 0)


def _file(buf, x, t, *, lag: int, lo: int, hi: int, items: int, m: int):
    """`buf` with what the last stage (`lag` ticks behind tick `t`) finished, item
    t - lag, filed at its microbatch where lo <= t - lag < hi."""
    done = t - lag
    return _put(buf, x, jnp.clip(done, 0, items - 1) % m, (done >= lo) & (done < hi))


def _ticks_range(n: int):
    return jnp.arange(n, dtype=jnp.int32)


def _working(ctx, t, s, items: int):
    """Whether stage s has an item (0 <= t - s < items) at tick t (a bool scalar)."""
    return ctx.call(_has_item, t, s, items=items, shape=(), dtype=bool)


def _has_item(t, s, *, items: int):
    return (t - s >= 0) & (t - s < items)


def _bubble_masked(ctx, working, x_in, layers, rest):
    """The stage's inputs at a tick, their gradients masked where it has no item (the
    bubble): there its input is zeros or a stale microbatch, at which a body may be
    singular (y / |y|, log, 1/x), and the zero cotangent of its dropped result times an
    infinite derivative is NaN in the layers' gradients. Masking each input's cotangent
    after the body's backward pass (a select, `_gradient_where`) drops that NaN; values
    are untouched, and on the working ticks the gradients are one device's. (A cond that
    skipped the bubble's work would save the stage's layers once per tick for its
    backward pass, as jax's cond keeps them as residuals.)"""
    vma = ctx.vma(working)

    def mask(x):  # (integers and bools have no gradient)
        if not is_inexact(x.dtype):
            return x
        return ctx.call(_gradient_where, ctx.varying(x, vma), working, like=x)

    return ([mask(x) for x in x_in], [mask(x) for x in layers],
            [(mask(r), lay) for r, lay in rest])  # fmt: skip


@jax.custom_jvp
def _gradient_where(x, keep):
    """`x`, its tangent (so its cotangent) zeroed where the bool `keep` is False."""
    return x


@_gradient_where.defjvp
def _gradient_where_jvp(primals, tangents):
    x, keep = primals
    return x, jnp.where(keep, tangents[0], jnp.zeros_like(tangents[0]))


def _clipped(t, s, *, hi: int):
    """t - s clipped to 0 .. hi: what stage s works on at tick t."""
    return jnp.clip(t - s, 0, hi)


def _entering(s, t, mc, inbox, *, last: int):
    """Stage 0 reads microbatch t of the carry; the others what the stage before sent."""
    return jnp.where(s == 0, _index(mc, jnp.minimum(t, last)), inbox)


def _round_input(i, k, mc, cb, *, m: int):
    """Item i's input: microbatch k of the carry in round 0, else of what came round."""
    return jnp.where(i < m, _index(mc, k), _index(cb, k))


def _first_stage(s, a, b):
    return jnp.where(s == 0, a, b)


def _last_stage(x, s, *, last: int):
    return jnp.where(s == last, x, jnp.zeros_like(x))


def _index_div(x, i, *, m: int):
    return _index(x, i // m)


def _mod(i, *, m: int):
    return i % m


def _slice_from(y, s, *, size: int):
    return jax.lax.dynamic_slice_in_dim(y, s, size, 0)


def _lead(x):
    return x[None]


def _first(x):
    return x[0]


def _mean_first(x):
    return x.mean(0).astype(x.dtype)


def _zeros_entry(x):
    return jnp.zeros_like(x[0])


def _reshaped(x, *, to: tuple):
    return x.reshape(to)


def _dealt(x, *, to: tuple):
    return jnp.swapaxes(x, 0, 1).reshape(to)


def _moved(ctx, x, src: int, dst: int):
    """`x` with axis `src` moved to `dst`."""
    shape = list(x.shape)
    shape.insert(dst, shape.pop(src))
    return ctx.call(jnp.moveaxis, x, source=src, destination=dst, shape=shape, dtype=x.dtype)


def _cut_shape(shape, ax: int, m: int) -> tuple:
    return (m, *shape[:ax], shape[ax] // m, *shape[ax + 1 :])


def _joined_shape(shape, ax: int) -> tuple:
    rest = list(shape[1:])
    rest[ax] *= shape[0]
    return tuple(rest)


def _micro(ctx, x, ax: int, m: int):
    """`_to_micro` as the context's op."""
    return ctx.call(_to_micro, x, ax=ax, m=m, shape=_cut_shape(x.shape, ax, m), dtype=x.dtype)


def _joined(ctx, x, ax: int):
    """`_from_micro` as the context's op."""
    return ctx.call(_from_micro, x, ax=ax, shape=_joined_shape(x.shape, ax), dtype=x.dtype)


def _scalar(ctx, fn, *xs, **params):
    """`fn(*xs)` giving an int32 scalar (a tick or microbatch number)."""
    return ctx.call(fn, *xs, shape=(), dtype=np.int32, **params)


def emit(ctx, eqn, carry, carry_lay, x_args, rest, stage_loop):
    """The SPMD rule of a scan whose scanned dim the layout splits: its pipeline.
    `carry` are the local carries in `carry_lay`, `x_args` and `rest` (local value,
    layout) the scanned and captured inputs; `stage_loop` runs a stage's iterations (the
    plain scan's loop, lowering/rules/control.py `plan_loop`). Written against the RuleContext's
    operations alone, which the Planner plans on Locals. Returns the scan's outputs as
    (local value, layout)."""
    p = eqn.params
    body, nc = p["body"], p["n_carry"]
    axes = split_axes(x_args, p["x_axes"])
    stage_free = lambda lay: tuple(tuple(a for a in d if a not in axes) for d in lay)
    inner_carry = [stage_free(lay) for lay in carry_lay]
    carry = [ctx.relayout(c, lay, want) for c, lay, want in zip(carry, carry_lay, inner_carry,
                                                                 strict=True)]  # fmt: skip
    # The stage's layers typed varying where the carry is, once: cast inside the loop, the
    # backward pass would psum each layer's gradient once per tick, not once per step.
    vma = set().union(*map(ctx.vma, carry))
    xs, x_lays = [], []
    for (x, lay), ax in zip(x_args, p["x_axes"], strict=True):
        want = stage_free(lay[:ax]) + (axes,) + stage_free(lay[ax + 1 :])
        xs.append(_moved(ctx, ctx.varying(ctx.relayout(x, lay, want), vma), ax, 0))
        x_lays.append(want[:ax] + want[ax + 1 :])
    dim = ctx.layout.options.get("microbatch_dim", "batch")
    inner_rest = body.inputs[nc + p["n_x"] :]
    captured = [_like_carry(stage_free(lay), v, inner_carry, body.inputs[:nc], dim)
                for (_, lay), v in zip(rest, inner_rest, strict=True)]  # fmt: skip
    rest = [(ctx.relayout(r, lay, want), want)
            for (r, lay), want in zip(rest, captured, strict=True)]  # fmt: skip
    # the carries' local size along `dim`: None where one lacks it or they differ
    sizes = {c.shape[v.dims.index(dim)] if dim in v.dims else None
             for c, v in zip(carry, body.inputs[:nc], strict=True)}  # fmt: skip
    local = sizes.pop() if len(sizes) == 1 else None
    where = f"nm.scan over {p['dim']!r}"
    k = _pinned_split(ctx, body, axes, dim, where)
    requested = ctx.layout.options.get("microbatches")
    pplan = plan_pipeline(
        axes=axes,
        stages=math.prod(ctx.sizes[a] for a in axes),
        length=p["length"],
        dim=dim,
        # a default M leaves each microbatch divisible by the body's constraints on `dim`
        local_size=local // k if requested is None and local and local % k == 0 else local,
        mixing=mixing_op(body, nc, p["n_x"], dim),
        requested=requested,
        carry_bytes=sum(map(nbytes, carry)),
        stack_bytes=sum(nbytes(x) for x in xs) * math.prod(ctx.sizes[a] for a in axes),
        where=where,
        schedule=ctx.layout.options.get("schedule", "gpipe"),
        repeats=ctx.layout.options.get("repeats"),
        ys=len(body.outputs) > nc,
    )
    if pplan.dim and (local // (m := pplan.microbatches)) % k:
        raise PipelineError(
            f"{where}: microbatches={m} leaves {dim!r} {local // m} long per microbatch (of "
            f"{local} per device), which an nm.constrain in the body splits {k} ways; use "
            "fewer microbatches"
        )
    pplan = dataclasses.replace(pplan, averaged=sum(averaged_ys(body, nc, pplan.dim)),
                                deal=recorded(p["dim"], p["length"]))  # fmt: skip
    run = _run if pplan.repeats == 1 else _run_circular
    layout, ctx.layout = ctx.layout, without_axes(ctx.layout, axes)
    try:
        final, ys, y_lays = run(ctx, eqn, pplan, carry, inner_carry, xs, x_lays, rest, stage_loop)
    finally:
        ctx.layout = layout
    final = [ctx.relayout(c, a, b) for c, a, b in zip(final, inner_carry, carry_lay, strict=True)]
    return [
        *zip(final, carry_lay, strict=True),
        *((y, (axes,) + lay) for y, lay in zip(ys, y_lays, strict=True)),
    ]


def _run(ctx, eqn, plan: PipelinePlan, carry, carry_lay, xs, x_lays, rest, stage_loop):
    """(final carry, ys, ys' layouts without the scanned dim): the ticks of `plan`."""
    p = eqn.params
    body, nc = p["body"], p["n_carry"]
    axes, m, s_n, dim = plan.axes, plan.microbatches, plan.stages, plan.dim
    s = ctx.axis_index(axes)
    c_ax, micro, rest_m = _cut(ctx, eqn, plan, carry, rest)
    y_lays: list = []
    perm = tuple((i, i + 1) for i in range(s_n - 1))

    def tick(micro, vma, state, t):
        inbox, outbuf = state[:nc], state[nc:]
        k = _scalar(ctx, _clipped, t, s, hi=m - 1)  # the microbatch this stage works on
        x_in = [ctx.call(_entering, s, t, mc, i, like=i, last=m - 1)
                for mc, i in zip(micro, inbox, strict=True)]  # fmt: skip
        r_in = [(ctx.call(_index, r, k, like=_entry(r)) if a is not None and dim else r, lay)
                for r, lay, a in rest_m]  # fmt: skip
        x_in, layers, r_in = _bubble_masked(ctx, _working(ctx, t, s, m), x_in, xs, r_in)
        final, ys, y_lays[:] = stage_loop(ctx, eqn, x_in, carry_lay, layers, x_lays, r_in,
                                        plan.layers_per_stage)  # fmt: skip
        # the microbatch the last stage finishes
        filed = dict(lag=s_n - 1, lo=0, hi=m, items=m, m=m)
        outbuf = [ctx.call(_file, o, y, t, like=o, **filed)
                  for o, y in zip(outbuf, final, strict=True)]  # fmt: skip
        inbox = [ctx.collective("ppermute", y, axes, v, perm=perm, sizes=ctx.sizes)
                 for y, v in zip(final, eqn.outputs[:nc], strict=True)]  # fmt: skip
        _check_type([*inbox, *outbuf], ctx, vma)
        return [*inbox, *outbuf], ys

    state, ys = _ticks(ctx, tick, micro, carry, carry_lay, plan, 1)
    final = _result(ctx, eqn, plan, state[nc:], c_ax, s)
    # stage s ran microbatch k at tick s + k: its ys are ticks s .. s+M-1
    ys = [ctx.call(_slice_from, y, s, like=_Shape((m, *y.shape[1:]), y.dtype), size=m)
          for y in ys]  # fmt: skip
    ys = [_joined(ctx, y, 1 + v.dims.index(dim)) if dim and dim in v.dims
          else ctx.call(_mean_first, y, like=_entry(y)) if dim  # each microbatch's: averaged
          else ctx.call(_first, y, like=_entry(y))
          for y, v in zip(ys, body.outputs[nc:], strict=True)]  # fmt: skip
    return final, ys, list(y_lays)


class _Shape(NamedTuple):
    """A shape and dtype, as `ctx.call`'s `like` takes them."""

    shape: tuple
    dtype: object


def _entry(x) -> _Shape:
    """The shape and dtype of one entry of `x` along its leading dim."""
    return _Shape(tuple(x.shape[1:]), x.dtype)


def _check_type(state, ctx, vma) -> None:
    """WiderCarry when a tick's state varies over more mesh axes than its carry's `vma`."""
    wider = set().union(*map(ctx.vma, state)) - vma
    if wider:
        raise WiderCarry(wider)


def _with_saved(plan: PipelinePlan, steps, remat: str) -> PipelinePlan:
    """`plan` with the bytes one iteration keeps for the backward pass, from the local
    results of its `steps` as the scan's `remat` policy keeps them: all of them, only
    the carry ("full"), or the carry and the matmul results ("dots")."""
    outs = [(op.prim, a) for st in steps for op in st.local for a in op.outs]
    size = lambda a: math.prod(a.shape) * a.dtype.itemsize
    if remat == "none":
        kept = sum(size(a) for _, a in outs)
    else:
        dots = sum(size(a) for prim, a in outs if prim.matmul) if remat == "dots" else 0
        kept = plan.microbatch_bytes + dots
    return dataclasses.replace(plan, saved_bytes=kept)


def _deal_circular(ctx, eqn, plan: PipelinePlan, xs):
    """The stage's layers for the circular schedule, (R, L/(S*R), ...) per scanned input:
    chunk r of stage s is the stack's chunk r*S + s, where the layout gave stage s the
    contiguous chunks s*R .. s*R+R-1. One tiled all_to_all over the stage axis: local
    chunk q*S + d goes to stage d, which files what stage s' sent at s'*R/S + q."""
    s, r, v = plan.stages, plan.repeats, plan.layers_per_tick
    out = []
    nc = eqn.params["n_carry"]
    for x, source in zip(xs, eqn.inputs[nc : nc + eqn.params["n_x"]], strict=True):
        to = (r // s, s, v, *x.shape[1:])
        x = ctx.call(_reshaped, x, like=_Shape(to, x.dtype), to=to)
        x = ctx.collective("all_to_all", x, plan.axes, source, dim=1, to=1)
        to = (r, v, *x.shape[3:])
        out.append(ctx.call(_dealt, x, like=_Shape(to, x.dtype), to=to))
    return out


def _run_circular(ctx, eqn, plan: PipelinePlan, carry, carry_lay, xs, x_lays, rest, stage_loop):
    """(final carry, [], []): the ticks of the circular schedule. At tick t stage s runs
    item i = t - s, microbatch i % M in round i // M, on its chunk of that round; stage
    0 reads round 0 from the carry and later rounds from `circ`, where it files what the
    last stage sends round the ring (M >= S ticks before it is read)."""
    nc = eqn.params["n_carry"]
    axes, m, s_n, dim = plan.axes, plan.microbatches, plan.stages, plan.dim
    items = plan.repeats * m
    s = ctx.axis_index(axes)
    chunks = _deal_circular(ctx, eqn, plan, xs)
    c_ax, micro, rest_m = _cut(ctx, eqn, plan, carry, rest)
    ring = tuple((i, (i + 1) % s_n) for i in range(s_n))

    def tick(micro, vma, state, t):
        inbox, circ, outbuf = state[:nc], state[nc : 2 * nc], state[2 * nc :]
        i = _scalar(ctx, _clipped, t, s, hi=items - 1)
        k = _scalar(ctx, _mod, i, m=m)
        first = [ctx.call(_round_input, i, k, mc, cb, like=_entry(cb), m=m)
                 for mc, cb in zip(micro, circ, strict=True)]  # fmt: skip
        x_in = [ctx.call(_first_stage, s, f, b, like=b)
                for f, b in zip(first, inbox, strict=True)]  # fmt: skip
        r_in = [(ctx.call(_index, r, k, like=_entry(r)) if a is not None and dim else r, lay)
                for r, lay, a in rest_m]  # fmt: skip
        layers = [ctx.call(_index_div, c, i, like=_entry(c), m=m) for c in chunks]
        working = _working(ctx, t, s, items)
        x_in, layers, r_in = _bubble_masked(ctx, working, x_in, layers, r_in)
        final, _, _ = stage_loop(ctx, eqn, x_in, carry_lay, layers, x_lays, r_in,
                               plan.layers_per_tick)  # fmt: skip
        # the item the last stage finishes: its last round is the result, the others go
        # round again from stage 0
        filed = dict(lag=s_n - 1, items=items, m=m)
        outbuf = [ctx.call(_file, o, y, t, like=o, lo=items - m, hi=items, **filed)
                  for o, y in zip(outbuf, final, strict=True)]  # fmt: skip
        inbox = [ctx.collective("ppermute", y, axes, v, perm=ring, sizes=ctx.sizes)
                 for y, v in zip(final, eqn.outputs[:nc], strict=True)]  # fmt: skip
        circ = [ctx.call(_file, cb, y, t, like=cb, lo=0, hi=items - m, **filed)
                for cb, y in zip(circ, inbox, strict=True)]  # fmt: skip
        _check_type([*inbox, *circ, *outbuf], ctx, vma)
        return [*inbox, *circ, *outbuf], []

    state, _ = _ticks(ctx, tick, micro, carry, carry_lay, plan, 2)
    return _result(ctx, eqn, plan, state[2 * nc :], c_ax, s), [], []


def _cut(ctx, eqn, plan: PipelinePlan, carry, rest):
    """(each carry's microbatched axis, the carries as (M, ...) microbatches, the captured
    inputs [(value, layout, its microbatched axis or None)], those with the dim cut)."""
    p = eqn.params
    body, nc, m, dim = p["body"], p["n_carry"], plan.microbatches, plan.dim
    c_ax = [v.dims.index(dim) if dim else 0 for v in body.inputs[:nc]]
    lead = lambda c: ctx.call(_lead, c, like=_Shape((1, *c.shape), c.dtype))
    micro = [_micro(ctx, c, a, m) if dim else lead(c) for c, a in zip(carry, c_ax, strict=True)]
    r_ax = [v.dims.index(dim) if dim in v.dims else None for v in body.inputs[nc + p["n_x"] :]]
    rest_m = [(_micro(ctx, r, a, m) if a is not None and dim else r, lay, a)
              for (r, lay), a in zip(rest, r_ax, strict=True)]  # fmt: skip
    return c_ax, micro, rest_m


def _ticks(ctx, tick, micro, carry, carry_lay, plan: PipelinePlan, buffers: int):
    """(final state, ys): `tick(micro, vma, state, t)` looped (ctx.loop) over the plan's
    ticks from zero inboxes and `buffers` zeroed (M, ...) buffers per carry, in a
    "pipeline tick" Step; retried with a wider type while a tick's state varies over
    more mesh axes (WiderCarry), then the carry's cast to that type logged (its
    transpose psums). The scan's Step gets the tick's Steps and the PipelinePlan."""
    outer = ctx.step
    p = outer.eqn.params
    shown = [(v.dims, lay) for v, lay in zip(p["body"].inputs[: p["n_carry"]], carry_lay,
                                              strict=True)]  # fmt: skip
    new_step = lambda: Step("pipeline tick", None, shown, shown,
                            repeat=outer.repeat * plan.ticks, depth=outer.depth + 1)  # fmt: skip
    vma = set(plan.axes).union(*map(ctx.vma, carry))
    done = len(outer.ops)
    while True:
        try:
            ms = [ctx.cast_varying(mc, vma) for mc in micro]
            init = [ctx.call(_zeros_entry, mc, like=_entry(mc)) for mc in ms]
            init += [ctx.call(jnp.zeros_like, mc, like=mc) for _ in range(buffers) for mc in ms]
            t = ctx.call(_ticks_range, n=plan.ticks, shape=(plan.ticks,), dtype=np.int32, vma=set())
            step = lambda c, x, ms=ms, vma=frozenset(vma): tick(ms, vma, c, x[0])
            state, ys, made = ctx.loop(step, init, [t], plan.ticks, new_step)
            break
        except WiderCarry as e:
            vma |= e.axes
            del outer.ops[done:]  # the planned ops of the narrower try
    for c in carry:
        if missing := ctx.missing_axes(c, vma):
            ctx.log("pvary", missing, nbytes(c), ctx.source(c))
    outer.body = [made, *made.body]
    made.body = []
    outer.pipeline = _with_saved(plan, outer.body[1:], p.get("remat", "none"))
    return state, ys


def _result(ctx, eqn, plan: PipelinePlan, outbuf, c_ax, s):
    """The scan's final carries on every stage: the last stage's `outbuf` all-reduced."""
    final = []
    for o, a, v in zip(outbuf, c_ax, eqn.outputs[: eqn.params["n_carry"]], strict=True):
        o = ctx.call(_last_stage, o, s, like=o, last=plan.stages - 1)
        o = ctx.collective("psum", o, plan.axes, v)
        final.append(_joined(ctx, o, a) if plan.dim else ctx.call(_first, o, like=_entry(o)))
    return final
