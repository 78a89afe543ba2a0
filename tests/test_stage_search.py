"""A joint search's pipelined pairs searched as its other pairs are (lowering/joint.py):
each stage mesh's lead (its most microbatches) searched alone, the other pairs' stage
searches climbing from the lead's layout (`seeds`), a failing descent stopped at a
plateau. Oracles: brute force (every layout giving each axis of a stage's devices to
at most two dims, each costed as the pipeline's step by `staged_choice(layout=)`, no
search), and the same joint search `exhaustive` (no seeds, no plateau)."""

import functools
import math

import pytest

from lowering import Mesh
from lowering import stages as stages_module
from lowering.joint import PlanError, Settings, joint_search
from lowering.search import PLATEAU
from lowering.stages import StagedChoice, staged_choice
from lowering.train_step import Training
from namedmesh.errors import LayoutError
from tests.test_search_optimal import layouts
from tests.test_stage_costs import F32, RATES, B, D, toy_build

MESH = Mesh({"stage": 2, "data": 2, "model": 2}, devices="abstract")
PLAIN = Mesh({"data": 4, "model": 2}, devices="abstract")  # MESH's lead's `_parent`
COUNTS = (2, 4)  # microbatches: the lead is 4, the most
DIMS = ["batch", "d_model", "d_next", "d_in"]
SEARCH = stages_module.auto_layout


def _evaluate(limit, mesh, settings, flops, layout=None, seeds=(), plateau=0.0):
    boundary = B // settings.grad_accum * D * F32
    return staged_choice(toy_build, mesh, settings, [5], RATES, Training(), limit, flops,
                         boundary, False, layout=layout, seeds=seeds,
                         plateau=plateau)  # fmt: skip


@pytest.fixture(scope="module")
def brute():
    """(step seconds, memory) of every valid layout of the enumeration, per count."""
    rows = []
    for m in COUNTS:
        for layout in layouts(DIMS, ["data", "model"]):
            choice = _evaluate(math.inf, MESH, Settings(grad_accum=m), 1.0, layout=layout)
            if all(c.candidate.step is not None for c in choice.costs):
                rows.append((choice.step_seconds, choice.memory.total))
    return rows


def _plan(limit, exhaustive, monkeypatch, meshes=(MESH,)):
    """joint_search of the toy on `meshes`, the stage mesh's every count of COUNTS, and
    its stage searches' (seeds, plateau, candidates) in order."""
    calls, search = [], SEARCH

    def noting(*args, seeds=(), plateau=0.0, **kw):
        try:
            found = search(*args, seeds=seeds, plateau=plateau, **kw)
        except LayoutError as e:
            calls.append((len(seeds), plateau, len(getattr(e, "search", None) or [])))
            raise
        calls.append((len(seeds), plateau, len(found[1])))
        return found

    monkeypatch.setattr(stages_module, "auto_layout", noting)
    cache: dict = {}
    whole = lambda settings: toy_build(settings, (5,), True, True)
    staged = (functools.partial(_evaluate, limit), [Settings(grad_accum=m) for m in COUNTS])
    try:
        joint = joint_search(whole, list(meshes), RATES, [Settings()], memory_limit=limit,
                             tokens=B, staged=staged, exhaustive=exhaustive,
                             cache=cache)  # fmt: skip
    except PlanError:
        joint = None
    choices = [v for v in cache.values() if isinstance(v, StagedChoice)]
    return joint, choices, calls


@pytest.mark.parametrize("quantile", [0.05, 0.3])
def test_a_seeded_pipelined_search_finds_the_brute_force_optimum(brute, quantile, monkeypatch):
    """Under a limit that binds, the seeded search's plan is the exhaustive search's and
    no slower than the best of every layout that fits; the pair that is not the lead
    climbed from the lead's layout, and the stage searches stop descents at PLATEAU."""
    memories = sorted({m for _, m in brute})
    limit = memories[int(quantile * (len(memories) - 1))]
    best = min(t for t, m in brute if m <= limit)
    seeded, _, calls = _plan(limit, False, monkeypatch)
    whole, _, _ = _plan(limit, True, monkeypatch)
    assert seeded.best.fits and seeded.best.step_seconds <= best * (1 + 1e-9)
    assert seeded.best.step_seconds == pytest.approx(whole.best.step_seconds, rel=1e-12)
    assert seeded.best.settings == whole.best.settings
    # the lead (4 microbatches) unseeded and first, then the other pair from its layout
    assert [c[:2] for c in calls][:2] == [(0, PLATEAU), (1, PLATEAU)]
    # beside a mesh without stages of the same model axis, the lead climbs from its
    # lead's layout, and the best pipelined plan is still no slower than brute force
    beside, _, calls = _plan(limit, False, monkeypatch, (PLAIN, MESH))
    piped = min((c for c in beside.choices if isinstance(c, StagedChoice) and c.fits),
                key=lambda c: c.step_seconds)  # fmt: skip
    assert piped.step_seconds <= best * (1 + 1e-9)
    assert [c[:2] for c in calls][:2] == [(1, PLATEAU), (1, PLATEAU)]


def test_a_failing_pipelined_descent_stops_at_a_plateau_near_the_least_memory(brute, monkeypatch):
    """Under a limit no layout meets, no plan: the stopped descents' closest memory is
    within PLATEAU of the brute-force least, on fewer candidates than the whole descents
    planned (exhaustive)."""
    least = min(m for _, m in brute)
    stopped, closest, calls = _plan(least * 0.9, False, monkeypatch)
    whole, _, all_calls = _plan(least * 0.9, True, monkeypatch)
    assert stopped is None and whole is None
    assert least <= min(c.memory.total for c in closest) <= least * (1 + PLATEAU)
    assert sum(n for *_, n in calls) < sum(n for *_, n in all_calls)
