"""`namedmesh launch -n N [--devices-per-process K] -- COMMAND [flags]`: run a subcommand
(train, eval, generate, export) as N processes of one run on this machine.

    namedmesh launch -n 2 --devices-per-process 2 -- train --mesh data=4 --out runs/two

Each process is `namedmesh COMMAND [flags] --coordinator 127.0.0.1:PORT --num-processes
N --process-id I` (a free port), with K simulated CPU devices when K is given (XLA's
host device count; otherwise the command picks its share of --mesh). Every line a
process prints comes out prefixed with its rank, `[I] `. SIGINT and SIGTERM are passed
on to every process (which then save and exit 75 together), and so is SIGHUP (the
launcher's terminal closed), as SIGTERM. When one process ends
badly, the others get --grace seconds to end, then are killed.

Exit status: 0 when every process ended with 0; else the first status of a process's
own (2, 3, 74, ...: the failure that ended its peers); else 75 when processes were lost
(killed by a signal: SIGKILL, jax's abort on a lost peer, SIGABRT) or ended by the
watchdog or a preemption (75): "resume me", run the same command with --resume; 2 for
bad flags of launch itself.
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

EXIT_LOST = (
    75  # models.training.watchdog.EXIT_LOST, models.training.run.EXIT_PREEMPTED (jax not imported)
)
EXIT_USAGE = 2
COMMANDS = ("train", "eval", "generate", "export")  # namedmesh.cli's that join a cluster
JOIN_FLAGS = ("--coordinator", "--num-processes", "--process-id")
GRACE_S = 5.0
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # passed on to every process


class LaunchError(ValueError):
    """Flags of `launch` that cannot work (one line, exit status 2)."""


def arguments(argv: list[str], prog: str) -> tuple[argparse.Namespace, list[str]]:
    """(launch's flags, the command after `--`)."""
    from models.cli.train_flags import Parser

    p = Parser(
        prog=prog,
        usage="%(prog)s -n N [--devices-per-process K] [--grace S] -- COMMAND [flags]",
        description="Run COMMAND (train, eval, generate, export) as N processes of one run "
        "on this machine; each output line is prefixed with its process's rank.",
        epilog="exit status: 0 every process ended with 0; 75 a process was lost (killed by "
        "a signal, or ended 75: the watchdog, preemption) and none failed otherwise: run "
        "again with --resume; else the first other non-zero status; 2 a bad flag of launch",
    )
    p.add_argument("-n", "--processes", type=int, required=True, help="processes to start")
    p.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="K",
        help="simulated CPU devices of each process (None: the command's share of --mesh)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=GRACE_S,
        metavar="S",
        help="seconds the others may take to end after one process ended badly",
    )
    if "--" not in argv:
        if {"-h", "--help"} & set(argv):
            p.parse_args(argv)
        p.error(f"put the command after --, e.g. {prog} -n 2 -- train --mesh data=2")
    cut = argv.index("--")
    args, command = p.parse_args(argv[:cut]), argv[cut + 1 :]
    if args.processes < 1:
        p.error(f"-n {args.processes}: must be >= 1")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        p.error(f"--devices-per-process {args.devices_per_process}: must be >= 1")
    if not 0 <= args.grace < math.inf:  # inf: a hung peer would hang the launch forever
        p.error(f"--grace {args.grace}: must be a finite number >= 0")
    if not command or command[0] not in COMMANDS:
        got = repr(command[0]) if command else "nothing"
        p.error(f"the command after -- must be one of {', '.join(COMMANDS)}; got {got}")
    given = [f for f in JOIN_FLAGS if any(a == f or a.startswith(f + "=") for a in command)]
    if given:
        p.error(f"{given[0]} is launch's to set: leave it out of the command")
    return args, command


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the coordinator's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(devices: int | None) -> dict[str, str]:
    """The processes' environment: this one's, unbuffered, without proxy settings, with
    `devices` simulated CPU devices each when given; else without a device count of this
    one's XLA_FLAGS, so that each process simulates its share of --mesh (an inherited
    count, the same for every process, would be the whole mesh's or another's)."""
    # the coordinator is local: a proxy setting could only hang jax's connection to it
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["PYTHONUNBUFFERED"] = "1"
    kept = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    if devices is not None:
        kept.append(f"--xla_force_host_platform_device_count={devices}")
        env["JAX_PLATFORMS"] = "cpu"
    if kept:
        env["XLA_FLAGS"] = " ".join(kept)
    else:
        env.pop("XLA_FLAGS", None)
    return env


