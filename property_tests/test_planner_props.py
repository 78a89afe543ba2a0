"""The planner's contract, for random programs x meshes x layouts (hypothesis): the
program the emitter makes of the Plan, traced with its check on, makes every value
as the plan says (shape, dtype, the mesh axes it varies over), and a search's
costing-only plan reports what the full plan reports. With property 3 of
test_lowering_props.py (a planned program's collectives are those of its compiled
HLO) and the value properties (its results are NumPy's), planner and emitter agree."""

import re

import pytest
from hypothesis import given

import namedmesh as nm
from lowering import caches, lower
from lowering.lower import argument_inputs, graph_report
from namedmesh.testing import strategies as S


@given(S.cases(max_steps=4))
def test_the_emitted_program_makes_what_the_plan_says(case):
    program, mesh, layout = case
    xs = program.example_inputs()
    lowered = lower(program, mesh, layout)
    try:
        planned = lowered.plan(*xs)
    except nm.LayoutError as e:
        with pytest.raises(nm.LayoutError, match=re.escape(str(e)[:40])):
            lowered.check(*xs)
        return
    assert lowered.check(*xs) is planned  # PlanMismatch at the first value that differs


@given(S.cases(max_steps=4))
def test_costing_only_reports_what_the_full_plan_reports(case):
    """What auto_layout costs each candidate by (`graph_report`: a Planner that makes no
    events text and no instructions, from cold caches, then again from warm ones) is
    the report of the full plan (`Lowered.report`), every figure and its text."""
    program, mesh, layout = case
    xs = program.example_inputs()
    lowered = lower(program, mesh, layout)
    graph = nm.trace(program, *xs)
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
