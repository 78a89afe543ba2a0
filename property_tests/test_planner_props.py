"""The planner's contract, for random programs x meshes x layouts (hypothesis): the
Plan the Planner makes without jax equals the plan the rules log as jax traces them
(layouts, local ops with their local avals, collectives, casts). With property 3 of
test_lowering_props.py (a planned program's collectives are those of its compiled
HLO, which the emitter made from the Plan), planner and emitter agree."""

import re

import pytest
from hypothesis import assume, given

import namedmesh as nm
from lowering import lower, rules
from lowering.plan import signature
from namedmesh.testing import strategies as S


@given(S.cases(max_steps=4))
def test_the_planners_plan_is_the_traced_plan(case):
    program, mesh, layout = case
    xs = program.example_inputs()
    assume(rules.plannable(nm.trace(program, *xs), lower(program, mesh, layout).layout))
    lowered = lower(program, mesh, layout)
    try:
        planned = lowered.plan(*xs)
    except nm.LayoutError as e:
        with pytest.raises(nm.LayoutError, match=re.escape(str(e)[:40])):
            lowered.traced_plan(*xs)
        return
    assert signature(planned) == signature(lowered.traced_plan(*xs))
