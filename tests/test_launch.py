"""`namedmesh launch`: a training run as several processes (jax.distributed on
127.0.0.1, CPU devices, gloo) equals the same run in one process (losses to 1e-6), logs
each step once and writes its files from process 0 alone; a peer killed (SIGKILL) or
frozen (SIGSTOP) ends the run within 30 s with status 75 and the last checkpoint
intact, from which one process resumes exactly; processes started with different flags
stop together naming the flag. The oracle is an uninterrupted one-process run.

Every subprocess has a timeout; a launch's processes die with it (PR_SET_PDEATHSIG)."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from models.cli import cluster, launch
from models.cli.train import parser
from models.training import watchdog

ROOT = Path(__file__).resolve().parents[1]
# long enough to stop a process mid-run (4 steps and a save after STOP_AT), short for a
# tiny model: each save of a multi-process run is a barrier and a write (12 had one more)
STEPS = 9
TRAIN = [
    "train", "--config", "tiny", "--length", "16", "--batch", "8", "--quiet",
    "--eval-batches", "1", "--eval-every", "1000", "--save-every", "3", "--mesh", "data=4",
    "--steps", str(STEPS),
]  # fmt: skip
FAULT_S = 30  # a lost peer ends the run within this
STOP_AT = 5  # steps logged when process 1 gets the signal (a checkpoint at step 3 saved)


def env(devices: int | None = None) -> dict:
    out = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    # conftest's compile options (as the in-process reference's), not its device count:
    # launch sets each process's
    kept = [f for f in out.pop("XLA_FLAGS", "").split() if "device_count" not in f]
    if devices:
        kept.append(f"--xla_force_host_platform_device_count={devices}")
    out["XLA_FLAGS"] = " ".join(kept)
    return {**out, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


def namedmesh(*args, timeout=240, devices=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "namedmesh", *args], cwd=ROOT, env=env(devices),
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def assert_losses_equal(got: list[dict], want: list[dict], log: str = "") -> None:
    steps = [r["step"] for r in got]  # each step once (not once per process), in order
    assert steps == list(range(1, len(got) + 1)), f"steps logged {steps}\n{log[-3000:]}"
    for g, w in zip(got, want, strict=False):
        assert abs(g["loss"] - w["loss"]) <= 1e-6, (g["step"], g["loss"], w["loss"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The uninterrupted run: one process (this one, its simulated devices)."""
    from models.cli.train import main

    out = tmp_path_factory.mktemp("one") / "run"
    assert main([*TRAIN[1:], "--out", str(out)]) == 0
    got = records(out)
    assert len(got) == STEPS
    return got


