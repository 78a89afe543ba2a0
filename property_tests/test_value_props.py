"""Values a layout must not change: for max/min, argmax/argmin, top_k, softmax,
log_softmax, logsumexp, boolean and integer einsums and max pool along a split dim,
in every dtype they take and on the values where their semantics matter (ties of the
extreme, +-0.0, NaN, +-inf, the ends of the dtype's range), the lowered result equals
the NumPy reference (exactly, but for the float results of exp and log), and the
gradients equal jax's on one device, ties included; and the cost report counts the work
of every op along a split dim."""

import functools

import jax
import numpy as np
from hypothesis import given, settings

import namedmesh as nm
from lowering import Layout, Mesh
from namedmesh.testing import CASES, compare
from namedmesh.testing import lowered as cached_lower
from namedmesh.testing import strategies as S

# Each case compiles a small program (a gradient two): a fifth (a tenth) of the profile's
# examples keeps the three properties near a minute under the ci profile. Each case
# checks four rows of special values at once.
BUDGET = settings(max_examples=max(8, settings.default.max_examples // 5))
GRAD_BUDGET = settings(max_examples=max(5, settings.default.max_examples // 10))
EXACT = ("max", "min", "argmax", "argmin", "top_k", "einsum", "pool")


@functools.cache
def mesh_of(sizes: tuple) -> Mesh:
    return Mesh(dict(sizes))


def lowered(case: S.ValueCase, fn=None):
    fn = fn or S.value_op(case.op, case.k)
    return cached_lower(fn, mesh_of(tuple(case.mesh.items())), Layout(case.layout))


def check_values(case: S.ValueCase) -> None:
    """The lowered op equals the NumPy reference: exactly where the op is exact."""
    fn, xs = S.value_op(case.op, case.k), case.inputs()
    got = lowered(case)(*xs)
    CASES["lowered"] += 1
    want = nm.reference(nm.trace(fn, *xs))(*xs)
    compare(got, want, rtol=0.0 if case.op in EXACT else None, what=repr(case))


@functools.cache
def loss_of(op: str, k: int):
    fn = S.value_op(op, k)

    def loss(x):
        outs = fn(x)
        outs = outs[:1] if isinstance(outs, list) else [outs]  # top_k: its values
        return nm.sum(nm.astype(outs[0], np.float32))

    return loss


@functools.cache
def gradients(op: str, k: int, mesh: tuple, layout: str):
    """Jitted (lowered gradient, one-device jax gradient) of `op`'s sum: compiled once
    per dtype, so that hypothesis replaying a case with other values reuses them."""
    loss = loss_of(op, k)
    f = cached_lower(loss, mesh_of(mesh), Layout(layout))
    split = jax.jit(jax.grad(lambda a: f(nm.tensor(a, "r d")).data))
    whole = jax.jit(jax.grad(lambda a: loss(nm.tensor(a, "r d")).data))
    return split, whole


def check_gradient(case: S.ValueCase) -> None:
    """The gradient of the lowered op's sum equals jax's on one device."""
    split, whole = gradients(case.op, case.k, tuple(case.mesh.items()), case.layout)
    x = jax.numpy.asarray(case.x)
    got, want = split(x), whole(x)
    CASES["lowered"] += 1
    rtol = 0.0 if case.op in EXACT else None
    compare(nm.tensor(np.asarray(got), "r d"), nm.tensor(np.asarray(want), "r d"), rtol,
            f"gradient of {case!r}")  # fmt: skip


@BUDGET
@given(S.value_cases())
def test_special_values_equal_the_reference_along_split_dims(case):
    check_values(case)


@GRAD_BUDGET
@given(S.value_cases(ops=S.GRADIENT_OPS, dtypes=("float32", "bfloat16", "float16")))
def test_gradients_on_special_values_equal_one_device_jax(case):
    check_gradient(case)


def flops(fn, mesh, layout, xs) -> float:
    layout = layout if isinstance(layout, Layout) else Layout(layout)
    return cached_lower(fn, mesh, layout).report(*xs, show=False).flops


def check_split_flops(case: S.ValueCase) -> None:
    """Flops per device with `d` split are at least the replicated flops over the
    devices: no op's work goes uncosted, whatever path its rule takes."""
    fn, xs = S.value_op(case.op, case.k), case.inputs()
    mesh = mesh_of(tuple(case.mesh.items()))
    split = flops(fn, mesh, case.layout, xs)
    replicated = flops(fn, mesh, "", xs)
    assert split * np.prod(list(case.mesh.values())) >= replicated, (case, split, replicated)


@BUDGET
@given(S.value_cases())
def test_split_flops_are_at_least_the_replicated_flops_per_device(case):
    check_split_flops(case)


@BUDGET
@given(S.cases(max_steps=4))
def test_program_flops_split_are_at_least_replicated_flops_per_device(case):
    """The same for the random programs of every op the program strategy draws."""
    program, mesh, layout = case
    xs = program.example_inputs()
    try:
        split = flops(program, mesh, layout, xs)
    except nm.LayoutError:
        return  # a layout the inputs do not fit: test_lowering_props checks it deserves it
    replicated = flops(program, mesh, "", xs)
    assert split * np.prod(list(mesh.sizes.values())) >= replicated, (split, replicated)
