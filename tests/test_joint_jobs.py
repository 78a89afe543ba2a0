"""`namedmesh plan --jobs N` (lowering/joint_jobs.py): the pairs searched in worker
processes give the serial plan exactly, a worker's error is the same typed error, and
Ctrl-C ends the command in one line with the workers gone."""

import functools
import json
import os
import pickle
import queue
import signal
import time
from dataclasses import dataclass

import pytest

from lowering import joint_jobs
from lowering.joint import Settings, joint_search
from lowering.mesh import Mesh
from lowering.rates import parse
from models import catalog
from models.cli import plan as plan_cli
from namedmesh.errors import LayoutError, ShapeError

# 1 dense + 4 MoE layers: 4 stages deal them unevenly, so the stage meshes are planned
# as pipelined pairs (lowering/stages.py) beside the (data, model) shapes' layout searches
FLAGS = ["--config", "moe5", "--devices", "8", "--stages", "4", "--rates", "h100",
         "--batch", "16", "--length", "32", "--remat", "dots", "--attention", "full",
         "--grad-accum", "1"]  # fmt: skip


@pytest.fixture()
def moe5(monkeypatch):
    cfg = catalog.get("tiny").replace(experts=4, experts_per_token=2, dense_layers=1, layers=5)
    monkeypatch.setattr(plan_cli, "load_config", lambda text: cfg)


def _plan(capsys, *flags) -> tuple[int, str, str]:
    status = plan_cli.main([*flags], prog="namedmesh plan")
    out, err = capsys.readouterr()
    return status, out, err


# remat and attention searched on one mesh: its pairs but its lead (remat full, blockwise)
# climb from the lead's layout (lowering/joint.py `_seeds`), the full attention group's
# search waiting on the lead's group in the workers (`after`)
SEEDED = ["--config", "moe5", "--mesh", "data=4,model=2", "--rates", "h100", "--batch", "16",
          "--length", "32", "--grad-accum", "1"]  # fmt: skip


@pytest.mark.parametrize("flags", [FLAGS, SEEDED], ids=["stages", "seeded"])
def test_two_jobs_plan_what_one_does_the_work_done_in_the_workers(capsys, monkeypatch, moe5, flags):
    import lowering.joint

    seeded, search = [], lowering.joint.auto_layout

    def noting(*args, seeds=(), **kwargs):
        seeded.append(bool(seeds))
        return search(*args, seeds=seeds, **kwargs)

    monkeypatch.setattr(lowering.joint, "auto_layout", noting)
    status, serial, err = _plan(capsys, *flags, "--jobs", "1", "--json")
    assert status == 0, err
    assert any(seeded) == (flags is SEEDED), seeded
    # the workers import their own modules: in this process no pair may be searched
    import lowering.joint
    import lowering.stages

    def here(*args, **kwargs):
        raise AssertionError("a pair was searched in the calling process")

    monkeypatch.setattr(lowering.joint, "auto_layout", here)
    monkeypatch.setattr(lowering.stages, "staged_choice", here)
    status, parallel, err = _plan(capsys, *flags, "--jobs", "2", "--json")
    assert status == 0, err
    got = json.loads(parallel)
    assert got == json.loads(serial)  # every figure, the next best and the printout
    assert got["searched"] >= 4
    if flags is FLAGS:
        assert "stage" in (got.get("pipelined") or got)["mesh"]


@dataclass(frozen=True)
class Faulty:
    """A build (it pickles: a module-level class) whose remat `dots` program is refused."""

    inner: object

    def __call__(self, settings):
        if settings.remat == "dots":
            raise ShapeError(f"faulty build: no program for {settings}")
        return self.inner(settings)


def unpicklable_error():
    error = LayoutError("no layout fits")
    error.search = lambda: None  # as a LayoutError's Search holds the traced program
    raise error


def test_a_workers_error_is_the_same_typed_error():
    """What a worker answers (`serve`, as the worker runs it) for a task that raises:
    the error itself, or one of its type and message where it does not pickle; the
    caller raises it (`Workers`' answer)."""
    build = Faulty(plan_cli.builder(catalog.get("tiny"), 8, 32))
    tasks, answers = queue.Queue(), queue.Queue()
    dots = functools.partial(build, Settings("dots", "bfloat16", "full", 1))
    for i, task in enumerate([dots, unpicklable_error]):
        tasks.put((i, pickle.dumps(task)))
    tasks.put(None)
    joint_jobs.serve(tasks, answers)
    (i, ok, data), (j, ok2, data2) = answers.get(), answers.get()
    assert (i, ok, j, ok2) == (0, False, 1, False)
    error, error2 = pickle.loads(data), pickle.loads(data2)
    assert type(error) is ShapeError and "faulty build: no program for remat=dots" in str(error)
    assert type(error2) is LayoutError and str(error2) == "no layout fits"


def test_ctrl_c_ends_plan_in_one_line_status_130_and_its_workers(capfd, monkeypatch, moe5):
    """SIGINT reaches the workers too (the terminal's process group): they ignore it,
    the command ends at its KeyboardInterrupt in one line and ends them."""
    seen = []
    need = joint_jobs.Workers.need

    def ctrl_c(self, item):
        need(self, item)  # the first group's answer: the workers are running
        for p in self.procs:
            os.kill(p.pid, signal.SIGINT)
        time.sleep(0.5)
        seen.extend(self.procs)
        assert all(p.is_alive() for p in self.procs)
        raise KeyboardInterrupt

    monkeypatch.setattr(joint_jobs.Workers, "need", ctrl_c)
    status = plan_cli.main([*FLAGS, "--jobs", "2"], prog="namedmesh plan")
    out, err = capfd.readouterr()
    assert status == 130 and out == ""
    assert err == "namedmesh plan: error: stopped by SIGINT (Ctrl-C) before it finished\n"
    assert len(seen) == 2 and all(p.exitcode is not None for p in seen)


def test_bad_jobs_is_a_typed_error():
    from namedmesh.errors import ParameterError

    with pytest.raises(ParameterError, match="jobs must be an int >= 1, got 0"):
        joint_search(None, [Mesh({"data": 2}, devices="abstract")], parse("h100"),
                     [Settings()], jobs=0)  # fmt: skip


def test_a_group_is_handed_out_after_the_group_it_waits_on_is_answered(monkeypatch):
    """`Workers(after=...)` (a seeded group waits on its lead's): held back until that
    answer, a later group that waits on nothing going first meanwhile; `need` waits for
    the lead's answer, then hands the group out. No processes: the hand-out and the
    answers are recorded (oldest handed out answered first)."""
    handed, answered = [], []

    def hand_out(self, g):
        self.handed.add(g)
        handed.append(g)

    def receive(self):
        g = next(g for g in handed if g not in self.answered)
        self.answered.add(g)
        answered.append(g)

    monkeypatch.setattr(joint_jobs.Workers, "_hand_out", hand_out)
    monkeypatch.setattr(joint_jobs.Workers, "_receive", receive)
    workers = joint_jobs.Workers(2, [["lead"], ["seeded"], ["other"]], None, lambda item: True,
                                 None, after={1: 0})  # fmt: skip
    try:
        assert handed == [0, 2]  # "seeded" waits for the lead's answer; "other" goes first
        workers.need("seeded")
        assert handed == [0, 2, 1] and answered == [0, 2, 1]
    finally:
        workers.close()
