"""Several processes of one run under faults (127.0.0.1, CPU devices, gloo): each case
ends in bounded time with one line naming what is at fault and a typed status, never a
traceback or a hang. The oracles are the faults themselves (the port held, the counts
given) and, for the runs, an uninterrupted run (tests/test_launch.py's one-process
reference holds for the others).

Every subprocess has a timeout; the processes a case starts are started together, so
their jax imports overlap."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from models.cli import cluster, launch
from tests.test_launch import env as launch_env

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120  # a case's processes, start to end (some 10 s each when nothing is wrong)
TRAIN = [
    "train", "--config", "tiny", "--length", "16", "--batch", "8", "--quiet",
    "--eval-batches", "1", "--eval-every", "1000", "--steps", "2",
]  # fmt: skip


def env(devices: int | None = None) -> dict:
    """test_launch's environment, with this checkout first on PYTHONPATH (a process run
    from another folder imports this code)."""
    out = launch_env(devices)
    return {**out, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), out.get("PYTHONPATH")]))}


def start(args: list[str], devices: int | None = None, cwd: Path = ROOT) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "namedmesh", *args], cwd=cwd, env=env(devices),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def ends(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    """(status, stdout, stderr) of each process; those still running at the timeout are
    killed (the case then fails on their status)."""
    out = []
    try:
        for p in procs:
            try:
                o, e = p.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                o, e = p.communicate()
                e += "\n(killed at the test's timeout)"
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def distinct_ports() -> tuple[int, int]:
    """Two ports free now, unlike each other (launch.free_port twice may give one twice)."""
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        return a.getsockname()[1], b.getsockname()[1]


def joined(port: int, n: int, i: int) -> list[str]:
    return ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i)]


def assert_one_line(status: int, err: str, *names: str) -> None:
    lines = [x for x in err.splitlines() if "error:" in x]
    assert status == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert len(lines) == 1 and all(n in lines[0] for n in names), err[-3000:]


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, list[tuple[int, str, str]]]:
    """Processes started wrongly, all at once (their imports overlap): case -> the
    (status, stdout, stderr) of each of its processes. A port held by another server;
    processes holding 2 and 3 devices of a mesh of 4; `--data corpus.txt` read from two
    working directories (two hosts' disks) holding other texts."""
    tmp = tmp_path_factory.mktemp("refused")
    out = str(tmp / "run")
    cases: dict[str, list[subprocess.Popen]] = {}
    with socket.socket() as held:  # someone else's server on the port
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cases["port"] = [start([*TRAIN, "--mesh", "data=2", "--out", out, *joined(port, 2, 0)])]
        other, another = distinct_ports()
        cases["uneven"] = [
            start(
                [*TRAIN, "--mesh", "data=4", "--out", out + "4", *joined(other, 2, i)],
                devices=2 + i,
            )
            for i in range(2)
        ]
        cases["data"] = []
        for i, text in enumerate(["one path, one text. " * 40, "one path, another. " * 40]):
            (tmp / f"host{i}").mkdir()
            (tmp / f"host{i}" / "corpus.txt").write_text(text)
            flags = [*TRAIN, "--mesh", "data=2", "--data", "corpus.txt", "--out", out]
            cases["data"].append(
                start([*flags, *joined(another, 2, i)], devices=1, cwd=tmp / f"host{i}")
            )
        return {k: ends(v) for k, v in cases.items()} | {"port number": port}


def test_a_coordinator_port_in_use_is_one_line(refused):
    """Before: process 0 ended 1 with jax's traceback (its peers waited 300 s for it)."""
    ((status, _, err),) = refused["port"]
    port = refused["port number"]
    assert_one_line(status, err, f"coordinator service at 127.0.0.1:{port}", "in use")


def test_processes_holding_uneven_device_counts_stop_naming_them(refused):
    """Before: processes holding 2 and 3 devices built a mesh over the first 4 and ended 1
    with a reshape traceback in the agreement."""
    for status, _, err in refused["uneven"]:
        assert_one_line(status, err, "--mesh of 4 devices", "process 0: 2, process 1: 3")


def test_processes_reading_other_data_at_the_same_path_stop_naming_the_flag(refused):
    """Before: the flags being equal, they agreed, and each process trained on other
    data's rows: silently, to status 0."""
    for i, (status, _, err) in enumerate(refused["data"]):
        assert_one_line(status, err, f"process {i}:", "--data differs on process(es) [1]")
        assert "--val-data" not in err and "--out" not in err, err[-3000:]


def test_launch_gives_each_process_its_share_not_an_inherited_device_count(monkeypatch):
    """Before: an XLA_FLAGS device count in the launcher's environment (8, conftest's)
    went to every process, whose mesh of 4 then lay on process 0's devices alone."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_x=1")
    assert launch.environment(None)["XLA_FLAGS"] == "--xla_x=1"
    want = "--xla_x=1 --xla_force_host_platform_device_count=2"
    assert launch.environment(2)["XLA_FLAGS"] == want
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert "XLA_FLAGS" not in launch.environment(None)


def test_one_process_holding_more_devices_than_the_mesh_is_refused():
    """jax.devices() here: 8 on process 0 (conftest); a mesh of 4 would leave 4 out."""
    cluster.check_devices(8)
    with pytest.raises(cluster.ClusterError, match=re.escape("needs 4 devices on each")):
        cluster.check_devices(4)


def test_launch_status_is_a_failing_process_s_own_not_its_lost_peer_s():
    """Before: the first non-zero status decided, and a peer's 75 (its collective failing
    as process 1 went, or its watchdog) ending before process 1's own 2 made the run
    "resume me" for a run that a bad input ended: a scheduler retried it forever."""
    assert launch.outcome([(0, 75), (1, 2)]) == 2
    assert launch.outcome([(0, -6), (2, 0), (1, 74)]) == 74
    assert launch.outcome([(1, -9), (0, 75)]) == 75
    run = launch.Launch(2, None, ["train"], grace=5)
    run.procs = [subprocess.Popen(["sh", "-c", s]) for s in ("exit 75", "sleep 0.3; exit 2")]
    assert run.wait() == 2
    run = launch.Launch(2, None, ["train"], grace=0.2)  # a hung peer: killed, said
    run.procs = [subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sh", "-c", "exit 3"])]
    start = time.monotonic()
    assert run.wait() == 3 and time.monotonic() - start < 5
    assert run.procs[0].returncode == -signal.SIGKILL


def test_a_peer_killed_mid_save_is_a_lost_peer_not_a_full_disk(tmp_path):
    """Process 1 SIGKILLed while step 2's checkpoint is being written (orbax's temporary
    folder there). Before: the survivor's save failed in a gather with "Connection reset
    by peer", which it took for a full disk: status 74, "free space", and a scheduler
    that resumes on 75 stopped. Now 75, naming a lost peer, and no step 2 listed."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "namedmesh", "launch", "-n", "2", "--devices-per-process", "2",
         "--grace", "10", "--", *TRAIN, "--save-every", "2", "--mesh", "data=4", "--out", str(out)],
        cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    first = proc.stderr.readline() + proc.stderr.readline()  # launch: process I is pid P
    saving = lambda: any(p.name.startswith("2.orbax-checkpoint-tmp") for p in out.glob("*/*"))
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not saving() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert saving(), f"no save of step 2 was seen in progress\n{first}"
        os.kill(int(re.search(r"process 1 is pid (\d+)", first)[1]), signal.SIGKILL)
        err = first + proc.communicate(timeout=TIMEOUT_S)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    from models.training import checkpoint

    if checkpoint.all_steps(out) == [2]:  # a busy host: the save ended before the kill came
        pytest.skip("process 1 was killed after step 2's save had ended")
    assert checkpoint.all_steps(out) == [], list(out.glob("*/*"))
    assert proc.returncode == 75, err[-3000:]
    # the survivor: the save's gather fails at once ("Connection reset by peer"), or, when
    # it waits in a barrier of jax's service instead, jax aborts it (134) or the launcher
    # kills it after --grace: either way never a full disk
    said = [line for line in err.splitlines() if line.startswith("[0] namedmesh train: error:")]
    assert len(said) <= 1 and all("a peer process is lost" in x for x in said), err[-3000:]


