"""The planner's speed work changes no plan: small searches (a MoE model's nested loops
under remat and blockwise attention, a dense model with pipelined `layers:stage`
candidates, and a MoE model's three layers dealt unevenly to two stages) give every
candidate the same layout, flops, bytes, collectives, memory by part, times and note,
and the same choice, as the planner did before that work.

Oracle: tests/data/plan_identity.json, the same computations' figures as written by
the planner at commit 42837c8 (before lowering/plan.py's and lowering/interpret.py's
per-candidate speed-ups), floats by their repr. A deliberate change of the cost model
changes them: rewrite it then with `python -m tests.test_plan_identity --write` and
say why in the commit."""

import json
import sys
from pathlib import Path

from lowering import Mesh, caches
from lowering.joint import Settings
from lowering.rates import parse
from lowering.search import auto_layout
from lowering.stages import staged_choice
from lowering.train_step import Training
from models import catalog
from models.cli import plan as plan_cli

ORACLE = Path(__file__).parent / "data" / "plan_identity.json"
RATES = parse("h100,node=2")
MOE = dict(experts=4, experts_per_token=2, dense_layers=1, layers=3)


def _row(c) -> str:
    step = None if c.step is None else c.step.as_dict()
    return repr((str(c.layout), c.flops, c.bytes, c.memory, c.time, c.planned, c.compute,
                 c.comm, c.collectives, c.note, step, c.sync, repr(c.pipelines)))  # fmt: skip


def _search(cfg, settings, sizes, limit: float) -> list[str]:
    """The choice and every candidate of a search held to `limit` bytes (about the
    median candidate's: some fit, some do not)."""
    fn, inputs = plan_cli.builder(cfg, 16, 32)(settings)
    layout, table = auto_layout(fn, Mesh(sizes, devices="abstract"), *inputs, grad_argnums=(0,),
                                rates=RATES, training=Training(grad_accum=settings.grad_accum),
                                memory_limit=limit, beam=1)  # fmt: skip
    return [str(layout)] + [_row(c) for c in table]


def _uneven(cfg) -> list[str]:
    """Three layers (one dense, two MoE) on two stages: 2 + 1, each stage searched."""
    settings = Settings("full", "bfloat16", "full", 2)
    build = plan_cli.stage_builder(cfg, 16, 32)
    mesh = Mesh({"stage": 2, "data": 2}, devices="abstract")
    choice = staged_choice(build, mesh, settings, [1, 2], RATES, Training(), 7e6, 1.0, 64.0,
                           True)  # fmt: skip
    rows = [repr(choice.assignment), repr(choice.note), repr(choice.uneven)]
    for cost in choice.costs:
        rows.append(repr((cost.counts, cost.positions, cost.first, cost.last)))
        rows.append(_row(cost.candidate))
    return rows


def figures() -> dict[str, list[str]]:
    caches.clear()
    tiny = catalog.get("tiny")
    moe = tiny.replace(**MOE)
    return {
        "moe, remat full, blockwise": _search(
            moe, Settings("full", "bfloat16", "blockwise", 1), {"data": 2, "model": 2}, 9.7e6
        ),
        "dense, layers:stage candidates": _search(
            tiny, Settings("none", "float32", "full", 4), {"stage": 2, "data": 2, "model": 2}, 3.8e6
        ),
        "moe, uneven stages": _uneven(moe),
    }


def test_every_candidate_and_choice_as_before():
    want = json.loads(ORACLE.read_text())
    got = figures()
    assert got.keys() == want.keys()
    for name, rows in want.items():
        assert len(got[name]) == len(rows), name
        for mine, theirs in zip(got[name], rows, strict=True):
            assert mine == theirs, name


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    ORACLE.parent.mkdir(exist_ok=True)
    ORACLE.write_text(json.dumps(figures(), indent=0) + "\n")
