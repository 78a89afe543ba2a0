"""Processes of one run compare their run before anything compiles (models/training/agree.py):
two processes on 127.0.0.1 (jax.distributed) agree when started alike and both fail,
within a bounded time and naming the part, when started with different layouts
(before, such a pair hung forever inside the training step). In between, a SIGTERM to
one of them makes both stop at the same step (models/training/preempt.py)."""

import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from models.training import agree

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from test_distributed import free_port, worker_env  # noqa: E402

WORKER = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ["JAX_PLATFORMS"] = "cpu"
from lowering import distributed
port, pid, layout = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
distributed.initialize(f"127.0.0.1:{port}", 2, pid, timeout_s=30, heartbeat_timeout_s=5)
from models.training import agree
parts = dict(config={"d_model": 64}, mesh={"data": 2}, inputs=[[["batch"], [8]]], step=[])
agree.check(**parts, layout="batch:data")
print("agreed on equal parts", flush=True)
import signal, time
from models.training.preempt import Preemption
with Preemption() as p:  # SIGTERM to process 0 alone: both stop at the same step
    first = p.should_stop()
    if pid == 0:
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    print(f"should stop: {first} then {p.should_stop()}", flush=True)
try:
    agree.check(**parts, layout=layout)
except agree.AgreementError as e:
    print(f"AgreementError: {e}", flush=True)
    sys.exit(2)
print("agreed", flush=True)
"""


def test_processes_with_different_layouts_fail_together_in_bounded_time(tmp_path):
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(port), str(i), layout],
            cwd=ROOT,
            env=worker_env(),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for i, layout in enumerate(["batch:data", "d_model:data"])
    ]
    start = time.monotonic()
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert time.monotonic() - start < 120
    for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 2, log
        assert "agreed on equal parts" in log, log
        assert "should stop: False then True" in log, log
        assert f"AgreementError: process {i}:" in log, log
        assert "layout differs on process(es) [1]" in log and "config" not in log, log


def test_differing_names_each_part_and_the_processes_that_differ():
    a, b = agree.digest({"x": 1}), agree.digest({"x": 2})
    hashes = np.stack([np.stack([a, a]), np.stack([a, b]), np.stack([b, a])])
    assert agree.differing(hashes, ["mesh", "layout"]) == {"mesh": [2], "layout": [1]}
    assert agree.differing(hashes[:1], ["mesh", "layout"]) == {}
