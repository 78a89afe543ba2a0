"""Every op's result dtype equals one device's, for every input dtype (issue 26): each op
of `dtype_ops()` (every registered primitive, issue 42) on x[r, d] of every dtype, with
`d` split or not, gives the shape rule's dtype eagerly in NumPy, eagerly in jax, under
jit and lowered, or all of them refuse it with the same NamedMeshError. Every op but the
elementwise ones of float results (bool moved along a split dim; softmax of integers; the
kernels) also equals the NumPy reference in value."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings

import namedmesh as nm
from lowering import Layout, Mesh
from namedmesh.primitive import is_inexact
from namedmesh.testing import CASES, compare
from namedmesh.testing import lowered as cached_lower
from namedmesh.testing.dtype_strategies import (
    STRUCTURAL_OPS,
    dtype_cases,
    dtype_ops,
    elementwise_ops,
    power_cases,
)
from namedmesh.testing.oracles import power_oracle

# A case compiles one small program: a fifth of the profile's examples each
BUDGET = settings(max_examples=max(8, settings.default.max_examples // 5))
FLOAT_ROUNDED = elementwise_ops()  # dtypes compared alone; every other op's values too


def values_compared(case, ref) -> bool:
    """Whether `case`'s values are held to the reference, besides its dtype: a structural
    op's always (exactly); an elementwise op's where its result is an integer or bool (exact:
    integer division by 0 differed), never a float one (NumPy's and XLA's floats differ
    by ulps on special values); any other op's where its result is an integer or bool, or
    x is finite and at most 2**16 in magnitude: the registry's examples compose float
    arithmetic whose overflows depend on the order of a sum, and which XLA simplifies
    (a product with a one-hot becomes a select: 0 where NumPy's inf * 0 is NaN).
    tests/test_value_props.py holds reductions on special values."""
    if case.op in STRUCTURAL_OPS:
        return True
    if case.op in FLOAT_ROUNDED:
        return not is_inexact(ref.dtype)
    x = case.x.astype(case.x.dtype.newbyteorder("="))
    tame = not is_inexact(x.dtype) or bool(np.all(np.abs(x.astype(np.float64)) <= 2**16))
    return tame or not is_inexact(ref.dtype)


@functools.cache
def mesh_of(sizes: tuple) -> Mesh:
    return Mesh(dict(sizes))


@functools.cache
def jitted(op: str):
    fn = dtype_ops()[op]
    return jax.jit(lambda a: fn(nm.tensor(a, "r d")).data)


def outcome(run):
    """run()'s result, or the NamedMeshError it raised, by type (any other raises)."""
    try:
        return run()
    except nm.NamedMeshError as e:
        return type(e)


def native(x: np.ndarray) -> np.ndarray:
    """x in native byte order, for jax's own entry points (jnp.asarray, jit's arguments),
    which refuse big-endian arrays themselves; namedmesh's take x as it is."""
    return x.astype(x.dtype.newbyteorder("="))


def check_dtypes(case) -> None:
    fn, x = dtype_ops()[case.op], case.x
    graph = outcome(lambda: nm.trace(fn, nm.tensor(x, "r d")))
    x_jax = jnp.asarray(native(x))
    if isinstance(graph, type):  # the op refuses the dtype: every path must, alike
        for path in (lambda: fn(nm.tensor(x_jax, "r d")), lambda: jitted(case.op)(x_jax)):
            assert outcome(path) is graph, (case, graph)
        return
    (want,) = graph.outputs
    ref = nm.reference(graph)(nm.tensor(x, "r d"))
    eager = fn(nm.tensor(x_jax, "r d"))
    lowered = cached_lower(fn, mesh_of(tuple(case.mesh.items())), Layout(case.layout))
    got = lowered(nm.tensor(x, "r d"))
    CASES["lowered"] += 1
    dtypes = {"shape rule": want.dtype, "NumPy": ref.dtype, "jax": eager.dtype,
              "jit": jitted(case.op)(x_jax).dtype, "lowered": got.dtype}  # fmt: skip
    assert len(set(map(np.dtype, dtypes.values()))) == 1, (case, dtypes)
    if values_compared(case, ref):
        compare(got, ref, rtol=0.0 if case.op in STRUCTURAL_OPS else None, what=repr(case))


@BUDGET
@given(dtype_cases())
def test_every_op_gives_one_devices_dtype_for_every_input_dtype(case):
    check_dtypes(case)


@BUDGET
@given(dtype_cases(ops=tuple(STRUCTURAL_OPS), dtypes=("bool",), split=(True,)))
def test_bool_stays_bool_through_every_structural_op_along_a_split_dim(case):
    check_dtypes(case)


POWER_MESH = mesh_of((("m0", 4),))
power_program = lambda x, y: nm.power(x, y)  # one function: lowered programs cached by signature
power_jitted = jax.jit(lambda x, y: nm.power(nm.tensor(x, "r d"), nm.tensor(y, "r d")).data)


def check_power(case) -> None:
    """power of every dtype pair equals `power_oracle` on every path: eager NumPy,
    nm.reference, jit and lowered (issue 38 classes 3 and 6)."""
    x, y = nm.tensor(case.x, "r d"), nm.tensor(case.y, "r d")
    want = nm.tensor(power_oracle(native(case.x), native(case.y)), "r d")
    xj, yj = jnp.asarray(native(case.x)), jnp.asarray(native(case.y))
    paths = {
        "eager NumPy": nm.power(x, y),
        "nm.reference": nm.reference(nm.trace(power_program, x, y))(x, y),
        "jit": nm.tensor(power_jitted(xj, yj), "r d"),
        "lowered": cached_lower(power_program, POWER_MESH, Layout(case.layout))(x, y),
    }
    CASES["lowered"] += 1
    exact = want.dtype.kind in "iub"
    for path, got in paths.items():
        got = nm.tensor(np.asarray(got.data), "r d")
        compare(got, want, rtol=0.0 if exact else None, what=f"{path} of {case!r}")


# Each case compiles one power per path for its pair of dtypes: tests/test_one_meaning.py
# holds every pair on fixed values, eagerly in jax too; this draws a few more.
@settings(max_examples=max(6, settings.default.max_examples // 40))
@given(power_cases())
def test_power_of_every_dtype_pair_equals_the_oracle_on_every_path(case):
    check_power(case)
