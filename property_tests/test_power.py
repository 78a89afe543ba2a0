"""The harness has teeth: with a lowering rule made subtly wrong, property 1 finds a
counterexample and hypothesis shrinks it to a small case."""

import contextlib

import jax
import pytest
from hypothesis import HealthCheck, find, settings

import lowering.collectives as col
import namedmesh as nm
from lowering import lower
from namedmesh.testing import CASES, compare
from namedmesh.testing import strategies as S


def wrong(case) -> bool:
    """The lowered result differs from the reference, or lowering fails with anything but
    a LayoutError (which a layout may deserve)."""
    program, mesh, layout = case
    xs = program.example_inputs()
    try:
        out = lower(program, mesh, layout)(*xs)
    except nm.LayoutError:
        return False
    except Exception:
        return True
    CASES["lowered"] += 1
    try:
        compare(out, nm.reference(nm.trace(program, *xs))(*xs))
    except AssertionError:
        return True
    return False


def drop_first_axis(psum):
    """A psum that forgets the first of its mesh axes."""
    return lambda x, axes, log: psum(x, tuple(axes)[1:], log)


def scatter_along_wrong_dim(psum_scatter):
    """A psum_scatter along the first other dim its mesh axes also divide."""

    def bad(x, axes, dim, log):
        n = 1
        for a in axes:
            n *= jax.lax.psum(1, a)
        other = [i for i in range(x.ndim) if i != dim and x.shape[i] % n == 0]
        return psum_scatter(x, axes, other[0] if other else dim, log)

    return bad


@contextlib.contextmanager
def mutated(name, make):
    original = getattr(col, name)
    setattr(col, name, make(original))
    try:
        yield
    finally:
        setattr(col, name, original)


POWER = settings(
    max_examples=3000, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)


@pytest.mark.parametrize(
    "name, make", [("psum", drop_first_axis), ("psum_scatter", scatter_along_wrong_dim)]
)
def test_a_wrong_rule_is_found_and_shrunk(name, make):
    with mutated(name, make):
        program, mesh, layout = find(
            S.cases(max_steps=3, kinds=S.EINSUM_KINDS), wrong, settings=POWER
        )
        print(f"\nmutated {name}: smallest counterexample {program!r} on {mesh} under {layout!r}")
    assert not wrong((program, mesh, layout))  # right again once the rule is restored
    assert len(program.steps) <= 2  # (unused inputs may stay: indices refer to them)
    assert len(mesh.sizes) <= 2 and len(layout.rules) <= 2
