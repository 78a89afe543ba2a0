"""Random programs of language ops (namedmesh.testing.strategies.programs): traced and run
by nm.reference equals eager, and the jax implementations agree with the NumPy ones (two
independent implementations of every primitive)."""

import jax
import numpy as np
from hypothesis import given, settings

import namedmesh as nm
from namedmesh.testing import compare
from namedmesh.testing import strategies as S


@settings(max_examples=max(10, settings.default.max_examples // 2))  # the suite's time budget
@given(S.programs())
def test_traced_reference_equals_eager_and_jax(program):
    xs = program.example_inputs()
    eager = program(*xs)
    graph = nm.trace(program, *xs)
    ref = nm.reference(graph)(*xs)
    assert isinstance(ref.data, np.ndarray)
    compare(ref, eager, rtol=1e-6)
    # jitted: one compile per program, where eager jax compiles every op's shapes (5x)
    jax_out = jax.jit(nm.interpret(graph))(*xs)
    compare(nm.tensor(np.asarray(jax_out.data), jax_out.dims), eager)