def _die_with_parent() -> None:
    """In the child, before exec: be killed when the launcher dies (Linux), so no process
    of a run outlives a launcher killed by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def pump(stream, out, prefix: bytes) -> None:
    """Copy a process's output to `out`, each line (or \\r-ended progress update)
    prefixed. An `out` that cannot be written any more (a closed pipe: `launch ... |
    head`) is dropped and the output read on to its end, so that the process never
    blocks on a full pipe (hung, its peers' watchdog then ending the run)."""
    buf = b""

    def write(data: bytes) -> None:
        nonlocal out
        if out is not None:
            try:
                out.write(data)
                out.flush()
            except (OSError, ValueError):  # a closed pipe or file
                out = None

    while chunk := os.read(stream.fileno(), 65536):
        buf += chunk
        while True:
            cuts = [i for i in (buf.find(b"\n"), buf.find(b"\r")) if i >= 0]
            if not cuts:
                break
            i = min(cuts)
            write((prefix if i else b"") + buf[: i + 1])  # tqdm's bare \r: no prefix
            buf = buf[i + 1 :]
    if buf:
        write(prefix + buf + b"\n")


def outcome(ends: list[tuple[int, int]]) -> int:
    """The run's status from (rank, return code) in the order the processes ended,
    leaving out those the launcher killed: 0 when all ended with 0; else the first
    status of a process's own (a bad input's 2, a divergence's 3, a full disk's 74),
    which outranks a lost one (75, a negative code: killed by a signal, 128 + SIGABRT:
    jax's abort), as a peer of a process that failed is lost in turn, at nearly the same
    moment; 75 when every process that failed was lost."""
    failed = [code for _, code in ends if code != 0]
    own = [c for c in failed if not (c < 0 or c == EXIT_LOST or c == 128 + signal.SIGABRT)]
    return own[0] if own else EXIT_LOST if failed else 0


class Launch:
    """N processes of one command: `start()`, then `wait()` for the run's status."""

    def __init__(self, n: int, devices: int | None, command: list[str], grace: float):
        self.n, self.grace, self.port = n, grace, free_port()
        self.env, self.command = environment(devices), command
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []

    def start(self) -> None:
        """Start every process, each with its threads copying its output, prefixed."""
        for i in range(self.n):
            argv = [sys.executable, "-m", "namedmesh", *self.command]
            argv += ["--coordinator", f"127.0.0.1:{self.port}"]
            argv += ["--num-processes", str(self.n), "--process-id", str(i)]
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self.env,
                start_new_session=True,  # a terminal's Ctrl-C reaches the launcher only
                preexec_fn=_die_with_parent,
            )
            self.procs.append(proc)
            print(f"launch: process {i} is pid {proc.pid}", file=sys.stderr, flush=True)
            prefix = f"[{i}] ".encode()
            for stream, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
                t = threading.Thread(target=pump, args=(stream, out, prefix), daemon=True)
                t.start()
                self.pumps.append(t)

    def forward(self, signum, frame) -> None:
        """The launcher's handler of SIGINT, SIGTERM and SIGHUP: the signal to every
        process, SIGHUP (the launcher's terminal closed) as SIGTERM, which the processes
        save on, where SIGHUP would end them with nothing saved."""
        signum = signal.SIGTERM if signum == signal.SIGHUP else signum
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)

    def forwarding(self):
        """Install `forward` for SIGINT, SIGTERM and SIGHUP; the function that puts the
        previous handlers back."""
        old = {s: signal.signal(s, self.forward) for s in FORWARDED}
        return lambda: [signal.signal(s, h) for s, h in old.items()] and None

    def wait(self) -> int:
        """Wait for every process; the run's status (`outcome`) from their ends in the
        order they ended (a thread waits on each: a poll of all every few ms would see
        two close ends at once and order them by rank, and a peer's 75 would hide the
        status of the process whose failure ended it)."""
        ended = queue.SimpleQueue()  # (rank, code), as each process ends
        for i, p in enumerate(self.procs):
            threading.Thread(target=lambda i=i, p=p: ended.put((i, p.wait())), daemon=True).start()
        ends: list[tuple[int, int]] = []
        deadline = math.inf  # set when a process ended badly: the others' time to end
        while len(ends) < len(self.procs):
            try:
                i, code = ended.get(timeout=max(0.0, min(deadline - time.monotonic(), 1.0)))
            except queue.Empty:
                if time.monotonic() > deadline:
                    self.kill_the_rest({i for i, _ in ends})
                    break
                continue
            ends.append((i, code))
            if code != 0 and deadline == math.inf:
                deadline = time.monotonic() + self.grace
        for t in self.pumps:
            t.join(timeout=5)
        return outcome(ends)

    def kill_the_rest(self, done: set[int]) -> None:
        """SIGKILL (which ends a stopped, SIGSTOP, process too) to every process not in
        `done`, each said in one line."""
        for i, p in enumerate(self.procs):
            if i not in done:
                p.kill()
                p.wait()
                print(f"launch: process {i} did not end within --grace {self.grace:g} s "
                      "of its peer: killed", file=sys.stderr, flush=True)  # fmt: skip


def main(argv=None, prog: str = "python -m models.cli.launch") -> int:
    """`namedmesh launch`: the run's exit status (module docstring)."""
    args, command = arguments(list(sys.argv[1:] if argv is None else argv), prog)
    launch = Launch(args.processes, args.devices_per_process, command, args.grace)
    restore = launch.forwarding()
    try:
        launch.start()
        return launch.wait()
    finally:
        restore()
        for p in launch.procs:
            if p.poll() is None:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
