"""The planner's memos change no plan: a scan body's passes planned before under the same
layouts, shards and carry type are not planned again, those that widened the carry's
type nor those that settled it (lowering/rules/control.py `widenings`, `settled`), not
even by another (mesh, settings) pair's search whose program holds the same body
(lowering/bodies.py), and a pipeline's stages that hold the same layers are traced and
costed once (lowering/stages.py). Oracles: the same search with the memo off, every
candidate compared, and the count of distinct stages worked out by hand."""

import importlib

import pytest

import namedmesh as nm
from lowering import Mesh, bodies, caches
from lowering import joint as joint_module
from lowering import search as search_module
from lowering.interpret import plan_program as plan_program_of
from lowering.joint import Settings, joint_search
from lowering.rates import parse
from lowering.rules import control
from lowering.stages import staged_choice
from lowering.train_step import Training
from models import catalog
from models.cli import plan as plan_cli
from tests.test_stage_costs import RATES, toy_build

lower_module = importlib.import_module("lowering.lower")  # (lowering.lower: the function)
MOE = {"experts": 4, "experts_per_token": 2, "dense_layers": 2, "layers": 4}  # two stacks
RATES_H100 = parse("h100,node=8")


def _rows(table) -> list:
    return [(str(c.layout), c.planned, c.memory, c.flops, c.bytes, c.collectives, c.note,
             c.step) for c in table]  # fmt: skip


def _joint(cfg, mesh, space) -> tuple:
    """joint_search of `cfg`'s LM over every pair, none pruned: its plans and each
    pair's table of candidates by remat."""
    caches.clear()
    cache: dict = {}
    joint = joint_search(plan_cli.builder(cfg, 8, 32), [mesh], RATES_H100, space,
                         memory_limit=4e7, exhaustive=True, cache=cache)  # fmt: skip
    tables = {k[1].remat: _rows(v) for k, v in cache.items() if isinstance(v, search_module.Search)}
    plans = [(dict(c.mesh.sizes), c.settings, str(c.layout), c.step_seconds, c.memory, c.fits)
             for c in joint.choices]  # fmt: skip
    return plans, tables


def test_shared_bodies_plans_and_pass_memos_change_no_candidate_and_save_work(monkeypatch):
    """A MoE model of two stacks (dense, then experts) under blockwise attention, remat
    none and full, on a mesh of a stage axis (layers:stage layouts, pipelined): loops
    nested three deep whose carries widen. Every candidate of both pairs' searches costs
    the same with their programs sharing plans and scan bodies (lowering/bodies.py
    `Shared`: the full pair's candidates take the none pair's plans, but the pipelined
    ones, and its passes; the none pair's two stacks share their attention body) as
    with each program its own, and with the pass memos off (`widenings`, `settled`);
    each saves plans or passes."""
    cfg = catalog.get("tiny").replace(**MOE)
    mesh = Mesh({"stage": 2}, devices="abstract")
    space = [Settings(r, "bfloat16", "blockwise", 1) for r in ("none", "full")]
    work, by_pair = {"passes": 0, "plans": 0}, []
    plan_body, search, plan_program = control._plan_body, joint_module.auto_layout, plan_program_of

    def counted(*args):
        work["passes"] += 1
        return plan_body(*args)

    def planned(*args, **kw):
        work["plans"] += 1
        return plan_program(*args, **kw)

    def searched(*args, **kw):  # the plans and passes each pair's search makes
        before = dict(work)
        out = search(*args, **kw)
        by_pair.append(tuple(work[k] - before[k] for k in ("plans", "passes")))
        return out

    monkeypatch.setattr(control, "_plan_body", counted)
    monkeypatch.setattr(bodies, "plan_program", planned)
    monkeypatch.setattr(lower_module, "plan_program", planned)
    monkeypatch.setattr(joint_module, "auto_layout", searched)
    shared = _joint(cfg, mesh, space)
    assert sorted(shared[1]) == ["full", "none"]
    assert any("stage" in row[0] for row in shared[1]["full"])  # pipelined candidates
    (none, full) = by_pair  # (plans, passes) of each pair's search
    monkeypatch.setattr(bodies.Shared, "adopt", lambda self, graph: graph)
    by_pair.clear()
    assert _joint(cfg, mesh, space) == shared  # each program its own
    (none_alone, full_alone) = by_pair
    assert none[0] == none_alone[0] and full[0] < full_alone[0]  # 19 + 5 plans, 19 + 19
    assert none[1] < none_alone[1] and full[1] < full_alone[1]  # 44 + 10 passes, 55 + 55
    # the full pair alone, its search's memos off: the same candidates, more passes
    monkeypatch.setattr(control, "widenings", lambda body: {})
    monkeypatch.setattr(control, "settled", lambda body: {})
    caches.clear()
    fn, inputs = plan_cli.builder(cfg, 8, 32)(space[1])
    work["passes"] = 0
    _, table = search(fn, mesh, *inputs, grad_argnums=(0,), rates=RATES_H100,
                      training=Training(), beam=1, memory_limit=4e7)  # fmt: skip
    assert _rows(table) == shared[1]["full"]
    assert full_alone[1] < work["passes"]  # 90


def test_bodies_are_shared_only_where_they_are_the_same():
    """Programs that differ in remat share both bodies (layers, attention's blocks);
    one of another length or attention kernel shares none of its own: the fingerprint
    holds shapes and equations."""
    build = plan_cli.builder(catalog.get("tiny"), 8, 32)

    def graph(settings):
        fn, inputs = build(settings)
        return nm.trace(fn, *inputs)

    known: dict = {}
    assert bodies.share_bodies(graph(Settings("none", attention="blockwise")), known) == 0
    n = len(known)
    assert n >= 2  # the layers' body and the attention blocks' nested in it
    assert bodies.share_bodies(graph(Settings("full", attention="blockwise")), known) == 1
    assert len(known) == n  # the layers' body replaced whole (its nested ones with it)
    assert bodies.share_bodies(graph(Settings("full", attention="full")), known) == 0
    assert bodies.share_bodies(graph(Settings("none", grad_accum=2)), known) == 0
    assert len(known) == n + 2


def test_a_stage_body_repeated_on_many_stages_is_built_once():
    """10 layers on 5 stages of 2: the first (with the embedding), three alike between
    and the last (with the head): 3 distinct stages, each built once, the middle one's
    cost shared by its three positions."""
    built = []

    def build(settings, counts, first, last):
        built.append((counts, first, last))
        return toy_build(settings, counts, first, last)

    mesh = Mesh({"stage": 5, "data": 2}, devices="abstract")
    choice = staged_choice(build, mesh, Settings(grad_accum=4), [10], RATES, Training(), 8e9,
                           1.0, 64.0, False)  # fmt: skip
    assert sorted(built) == [((2,), False, False), ((2,), False, True), ((2,), True, False)]
    assert sorted(c.positions for c in choice.costs) == [[0], [1, 2, 3], [4]]


if __name__ == "__main__":
    pytest.main([__file__])
