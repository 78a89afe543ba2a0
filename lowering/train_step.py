"""The memory of a whole training step, in parts: what `namedmesh plan` and the joint
search (lowering/joint.py) hold against a device's memory.

A cost Report of the loss's gradient (`report(..., wrt=...)`) holds the parameters, their
gradients and the activations the backward pass reads (lowering/memory.py); a step also
holds the optimizer's state and, with gradient accumulation, an accumulator:

    parameters  each parameter's shard, in its dtype
    gradients   as the parameters; twice with grad_accum > 1 (the running sum and the
                microbatch's own, live at once in the accumulation loop)
    optimizer   AdamW: two moments per parameter element in `moment_dtype`, split as the
                parameters, or (ZeRO-1) also over the data axes that do not split the
                parameter; momentum: one; sgd: none
    activations what the backward pass reads and its largest working set (remat's
                recomputed iteration included), of one microbatch; a pipeline stage
                holds `in_flight` microbatches' saved activations at once (1F1B: those
                it has run forward and not yet backward) beside one working set; or,
                where the forward pass holds more (`Report.forward_memory`: a grouped
                FFN's block loop beside a layer loop's residual stacks), that, less
                the gradients it does not yet hold
    other       the batch and any other input (a stage: each in-flight microbatch's
                input, its batch or the activation the previous stage sent, kept for
                its backward pass), and what the update adds where it outgrows the
                backward pass (below)

The step peaks in one of three phases, whichever holds more beside the parameters, the
optimizer's state and the batch: its forward pass (the activations it has made so far
and its working set, with accumulation the gradients' running sum), its backward pass
(the gradients and the activations) or its update, which runs once the activations
are freed (`update_bytes`): the trainer (models/training/trainer.py) makes the new
parameters and the new optimizer state beside the old ones, since its finite guard
reads every new parameter before it chooses between the new state and the old, and
XLA:CPU a byte per parameter element for the guard's is_finite flags; the gradients
die as the new state is made. XLA's buffers of the data-parallel remat-full row of
docs/benchmarks.md's table hold exactly these at its peak. docs/benchmarks.md holds
the total against XLA's `memory_analysis` of the trainer's compiled step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lowering.cost import Report
from namedmesh.errors import ParameterError

# moments per parameter element; Adafactor's (None) are factored (`state_elements`)
OPTIMIZERS = {"adamw": 2, "adam": 2, "lion": 1, "momentum": 1, "sgd": 0, "adafactor": None}
FACTOR_MIN = 128  # optax.adafactor's min_dim_size_to_factor: both factored dims at least


def state_elements(shape, split, optimizer: str) -> float:
    """Elements per device of one parameter's optimizer state: `shape` its whole shape,
    `split` the devices splitting each dim (the state is laid out as the parameter).
    Adafactor (optax.adafactor, no momentum) keeps a factored second moment where the
    two largest dims are both >= FACTOR_MIN: the row and column sums, the parameter's
    shape less its largest dim and less its second largest (plus a 1-element
    placeholder for the full moment); else the full moment (and 2 placeholders)."""
    local = [n / k for n, k in zip(shape, split, strict=True)]
    moments = OPTIMIZERS[optimizer]
    if moments is not None:
        return moments * math.prod(local)
    order = np.argsort(shape)  # as optax orders them, ties included
    if len(shape) < 2 or shape[order[-2]] < FACTOR_MIN:
        return math.prod(local) + 2
    small, large = int(order[-2]), int(order[-1])
    without = lambda d: math.prod(n for i, n in enumerate(local) if i != d)
    return without(large) + without(small) + 1


@dataclass(frozen=True)
class Training:
    """How a step trains, beyond the loss: the optimizer and its state's dtype, ZeRO-1
    (the state split over the data axes too), gradient accumulation's microbatches, and
    (a pipeline stage) how many microbatches' activations are in flight at once."""

    optimizer: str = "adamw"
    moment_dtype: str = "float32"
    zero1: bool = False
    grad_accum: int = 1
    in_flight: int = 1

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ParameterError(
                f"Training: optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}"
            )
        try:
            np.dtype(self.moment_dtype)
        except TypeError:
            raise ParameterError(
                f"Training: moment_dtype {self.moment_dtype!r} is not a dtype (float32, bfloat16)"
            ) from None
        for name in ("grad_accum", "in_flight"):
            g = getattr(self, name)
            if not isinstance(g, int) or isinstance(g, bool) or g < 1:
                raise ParameterError(f"Training: {name} must be an int >= 1, got {g!r}")

    @property
    def moment_bytes(self) -> int:
        """Bytes of one moment element."""
        import jax.numpy as jnp  # bfloat16 is jax's dtype

        return jnp.dtype(self.moment_dtype).itemsize