def run_and_stop(tmp_path: Path, n: int, signum: int, *flags: str):
    """Launch n processes (4 devices in all), send `signum` to process 1 once STOP_AT
    steps are logged; (launch's status, seconds from the signal to its end, output)."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "namedmesh", "launch", "-n", str(n), "--devices-per-process",
         str(4 // n), "--grace", "2", "--", *TRAIN, "--out", str(out), *flags],
        cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            logged = (out / "metrics.jsonl").read_text() if (out / "metrics.jsonl").exists() else ""
            if logged.count("\n") >= STOP_AT and (out / "checkpoints" / "3").is_dir():
                break  # step 3's checkpoint complete (orbax renames it when it is)
            time.sleep(0.01)
        text = "".join(lines)
        assert proc.poll() is None, f"the run ended before the signal\n{text[-3000:]}"
        pid = int(re.search(r"launch: process 1 is pid (\d+)", text)[1])
        os.kill(pid, signum)
        sent = time.monotonic()
        code = proc.wait(timeout=FAULT_S + 30)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=5)
    return code, elapsed, "".join(lines), out


def test_four_processes_equal_one_write_once_and_a_frozen_peer_ends_them_75(reference, tmp_path):
    """4 processes x 1 device; process 1 frozen (SIGSTOP): the others' watchdog."""
    board = tmp_path / "tb"
    code, elapsed, log, out = run_and_stop(
        tmp_path, 4, signal.SIGSTOP, "--step-timeout", "6", "--tensorboard", str(board)
    )
    assert code == 75, log[-4000:]
    assert elapsed < FAULT_S, f"{elapsed:.1f} s\n{log[-3000:]}"
    # a survivor's watchdog (whichever comes first: the launcher then ends the others)
    assert re.search(r"\[[023]\] watchdog: step \d+('s \w+)? did not end in time", log), log[-3000:]
    assert "launch: process 1 did not end within --grace" in log, log[-3000:]
    logged = records(out)
    assert len(logged) >= STOP_AT
    assert_losses_equal(logged, reference, log)
    assert (out / "run.json").exists() and (out / "loss.png").exists()
    assert len(list(board.iterdir())) == 1  # one events file, process 0's
    # one voice: the run's lines come from process 0 only, with its rank before them
    assert "[0] 4 processes x 1 cpu devices; global mesh Mesh(data=4)" in log
    said = [line for line in log.splitlines() if "lowering report" in line or "model lm" in line]
    assert {line[:4] for line in said} == {"[0] "}, log[-3000:]
    # resumed by 2 processes x 2 devices past a torn log line: exact, and warned of once
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "lo')
    r = subprocess.run(
        [sys.executable, "-m", "namedmesh", "launch", "-n", "2", "--devices-per-process", "2",
         "--", *TRAIN, "--out", str(out), "--resume"],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    both = r.stdout + r.stderr
    warned = [line for line in both.splitlines() if "dropped a torn last line" in line]
    assert len(warned) == 1 and warned[0].startswith("[0] "), both[-3000:]
    assert_losses_equal(records(out), reference, both)
    assert len(records(out)) == STEPS


def test_a_killed_peer_ends_the_run_75_and_one_process_resumes_exactly(reference, tmp_path):
    """2 processes x 2 devices; process 1 killed (SIGKILL); the run resumed by one."""
    code, elapsed, log, out = run_and_stop(tmp_path, 2, signal.SIGKILL)
    assert code == 75, log[-4000:]
    assert elapsed < FAULT_S, f"{elapsed:.1f} s\n{log[-3000:]}"
    assert_losses_equal(records(out), reference, log)  # 2 processes equal 1, step by step
    # the last checkpoint verifies: one process (the mesh's 4 devices its own) resumes
    r = namedmesh(*TRAIN, "--out", str(out), "--resume", devices=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step" in r.stdout, r.stdout[-2000:]
    assert len(records(out)) == STEPS
    assert_losses_equal(records(out), reference)


def test_processes_with_different_flags_stop_naming_the_flag(tmp_path):
    """Issue 41: before, --save-every 2 and 3 agreed, trained, and hung at step 2."""
    port = launch.free_port()
    join = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id"]
    flags = [*TRAIN[:-4], "--steps", "4", "--mesh", "data=2", "--out", str(tmp_path / "run")]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "namedmesh", *flags, "--save-every", str(2 + i), *join, str(i)],
            cwd=ROOT,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 2, log[-3000:]
        assert f"process {i}: the run's processes were not started alike" in log, log[-3000:]
        assert "--save-every differs on process(es) [1]" in log, log[-3000:]
        assert "--steps differs" not in log and "--process-id" not in log, log[-3000:]


def test_agreement_covers_every_flag_of_the_parser():
    p = parser()
    dests = {a.dest for a in p._actions if a.dest != "help"}  # noqa: SLF001 (argparse's)
    named = {k.removeprefix("--").replace("-", "_") for k in cluster.flags(p.parse_args([]))}
    assert named == dests - set(cluster.PER_PROCESS)
    assert {"save_every", "steps", "eval_every", "eval_batches", "skip_nonfinite"} <= named


@pytest.mark.parametrize(
    "ends, status",
    [
        ([(0, 0), (1, 0)], 0),
        ([(1, -9), (0, 75)], 75),  # killed, its peer's watchdog
        ([(0, 75), (1, -9)], 75),  # watchdog first, then the stopped one killed
        ([(1, -6), (0, 0)], 75),  # jax's abort (SIGABRT) on a lost peer
        ([(0, 134)], 75),  # the same through a shell
        ([(1, 2), (0, -9)], 2),  # a bad flag on one process decides
        ([(0, 0), (1, 3), (2, 75)], 3),
    ],
)
def test_launch_status(ends, status):
    assert launch.outcome(ends) == status


@pytest.mark.parametrize(
    "argv, names",
    [
        (["-n", "2", "train"], "after --"),
        (["-n", "0", "--", "train"], "-n 0"),
        (["-n", "2", "--", "bench"], "'bench'"),
        (["-n", "2", "--", "train", "--process-id=1"], "--process-id"),
        (["-n", "2", "--devices-per-process", "0", "--", "train"], "--devices-per-process 0"),
    ],
)
def test_launch_bad_flags_exit_2_naming_them(argv, names, capsys):
    with pytest.raises(SystemExit) as e:
        launch.main(argv, prog="namedmesh launch")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert names in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--num-processes", "2"], "--coordinator, --process-id missing"),
        (["--coordinator", "h:1", "--num-processes", "0", "--process-id", "0"], "processes 0"),
        (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], "process-id 2"),
        (["--coordinator", "auto", "--process-id", "1"], "auto"),
    ],
)
def test_cluster_flags_that_do_not_go_together(argv, names):
    with pytest.raises(cluster.ClusterError, match=re.escape(names)):
        cluster.plan(parser().parse_args(argv))