def test_a_closed_output_never_blocks_a_process(tmp_path):
    """`launch ... | head`: before, the copying thread died at the first write to the
    closed pipe (a traceback), and a process printing 64 KiB more blocked for good."""

    class Closed:
        def write(self, data):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    code = "import sys\nfor i in range(4000): print('x' * 99)\nsys.stderr.write('done')"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        launch.pump(proc.stdout, Closed(), b"[0] ")  # 400 KB read on to the end
        assert proc.wait(timeout=TIMEOUT_S) == 0 and proc.stderr.read() == b"done"
    finally:
        proc.kill()
        proc.wait()
    got = tmp_path / "got"
    with open(got, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", "print('a\\rb')"], stdout=subprocess.PIPE)
        launch.pump(proc.stdout, out, b"[1] ")
    assert proc.wait(timeout=TIMEOUT_S) == 0 and got.read_bytes() == b"[1] a\r[1] b\n"


def test_initialize_checks_the_coordinator_port_before_jax_serves_it():
    """jax's service on a port another program holds ended process 0 by a segmentation
    fault at times (status -11), not an error; the port is tried first."""
    from lowering import distributed
    from namedmesh.errors import MeshError

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(MeshError, match=f"127.0.0.1:{port}: the port is in use"):
            distributed.initialize(f"127.0.0.1:{port}", 2, 0)


def test_a_restore_that_fails_as_a_peer_goes_is_a_lost_peer_not_a_damaged_checkpoint(
    tmp_path, monkeypatch
):
    """orbax's restore ends in a barrier of every process: a peer gone there is jax's
    runtime error. Before, every error of a read was a damaged checkpoint: --resume fell
    back past sound steps and ended 2 ("no checkpoint verifies"), where it is 75.
    (Damaged files raise other types: a missing shard of 2 processes, ValueError.)"""
    import jax
    import orbax.checkpoint as ocp

    from models.training import checkpoint

    class Manager:  # orbax's, whose restore meets a barrier a peer left
        def __init__(self, *args, **kwargs):
            pass

        def restore(self, *args, **kwargs):
            raise self.error

    monkeypatch.setattr(ocp, "CheckpointManager", Manager)
    Manager.error = ValueError("Encountered error while reading array index")
    with pytest.raises(checkpoint.DamagedCheckpointError, match="step 2"):
        checkpoint.read_meta(tmp_path, 2)
    Manager.error = jax.errors.JaxRuntimeError("UNAVAILABLE: barrier: a task is gone")
    with pytest.raises(checkpoint.DamagedCheckpointError):  # one process: no peer to lose
        checkpoint.read_meta(tmp_path, 2)
    monkeypatch.setattr(jax, "process_count", lambda *args: 2)
    with pytest.raises(jax.errors.JaxRuntimeError, match="a task is gone"):
        checkpoint.read_meta(tmp_path, 2)


def test_a_damaged_step_moved_aside_by_a_peer_first_is_no_error(tmp_path, monkeypatch):
    """Every process of a run moves a damaged step to damaged/ once it restores an older
    one. Before, the one that came second met the first's move (a FileNotFoundError:
    status 2, its peers lost) where the step was gone between its check and its move."""
    import orbax.checkpoint as ocp

    from models.training import checkpoint

    class Manager:  # orbax's, listing steps 6 and 4
        def __init__(self, *args, **kwargs):
            pass

        def all_steps(self):
            return [4, 6]

    def restore(directory, target, step):
        if step == 6:
            raise checkpoint.DamagedCheckpointError("step 6 is damaged")
        return target, {"step": step}

    rename = os.rename

    def peer_first(src, dst):  # the peer's move lands between this one's look and move
        rename(src, dst)
        rename(src, dst)

    (tmp_path / "checkpoints" / "6").mkdir(parents=True)
    monkeypatch.setattr(ocp, "CheckpointManager", Manager)
    monkeypatch.setattr(checkpoint, "restore", restore)
    monkeypatch.setattr(os, "rename", peer_first)
    said = []
    assert checkpoint.restore_newest(tmp_path, "state", say=said.append) == ("state", {"step": 4})
    assert (tmp_path / "damaged" / "6").is_dir() and not (tmp_path / "checkpoints" / "6").exists()
    assert said[-1] == "resuming from step 4, the newest checkpoint that verifies"


def test_the_launcher_s_terminal_closing_makes_the_processes_save(tmp_path):
    """SIGHUP to the launcher (its terminal closed, an ssh session lost): before, it
    ended the launcher and, by PR_SET_PDEATHSIG, every process with nothing saved; now
    each process gets SIGTERM, on which a run saves and exits 75 (here: a shell that
    does so, and would end -1 on SIGHUP itself)."""
    saver = "trap 'exit 75' TERM; touch {}; while :; do sleep 0.05; done"
    run = launch.Launch(2, None, ["train"], grace=5)
    marks = [tmp_path / f"up{i}" for i in range(2)]
    run.procs = [subprocess.Popen(["sh", "-c", saver.format(m)]) for m in marks]
    before = signal.getsignal(signal.SIGHUP)
    restore = run.forwarding()
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not all(m.exists() for m in marks) and time.monotonic() < deadline:
            time.sleep(0.01)  # both shells' traps set
        os.kill(os.getpid(), signal.SIGHUP)
        assert run.wait() == 75
        assert [p.returncode for p in run.procs] == [75, 75]
    finally:
        restore()
        for p in run.procs:
            p.kill()
            p.wait()
    assert signal.getsignal(signal.SIGHUP) == before
