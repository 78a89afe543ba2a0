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


# Issue 13's classes of silent wrong answers, each reintroduced as the rule's old
# behaviour: the value-case properties (property_tests/test_value_props.py) must find each
# and shrink it. `wrong_value` is their check as a predicate.
import importlib  # noqa: E402

import jax.numpy as jnp  # noqa: E402

import lowering.rules as rules  # noqa: E402
from namedmesh.testing import lowered as cached_lower  # noqa: E402
from property_tests import test_value_props as V  # noqa: E402

lowering_lower = importlib.import_module("lowering.lower")  # `lowering.lower` is the function


def clear_caches() -> None:
    cached_lower.cache_clear()
    V.gradients.cache_clear()


def failing(check):
    def wrong_value(case) -> bool:
        try:
            check(case)
        except Exception:  # a wrong answer, a raw error, or costed flops too low
            return True
        return False

    return wrong_value


def old_extreme(name, x, y, axes, split, log):
    """max/min as the sum of the elements equal to the extreme over their count."""
    m = rules._extreme(name, jax.lax.stop_gradient(y), split, log)
    hit = x == jnp.expand_dims(m, axes)
    count = col.psum(jnp.sum(hit, axis=axes, dtype=x.dtype), split, log)
    return col.psum(jnp.sum(jnp.where(hit, x, 0), axis=axes), split, log) / count


def old_key(x, largest=True):
    """Raw values, negated for argmin: -0.0 ranks above 0.0 and NaN may lose."""
    if largest:
        return x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
    return -x if jnp.issubdtype(x.dtype, jnp.inexact) else ~x


def old_lowest(dtype):
    return -jnp.inf if dtype.kind == "f" else jnp.iinfo(dtype).min


ALL = S.DTYPES
MUTATIONS = {  # class -> ([(module, name, old value)], ops and dtypes drawn, property)
    "1-max-min": ([(rules, "_global_extreme", old_extreme)], ("max", "min"), ALL, V.check_values),
    # argmin's class lives in the float order (-0.0, NaN): drawn there, it is found sooner
    "2-argmax-argmin": (
        [(rules, "sort_key", old_key)],
        ("argmax", "argmin"),
        S.FLOATS,
        V.check_values,
    ),
    "6-bool-einsum": (
        [
            (rules, "_as_counts", lambda y, summed, sizes: y.astype(jnp.int32)),
            (rules, "_from_counts", lambda y, dtype: y),
        ],
        ("einsum",),
        ALL,
        V.check_values,
    ),
    "8-pool-fill": ([(rules, "lowest", old_lowest)], ("pool",), ALL, V.check_values),
    "9-softmax-inf": (
        [(rules, "_SHIFT", {**rules._SHIFT, "softmax": rules.finite_shift})],
        ("softmax",),
        ALL,
        V.check_values,
    ),
    "10-uncosted": (
        [(lowering_lower, "cost_own_arithmetic", lambda *a: None)],
        ("softmax", "top_k", "logsumexp"),
        ALL,
        V.check_split_flops,
    ),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_each_reintroduced_wrong_answer_is_found_and_shrunk(name, monkeypatch):
    patches, ops, dtypes, check = MUTATIONS[name]
    with monkeypatch.context() as m:
        for module, attr, value in patches:
            m.setattr(module, attr, value)
        clear_caches()  # programs lowered by the right rules must not be reused
        case = find(S.value_cases(ops=ops, dtypes=dtypes), failing(check), settings=POWER)
        print(f"\nclass {name}: smallest counterexample {case!r}")
    clear_caches()  # nor those lowered by the wrong ones
    assert not failing(check)(case)  # right again once the rule is restored
    distinct = {repr(v) for v in case.x.ravel().tolist()}
    assert len(distinct) <= 3 and len(case.mesh) <= 2, case  # shrunk to a few values