def test_cluster_flags_and_environment(monkeypatch):
    for k in ("JAX_COORDINATOR_ADDRESS", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert cluster.plan(parser().parse_args([])) is None  # one process
    flags = ["--coordinator", "10.0.0.1:1234", "--num-processes", "4", "--process-id", "3"]
    assert cluster.plan(parser().parse_args(flags)) == ("10.0.0.1:1234", 4, 3)
    monkeypatch.setenv("SLURM_NTASKS", "4")  # a batch script's: still one process
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert cluster.plan(parser().parse_args([])) is None
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")  # srun's job step of 4 tasks
    monkeypatch.setenv("SLURM_PROCID", "2")
    assert cluster.plan(parser().parse_args([])) == (None, None, None)  # jax reads it
    assert cluster.rank(parser().parse_args([])) == 2


def test_step_limit_from_measured_steps():
    assert watchdog.step_limit([]) == watchdog.COMPILE_S
    assert watchdog.step_limit([0.01, 0.02]) == watchdog.FLOOR_S
    assert watchdog.step_limit([0.5, 3.0, 1.0]) == pytest.approx(3.0 * watchdog.FACTOR)
    dog = watchdog.Watchdog(step_timeout=4.0, enabled=False)
    assert dog.step_limit() == watchdog.COMPILE_S  # the first step compiles
    dog.step_done(100.0, compiled=True)
    dog.step_done(0.1)
    assert dog.step_limit() == 4.0


def test_watchdog_exits_75_with_one_line():
    code = (
        "import time; from models.training.watchdog import Watchdog\n"
        "with Watchdog() as dog:\n"
        "    dog.expect(0.2, 'step 7'); time.sleep(30)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 75, r.stderr
    assert r.stderr.startswith("watchdog: step 7 did not end in time"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize(
    "command, argv",
    [
        ("models.cli.train", []),
        ("models.cli.evaluate", ["runs/x", "--data", "x.txt"]),
        ("models.cli.generate", ["runs/x"]),
        ("models.cli.export", ["runs/x", "--out", "hf/x"]),
    ],
)
def test_every_subcommand_takes_the_joining_flags(command, argv, capsys):
    """A half-given set is one line and status 2, before anything is read or joined."""
    import importlib

    main = importlib.import_module(command).main
    assert main([*argv, "--num-processes", "2", "--process-id", "1"], prog="namedmesh x") == 2
    err = capsys.readouterr().err
    assert err.startswith("namedmesh x: error: --coordinator, --num-processes and --process-id")
    assert "--coordinator missing" in err and len(err.strip().splitlines()) == 1, err
