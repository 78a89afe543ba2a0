"""Joining the processes of one run: the flags every subcommand takes, `add_flags`, and
`join`, which connects this process to the others (`lowering.distributed.initialize`,
i.e. `jax.distributed.initialize`) before jax starts its backend.

    namedmesh train --coordinator 10.0.0.1:1234 --num-processes 4 --process-id $RANK ...
    namedmesh train --coordinator auto ...   # SLURM, Open MPI, a TPU VM slice, Kubernetes

Without the flags a process joins only where the environment names a cluster of more
than one process (JAX_COORDINATOR_ADDRESS, srun's SLURM_STEP_NUM_TASKS, mpirun's
OMPI_COMM_WORLD_SIZE): jax then reads the three values from it, as
`jax.distributed.initialize()` does. Otherwise the run is one process. See
docs/distributed.md.
"""

from __future__ import annotations

import argparse
import os
import sys

from namedmesh.errors import NamedMeshError

# Flags that differ between the processes of one run: agreement leaves them out.
# what each process has of its own: its id, and which flags its command line named
# (models.cli.train_flags.explicit: processes may be started with the same settings told
# apart) and which its --config-file named
PER_PROCESS = ("process_id", "given", "filed")
JOIN_TIMEOUT_S = 300  # for every process to connect (a slow host's imports included)
# jax's service declares a silent process dead after this, and aborts the others (SIGABRT);
# longer than the step watchdog's floor, so a lost peer is usually met by the watchdog
# first (exit 75).
HEARTBEAT_S = 30


class ClusterError(NamedMeshError, ValueError):
    """Flags or environment that cannot join processes (exit status 2)."""


def add_flags(parser: argparse.ArgumentParser) -> None:
    """--coordinator, --num-processes and --process-id, in a group of their own."""
    g = parser.add_argument_group(
        "processes", "run as one of several processes (hosts); see docs/distributed.md"
    )
    g.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        default=None,
        help="process 0's address, which every process reaches; `auto`: read the cluster "
        "(SLURM, Open MPI, a TPU VM slice, Kubernetes) from the environment",
    )
    g.add_argument("--num-processes", type=int, default=None, metavar="N", help="processes")
    g.add_argument(
        "--process-id", type=int, default=None, metavar="I", help="this process, 0 ... N-1"
    )


def from_environment() -> bool:
    """Whether the environment names a cluster of more than one process."""
    env = os.environ

    def many(name: str) -> bool:
        return env.get(name, "").isdigit() and int(env[name]) > 1

    # a job step of srun's, not the batch script (which has SLURM_NTASKS of the whole job)
    slurm = many("SLURM_STEP_NUM_TASKS") and "SLURM_PROCID" in env
    return bool(env.get("JAX_COORDINATOR_ADDRESS")) or slurm or many("OMPI_COMM_WORLD_SIZE")


def plan(args) -> tuple[str | None, int | None, int | None] | None:
    """(coordinator, processes, process id) to join with (None: jax reads it), or None
    for a run of one process. ClusterError for flags that do not go together."""
    coordinator, n, pid = args.coordinator, args.num_processes, args.process_id
    if coordinator == "auto":
        if n is not None or pid is not None:
            raise ClusterError(
                "--coordinator auto reads --num-processes and --process-id from the "
                "environment: pass neither"
            )
        return None, None, None
    given = {"--coordinator": coordinator, "--num-processes": n, "--process-id": pid}
    if all(v is None for v in given.values()):
        return (None, None, None) if from_environment() else None
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ClusterError(
            f"--coordinator, --num-processes and --process-id go together: {', '.join(missing)} "
            "missing (or --coordinator auto alone)"
        )
    if n < 1:
        raise ClusterError(f"--num-processes {n}: must be >= 1")
    if not 0 <= pid < n:
        raise ClusterError(f"--process-id {pid}: must be in 0 ... {n - 1} (--num-processes {n})")
    return coordinator, n, pid


SIMULATED = 4096  # CPU devices XLA is asked to simulate, at most (each costs memory)


