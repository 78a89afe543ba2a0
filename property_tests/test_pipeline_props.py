"""Scans over a split dim (namedmesh/testing/stack_strategies.py): a layer stack whose
`layers` the layout splits runs as a pipeline, with microbatches where the layout asks.

1. The lowered result equals nm.reference, and the gradients of a loss of it equal
   the single-device ones; or planning raises the PipelineError the case deserves (by
   an independent statement of when microbatches or the circular schedule cannot be
   used), and no other error.
2. The pipeline is planned without jax, the values above are those of the program
   emitted from that plan, every value of which the emitter's check held to the plan
   (shape, dtype, varying axes: namedmesh.testing's cached lower checks), and the
   compiled program's collectives are the plan's.

Each case compiles its values and gradients in one program, cached by (stack, mesh,
layout) apart from the input values: a twentieth of the profile's examples (15 under ci).
"""

import functools
import math
import re

import jax
import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

import namedmesh as nm
from lowering import Layout, Mesh
from lowering.cost import expected_hlo
from lowering.hlo import collectives
from namedmesh.errors import PipelineError
from namedmesh.testing import CASES, compare
from namedmesh.testing import lowered as cached_lower
from namedmesh.testing import stack_strategies as SS

FEW = settings(max_examples=max(4, settings.default.max_examples // 20))
# pipeline x data with a microbatched captured input, and microbatches the batch lacks
STACK = SS.Stack(8, 2, "residual", ("batch", "d"), ys=True, remat="dots")
STAGE_X_DATA = Mesh({"m0": 2, "m1": 4})
CIRCULAR = SS.Stack(8, 2, "residual", ("batch", "d"), ys=False, remat="full")  # M = 2 = S
# a constant over batch made in the body, hoisted: made whole, never gathered (XLA folds
# a gather of a constant away, so a plan that gathered it disagreed with the HLO)
CONSTANT = SS.Stack(8, 2, "constant", (), ys=False, remat="none")


def _loss(outs) -> jax.Array:
    return sum((o.data.astype(np.float32) ** 2).mean() for o in outs)


@functools.lru_cache(maxsize=64)
def lowered_step(stack, mesh, layout):
    """The lowered stack's results and the gradients of `_loss` of them, in one jit."""
    fn = cached_lower(stack, mesh, layout)
    return jax.jit(lambda *xs: (fn(*xs), jax.grad(lambda *xs: _loss(fn(*xs)), range(len(xs)))(*xs)))


@functools.lru_cache(maxsize=64)
def one_device_grads(stack):
    return jax.jit(lambda *xs: jax.grad(lambda *xs: _loss(stack(*xs)), range(len(xs)))(*xs))


def deserved_error(stack, mesh, layout) -> str | None:
    """What in the case forbids its pipeline, or None. More than one microbatch needs a
    body per-example along batch, every carry with batch, and a per-stage batch (batch
    over its rule's axes less the stage axes) that they divide; by default M is the
    largest divisor of that batch up to 4S, or 1 for such a body. The circular schedule
    (R = S rounds of L/(S*R) layers) needs one stage axis, S*S dividing L, M >= S and
    no per-layer ys."""
    rules = dict(layout.rules)
    inside = [a for a in rules.get("batch", ()) if a not in rules["layers"]]
    local = stack.batch // math.prod(mesh.sizes[a] for a in inside)
    per_example = not (stack.mixes_examples or stack.batchless_carry)
    m = layout.options.get("microbatches")
    if m is not None and m > 1:
        if stack.mixes_examples:
            return "acts along it"
        if stack.batchless_carry:
            return "which a carry tensor lacks"
        if local % m:
            return f"local size {local} .* not divisible by microbatches={m}"
    if layout.options.get("schedule") != "circular":
        return None
    stages = math.prod(mesh.sizes[a] for a in rules["layers"])
    if m is None:
        m = max(d for d in range(1, 4 * stages + 1) if local % d == 0) if per_example else 1
    if len(rules["layers"]) > 1:
        return "runs over one mesh axis"
    if SS.LAYERS % (stages * stages):
        return "must be a multiple of the .* stages and divide"
    if m < stages:
        return f"needs at least {stages} microbatches"
    if stack.ys:
        return "keeps no per-iteration results"
    return None


@FEW
@given(SS.stack_cases(), st.integers(0, 2**31 - 1))
@example((STACK, STAGE_X_DATA, Layout("layers:m0;batch:m1;microbatches=2")), 0)
@example((STACK, STAGE_X_DATA, Layout("layers:m0;batch:m1;microbatches=4")), 0)
@example((CIRCULAR, STAGE_X_DATA, Layout("layers:m0;batch:m1;schedule=circular")), 0)
@example((CONSTANT, Mesh({"m0": 4}), Layout("layers:m0;batch:m0")), 0)
def test_pipelined_stacks_equal_the_reference_values_and_gradients(case, seed):
    stack, mesh, layout = case
    xs = stack.example_inputs(seed)
    deserved = deserved_error(stack, mesh, layout)
    try:
        got, grads = lowered_step(stack, mesh, layout)(*xs)
    except PipelineError as e:
        assert deserved, f"a PipelineError the case does not deserve: {e}"
        assert re.search(deserved, str(e)), (deserved, str(e))
        return
    assert deserved is None, f"accepted microbatches that should raise ({deserved})"
    CASES["lowered"] += 1
    fn = cached_lower(stack, mesh, layout)
    planned = fn.plan(*xs)
    hlo = collectives(fn.compile(*xs).as_text())
    assert sorted(hlo) == sorted(expected_hlo(planned, mesh.sizes))
    compare(got, nm.reference(nm.trace(stack, *xs))(*xs))
    want = one_device_grads(stack)(*xs)
    for g, w, x in zip(grads, want, xs, strict=True):
        compare(nm.tensor(np.asarray(g.data), x.dims), nm.tensor(np.asarray(w.data), x.dims),
                rtol=1e-3, what="gradient")  # fmt: skip