@dataclass(frozen=True)
class StepMemory:
    """Bytes per device of one training step, by part (the module docstring)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    other: int

    @property
    def total(self) -> int:
        """Every part's bytes."""
        return self.parameters + self.gradients + self.optimizer + self.activations + self.other

    def as_dict(self) -> dict[str, int]:
        """The parts and the total by name (what `namedmesh plan --json` prints)."""
        return {"total": self.total, "parameters": self.parameters,
                "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "other": self.other}  # fmt: skip


def step_memory(
    rep: Report, sizes: dict[str, int], data_axes=(), training: Training = Training()
) -> StepMemory:
    """The StepMemory of the step whose gradient report is `rep` (made with `wrt`) on a
    mesh of `sizes`; `data_axes` are the mesh axes that split the batch (ZeRO-1 splits the
    optimizer's state over those of them that do not split a parameter already)."""
    if not rep.memory_parts:
        raise ParameterError(
            "step_memory: the report has no training terms; make it with wrt= (the parameters)"
        )
    parts = rep.memory_parts
    params = sum(b for b, _, _ in rep.parameter_shards)
    optimizer = optimizer_bytes(rep, sizes, data_axes, training)
    grads = parts["gradients"] * (2 if training.grad_accum > 1 else 1)
    more = training.in_flight - 1  # microbatches in flight beside the one running
    batch = max(parts["inputs"] - params, 0)  # the inputs that are not parameters
    backward = parts["saved"] * training.in_flight + parts["working"]
    # or in its forward pass, before any gradient but the accumulation's running sum
    # exists, the other microbatches in flight's saved activations beside it
    running = parts["gradients"] if training.grad_accum > 1 else 0
    forward = rep.forward_memory + more * parts["saved"] + running - grads
    activations = max(backward, forward)
    # the step peaks in its forward or backward pass or in its update, whichever holds
    # more (the update runs once the activations are freed: the module docstring)
    update = max(update_bytes(rep, optimizer) - grads - activations, 0)
    return StepMemory(
        parameters=int(params),
        gradients=int(grads),
        optimizer=int(optimizer),
        activations=int(activations),
        # the batch (each in-flight microbatch's), and what the update adds
        other=int(batch + more * batch + update),
    )


def update_bytes(rep: Report, optimizer: float) -> int:
    """Bytes per device the update holds beside the parameters, the old optimizer state
    and the batch, once the backward pass's activations are freed: the new parameters
    and the new optimizer state (`optimizer` bytes), all made before the trainer's finite
    guard can choose between them and the old (it reads every new parameter first, so
    neither is written in place), and each new parameter element's is_finite flag (a
    byte: XLA:CPU makes them before reducing). The gradients die leaf by leaf as the
    new state is made; where the new state is smaller (sgd) they are the most."""
    params = sum(b for b, _, _ in rep.parameter_shards)
    flags = sum(b // size for b, size, _ in rep.parameter_shards)
    grads = rep.memory_parts["gradients"]
    return int(max(grads, params + optimizer + flags))


def optimizer_bytes(rep: Report, sizes: dict[str, int], data_axes=(), training=Training()):
    """Bytes per device of the optimizer state of the parameters of `rep` (a report
    made with `wrt`) on a mesh of `sizes`: `state_elements` of each in `moment_dtype`,
    split further (ZeRO-1) over the `data_axes` that do not split it."""
    total = 0.0
    layouts = rep.parameter_layouts or [((b / i,), (1,)) for b, i, _ in rep.parameter_shards]
    for (_, _, axes), (shape, split) in zip(rep.parameter_shards, layouts, strict=True):
        zero1 = math.prod(sizes[a] for a in data_axes if a not in axes) if training.zero1 else 1
        elements = state_elements(shape, split, training.optimizer)
        total += elements * training.moment_bytes / zero1
    return total
