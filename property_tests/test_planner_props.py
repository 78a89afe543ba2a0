"""The planner's contract, for random programs x meshes x layouts (hypothesis): the
Plan the Planner makes without jax equals the plan the rules log as jax traces them
(layouts, local ops with their local avals, collectives, casts). With property 3 of
test_lowering_props.py (a planned program's collectives are those of its compiled
HLO, which the emitter made from the Plan), planner and emitter agree."""

import re

import pytest
from hypothesis import assume, given

import namedmesh as nm
from lowering import caches, lower, rules
from lowering.lower import argument_inputs, graph_report
from lowering.plan import signature
from namedmesh.testing import strategies as S


@given(S.cases(max_steps=4))
def test_the_planners_plan_is_the_traced_plan(case):
    program, mesh, layout = case
    xs = program.example_inputs()
    assume(rules.plannable(nm.trace(program, *xs)))
    lowered = lower(program, mesh, layout)
    try:
        planned = lowered.plan(*xs)
    except nm.LayoutError as e:
        with pytest.raises(nm.LayoutError, match=re.escape(str(e)[:40])):
            lowered.traced_plan(*xs)
        return
    assert signature(planned) == signature(lowered.traced_plan(*xs))


@given(S.cases(max_steps=4))
def test_costing_only_reports_what_the_full_plan_reports(case):
    """What auto_layout costs each candidate by (`graph_report`: a Planner that makes no
    events text and no instructions, from cold caches, then again from warm ones) is
    the report of the full plan (`Lowered.report`), every figure and its text."""
    program, mesh, layout = case
    xs = program.example_inputs()
    lowered = lower(program, mesh, layout)
    graph = nm.trace(program, *xs)
    assume(rules.plannable(graph))
    argnums = tuple(range(len(xs)))
    wrt = argument_inputs(graph, xs, argnums)
    caches.clear()
    try:
        cold = graph_report(graph, mesh, lowered.layout, wrt)
    except nm.LayoutError as e:
        with pytest.raises(nm.LayoutError, match=re.escape(str(e)[:40])):
            lowered.report(*xs, wrt=argnums, show=False)
        return
    full = lowered.report(*xs, wrt=argnums, show=False)
    warm = graph_report(graph, mesh, lowered.layout, wrt)
    assert cold == full == warm
    assert str(cold) == str(full) == str(warm)
