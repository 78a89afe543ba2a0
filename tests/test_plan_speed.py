"""The planner's memos change no plan: a scan body's passes planned before under the same
layouts, shards and carry type are not planned again, those that widened the carry's
type nor those that settled it (lowering/rules/control.py `widenings`, `settled`), and a
pipeline's stages that hold the same layers are traced and costed once
(lowering/stages.py). Oracles: the same search with the memo off, every candidate
compared, and the count of distinct stages worked out by hand."""

import pytest

from lowering import Mesh, caches
from lowering.joint import Settings
from lowering.rates import parse
from lowering.rules import control
from lowering.search import auto_layout
from lowering.stages import staged_choice
from lowering.train_step import Training
from models import catalog
from models.cli import plan as plan_cli
from tests.test_stage_costs import RATES, toy_build


def _table(fn, inputs):
    caches.clear()
    _, table = auto_layout(fn, Mesh({"data": 2, "model": 2}, devices="abstract"), *inputs,
                           grad_argnums=(0,), rates=parse("h100,node=8"), training=Training(),
                           beam=1, memory_limit=4e7)  # fmt: skip
    return [(str(c.layout), c.planned, c.memory, c.flops, c.bytes, c.collectives, c.note,
             c.step) for c in table]  # fmt: skip


def test_skipping_known_carry_widenings_changes_no_candidate(monkeypatch):
    """A MoE model of two stacks (dense, then experts) under remat and blockwise
    attention: loops nested three deep whose carries widen. Every candidate of the
    search costs the same with the memos as without them, and they skipped passes."""
    cfg = catalog.get("tiny").replace(experts=4, experts_per_token=2, dense_layers=1, layers=2)
    settings = Settings("full", "bfloat16", "blockwise", 1)
    fn, inputs = plan_cli.builder(cfg, 4, 32)(settings)
    passes = [0]
    plan_body = control._plan_body

    def counted(*args):
        passes[0] += 1
        return plan_body(*args)

    monkeypatch.setattr(control, "_plan_body", counted)
    with_memo, planned = _table(fn, inputs), passes[0]
    monkeypatch.setattr(control, "widenings", lambda body: {})
    monkeypatch.setattr(control, "settled", lambda body: {})
    passes[0] = 0
    assert _table(fn, inputs) == with_memo
    assert planned < passes[0]


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