def simulate_devices(n: int) -> None:
    """Let XLA's CPU backend offer n devices (it must be set before jax is imported);
    a mesh larger than SIMULATED is left to real devices (Mesh says if they are too few)."""
    if n > SIMULATED:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    # XLA reads the flags when jax starts its backend (at the first device query), not at
    # `import jax`: the `namedmesh` command has imported jax already.
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def join(args, mesh_size: int | None = None, whole: bool = False) -> bool:
    """Connect this process to the run's others as the flags (or the environment) say,
    first letting a CPU host offer its share of a `mesh_size`-device mesh (simulated
    devices, `simulate_devices`; one process: the whole mesh; `whole`:
    every process the whole mesh, for a command each process runs on its own devices).
    Whether this process joined several. Call it before any other JAX call."""
    how = plan(args)
    n = 1 if how is None or whole else how[1]
    if mesh_size is not None and n is not None:
        if mesh_size % n:
            raise ClusterError(
                f"--mesh of {mesh_size} devices over --num-processes {n}: each process holds "
                "as many devices, so the mesh's size must be a multiple of the processes"
            )
        simulate_devices(mesh_size // n)
    if how is None:
        return False
    from lowering import distributed

    try:
        distributed.initialize(*how, timeout_s=JOIN_TIMEOUT_S, heartbeat_timeout_s=HEARTBEAT_S)
    except NamedMeshError as e:
        text = str(e).replace("coordinator must", "--coordinator must")
        if how[0] is None and "coordinator service" not in text:  # jax read the environment
            text = f"--coordinator auto: jax found no cluster in the environment ({e})"
        raise ClusterError(text) from None
    if mesh_size is not None and not whole:
        check_devices(mesh_size)
    return True


def check_devices(mesh_size: int) -> None:
    """ClusterError, alike on every process, unless the processes hold `mesh_size`
    devices in all, as many each: the mesh takes the first `mesh_size` of jax.devices(),
    so more would leave a process out of it and uneven shares fail in jax's gathers."""
    import jax

    held: dict[int, int] = {}
    for d in jax.devices():  # every process's devices: the same list on each
        held[d.process_index] = held.get(d.process_index, 0) + 1
    n = len(held)
    if sum(held.values()) != mesh_size or len(set(held.values())) > 1:
        said = ", ".join(f"process {i}: {k}" for i, k in sorted(held.items()))
        raise ClusterError(
            f"--mesh of {mesh_size} devices over {n} processes needs {mesh_size // n} "
            f"devices on each, but they hold {said} (set each process's count alike: "
            "launch's --devices-per-process, XLA_FLAGS' "
            "--xla_force_host_platform_device_count, JAX_LOCAL_DEVICE_IDS)"
        )


def describe(mesh=None) -> str:
    """`2 processes x 4 cpu devices; global mesh rows=2, cols=4` (after `join`)."""
    import jax

    local = jax.local_devices()
    text = f"{jax.process_count()} processes x {len(local)} {local[0].platform} devices"
    return text if mesh is None else f"{text}; global mesh {mesh}"


def say(text: str) -> None:
    """Print `text` on process 0 only: the run's one voice."""
    import jax

    if jax.process_index() == 0:
        print(text, flush=True)


# flags naming files every process reads: agreed on by their contents too
READ_FLAGS = ("data", "val_data", "tokenizer", "init_from")


def flags(args) -> dict:
    """Every flag of the parsed `args` the processes of a run must share (all of the
    parser's but PER_PROCESS), by its name (`--save-every`): what they agree on, each a
    part of its own so that a difference names the flag (models/training/agree.py). A
    flag of READ_FLAGS naming a file or folder is its path and its contents'
    fingerprint (files.fingerprint): a path that holds other data on another host, or
    from another working directory, would train each process on other rows, silently."""
    from models.io import files

    def value(k, v):
        if k in READ_FLAGS and isinstance(v, str) and os.path.exists(v):
            return [v, files.fingerprint(v)]
        return v

    return {
        "--" + k.replace("_", "-"): value(k, v)
        for k, v in sorted(vars(args).items())
        if k not in PER_PROCESS
    }


EXIT_LOST = 75  # models.training.watchdog.EXIT_LOST: a peer lost, resume from the last checkpoint


def lost_peer_errors() -> tuple[type[BaseException], ...]:
    """What a collective raises in a run of several processes when a peer is gone (its
    socket closed): jax's runtime error. None with one process, where it means a bug."""
    import jax

    return (jax.errors.JaxRuntimeError,) if jax.process_count() > 1 else ()


def ended(status: int, several: bool) -> int:
    """`status`; a process of several that fails ends here at once (`os._exit`): a
    normal exit would wait in jax's shutdown for peers that may be waiting for it in a
    collective, and report nothing while they time out."""
    if several and status != 0:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def lost(error: BaseException) -> str:
    """The one line saying a collective failed because a peer is gone."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"a peer process is lost ({type(error).__name__}: {first}); resume from the checkpoint"


def check_flags(args, **parts) -> None:
    """AgreementError on every process unless all were given the same flags (every
    flag of the command's parser but PER_PROCESS) and `parts`; bounded: a peer that
    never comes is jax's to time out (its heartbeat) or the watchdog's."""
    from models.training import agree

    agree.check(**flags(args), **parts)


def rank(args) -> int:
    """This process's id as the flags (or srun's, mpirun's environment) give it, without
    joining: for a command that one process does alone (export). 0 where unknown."""
    how = plan(args)
    if how is None:
        return 0
    if how[2] is not None:
        return how[2]
    for name in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "JAX_PROCESS_ID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0
