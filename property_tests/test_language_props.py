"""Random programs of language ops (namedmesh.testing.strategies.programs): traced and run
by nm.reference equals eager, and the jax implementations agree with the NumPy ones (two
independent implementations of every primitive); and run eagerly in a second thread
while one thread traces it, as run alone."""

import contextlib
import threading

import jax
import numpy as np
from hypothesis import given, settings

import namedmesh as nm
from namedmesh.testing import compare
from namedmesh.testing import strategies as S


@settings(max_examples=max(10, settings.default.max_examples // 2))  # the suite's time budget
@given(S.programs())
def test_traced_reference_equals_eager_and_jax(program):
    check_traced(program)


def check_traced(program, rtol=None) -> None:
    """Traced and run by nm.reference equals eager; jitted jax equals eager within
    `rtol` (by default the result dtype's tolerance)."""
    xs = program.example_inputs()
    eager = program(*xs)
    graph = nm.trace(program, *xs)
    ref = nm.reference(graph)(*xs)
    assert isinstance(ref.data, np.ndarray)
    compare(ref, eager, rtol=1e-6)
    # jitted: one compile per program, where eager jax compiles every op's shapes (5x)
    jax_out = jax.jit(nm.interpret(graph))(*xs)
    compare(nm.tensor(np.asarray(jax_out.data), jax_out.dims), eager, rtol)


def check_second_thread(program) -> None:
    """While this thread traces `program` (held open by a barrier), a second thread runs
    it eagerly: each equals the program run alone (issue 38 class 5: the trace stack was
    the process's, so the second thread's ops were recorded into this trace)."""
    xs = program.example_inputs()
    alone = program(*xs)
    barrier = threading.Barrier(2, timeout=20)
    got = {}

    def traced(*ys):
        out = program(*ys)
        barrier.wait()  # the trace is open: the other thread runs now
        barrier.wait()
        return out

    def other():
        try:
            barrier.wait()
            got["eager"] = program(*xs)
        except Exception as e:  # a wrong answer's error, raised in this thread below
            got["eager"] = e
        finally:
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait()

    thread = threading.Thread(target=other)
    thread.start()
    try:
        graph = nm.trace(traced, *xs)
    finally:
        thread.join(30)
    if isinstance(got["eager"], Exception):
        raise got["eager"]
    compare(got["eager"], alone, rtol=0.0)
    compare(nm.reference(graph)(*xs), alone, rtol=1e-6)


@settings(max_examples=max(10, settings.default.max_examples // 2))  # NumPy only: no compile
@given(S.programs(max_steps=3))
def test_a_second_thread_runs_eagerly_while_one_traces(program):
    check_second_thread(program)
