"""Edge programs (strategies.programs(edge=True), namedmesh/testing/edge_steps.py): empty
and size-1 dims, 0-d inputs, int32, bool, bfloat16 and float16 inputs, Python and NumPy
scalars and 0-d tensors in ops, and constants made from no input that later steps sum,
contract and move along split dims. On random meshes and layouts (a dim over one or two
axes, sizes 3 that most axes do not divide) each lowered program equals the NumPy
reference or earns its LayoutError (test_lowering_props.check_case); a program an op
refuses eagerly is refused lowered with the same typed error, never a raw one; the
gradients with respect to its float32 inputs equal one device's; and traced, it equals
eager, in NumPy and in jax."""

import contextlib

import jax
import numpy as np
import pytest
from hypothesis import example, given, settings
from test_language_props import check_traced
from test_lowering_props import check_case, jitted, squared_mean

import namedmesh as nm
from lowering import Layout, Mesh
from namedmesh.testing import CASES, compare
from namedmesh.testing import lowered as cached_lower
from namedmesh.testing import strategies as S

# A quarter of the profile's examples (a compile each; a gradient two, an eighth): the
# suite's time budget (about 35 s under the ci profile, measured at load 6)
BUDGET = settings(max_examples=max(10, settings.default.max_examples // 4))
GRAD_BUDGET = settings(max_examples=max(5, settings.default.max_examples // 8))


def refused_eagerly(program, xs) -> type | None:
    """The NamedMeshError class the program's eager run raises, or None."""
    try:
        program(*xs)
    except nm.NamedMeshError as e:
        return type(e)
    return None


def rtol_of(program, default: float | None) -> float | None:
    """The tolerance for a program's float32 results: a half float input's where it has
    one (NumPy's and XLA's elementwise ops round half floats apart, by an ulp of 2**-8:
    test_dtype_props compares their dtypes alone), else `default`."""
    return 2e-2 if set(program.dtypes) & {"bfloat16", "float16"} else default


@contextlib.contextmanager
def jax_shardy_bug(xs):
    """Skips the case where jax fails on it: a shard_map whose inputs used are all empty,
    two or more, does not compile (Shardy: "expected at least one operand of
    @xla.sdy.manual_computation_body to be produced by a xla.sdy.GlobalToLocalShape";
    jax 0.10, tests/test_edge_regressions.py holds it as a strict xfail)."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if "GlobalToLocalShape" not in str(e) or sum(x.data.size == 0 for x in xs) < 2:
            raise


def check_edge_case(case) -> None:
    program, mesh, layout = case
    xs = program.example_inputs()
    refused = refused_eagerly(program, xs)
    if refused is None:
        with jax_shardy_bug(xs):
            check_case(case, rtol_of(program, None))
        return
    with pytest.raises(refused):
        cached_lower(program, mesh, layout)(*xs)


# The reduced cases of the defects this draw found, explicitly
SHIFTED_CONSTANT = (  # a constant's shift (wrap) along a split dim: a raw ValueError
    S.Program((("p", 8),), (("p",),), (("constant", 0, 0, 14), ("shift", 1, 1, 9)), 0),
    Mesh({"m0": 4}),
    Layout("p:m0"),
)
EMPTY_GATHER = (  # a gather from an empty dim: a raw IndexError
    S.Program((("p", 0), ("q", 2)), (("p", "q"), ("q",)), (("gather", 0, 1, 0),), 0),
    Mesh({"m0": 2}),
    Layout("q:m0"),
)


TWO_EMPTY = (  # two empty inputs only: jax's bug (`jax_shardy_bug`), skipped
    S.Program((("p", 0),), (("p",), ("p",)), (("einsum", 0, 1, 0),), 0),
    Mesh({"m0": 2}),
    Layout("", shared=True),
)


@BUDGET
@given(S.cases(max_steps=4, edge=True))
@example(SHIFTED_CONSTANT)
@example(TWO_EMPTY)
@example(EMPTY_GATHER)
def test_edge_programs_equal_reference_or_deserved_error(case):
    check_edge_case(case)


def check_edge_gradients(case) -> None:
    """The gradient of mean(program²) with respect to its float32 inputs, lowered, equals
    one device's (jax's, jitted)."""
    program, mesh, layout = case
    xs = program.example_inputs()
    argnums = tuple(i for i, x in enumerate(xs) if x.dtype == np.float32)
    if not argnums or refused_eagerly(program, xs):
        return
    loss = squared_mean(program)
    got = None
    try:
        with jax_shardy_bug(xs):
            got = jitted(cached_lower(loss, mesh, layout), argnums)(*xs)
    except nm.LayoutError:
        return
    if got is None:  # the jax bug of `jax_shardy_bug`, skipped
        return
    CASES["lowered"] += 1
    want = jitted(loss, argnums)(*xs)
    for g, w in zip(got, want, strict=True):
        compare(g, nm.tensor(np.asarray(w.data), w.dims), rtol=rtol_of(program, 1e-3))


EMPTY_TOP_K = (  # top_k of an empty tensor: its sort keys made afresh, invariant (PlanMismatch)
    S.Program((("p", 0), ("s", 8), ("q", 1), ("r", 4)), (("p", "q", "s"),),
              (("einsum", 11, 30, 39), ("einsum", 41, 3, 34), ("top_k", 13, 25, 22)), 51),
    Mesh({"m0": 2, "m1": 4}),
    Layout("p:m0;s:m0,m1;r:m0,m1", shared=True),
)  # fmt: skip


@GRAD_BUDGET
@given(S.cases(max_steps=4, edge=True))
@example(EMPTY_TOP_K)
def test_edge_gradients_equal_single_device_gradients(case):
    check_edge_gradients(case)


@BUDGET
@given(S.programs(edge=True, max_steps=4))
@example(  # bfloat16 times 2.5: NumPy's and XLA's roundings an ulp apart (half floats' rtol)
    S.Program((("p", 0),), ((), (), ()), (("scalar", 2, 0, 0),), 1,
              dtypes=("float32", "float32", "bfloat16"))
)  # fmt: skip
def test_edge_programs_traced_equal_eager_in_numpy_and_jax(program):
    if refused_eagerly(program, program.example_inputs()) is None:
        check_traced(program, rtol_of(program, None))
