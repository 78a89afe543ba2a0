"""joint_search's least possible memory (lowering/joint.py `_WholeCosts.least_bytes`):
the whole step's memory on one device over the mesh's devices. It prunes a pair only
when it is a bound: no candidate of a layout search plans under it (every layout's
step memory, costed by the search, no lower), the plan is the one every pair searched
finds (`exhaustive`), and a refusal names the same closest plan as with the bound off."""

import pytest

from lowering import Mesh
from lowering import joint as joint_module
from lowering.joint import BOUND, PlanError, Settings, joint_search
from lowering.rates import parse
from lowering.search import auto_layout
from lowering.train_step import Training
from models import catalog
from models.cli import plan as plan_cli
from namedmesh.errors import LayoutError

RATES = parse("h100,node=8")
MESH = Mesh({"data": 4, "model": 2}, devices="abstract")
SPACE = [Settings(r, "bfloat16", "blockwise", g) for r in ("none", "full") for g in (1, 2)]


@pytest.fixture(scope="module")
def build():
    return plan_cli.builder(catalog.get("tiny"), 8, 32)


@pytest.fixture(scope="module")
def least(build):
    whole = joint_module._WholeCosts(build, Training())
    return {s: whole.least_bytes(s) / MESH.size for s in SPACE}


@pytest.mark.parametrize("settings", SPACE, ids=str)
def test_no_candidate_plans_under_the_least_possible_memory(build, least, settings):
    fn, inputs = build(settings)
    try:  # a limit that binds: the search walks towards the least memory too
        _, table = auto_layout(fn, MESH, *inputs, grad_argnums=(0,), rates=RATES, beam=1,
                               training=Training(grad_accum=settings.grad_accum),
                               memory_limit=least[settings] * 1.2)  # fmt: skip
    except LayoutError as e:
        table = e.search
    memories = [c.step.total for c in table if c.step is not None]
    assert len(memories) > 10
    assert min(memories) >= least[settings] * (1 - 1e-12)
    assert min(memories) <= least[settings] * 1.5  # a bound near the least found


def _plan(build, limit, space=SPACE, **kw):
    try:
        return joint_search(build, [MESH], RATES, space, memory_limit=limit, **kw)
    except PlanError as e:
        return str(e)


def test_the_bound_prunes_pairs_and_keeps_the_plan_and_the_refusal(build, least, monkeypatch):
    limit = sorted(least.values())[len(SPACE) // 2]  # half the pairs' bounds over it
    pruned = _plan(build, limit)
    whole = _plan(build, limit, exhaustive=True)
    assert pruned.pruned.get(BOUND) and pruned.searched < whole.searched
    best, other = pruned.best, whole.best  # (its rules may come in another order)
    assert best.settings == other.settings
    assert (best.step_seconds, best.memory) == (other.step_seconds, other.memory)
    # nothing fits: the bounded pairs are searched after all, the refusal the same
    below = min(least.values()) * 0.99
    refused = _plan(build, below, SPACE[::2])  # (one count of microbatches: fewer searches)
    monkeypatch.setattr(joint_module._WholeCosts, "least_bytes", lambda self, s: 0.0)
    assert refused == _plan(build, below, SPACE[::2])
    assert isinstance(refused, str) and "The closest" in refused
