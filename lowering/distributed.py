"""Running lowered programs over several processes (hosts): `initialize`, `global_array`,
`to_numpy`, `place`.

Every process runs the same program. `initialize` connects the processes (it wraps
`jax.distributed.initialize`, with gloo collectives between CPU processes); then
`jax.devices()` lists the devices of all processes, a `Mesh` over them spans the
processes, and a lowered function called with NumPy-backed Tensors (the same global value
on every process) turns each input into a global jax.Array with `global_array`. Outputs are
global jax.Arrays of which each process holds its own shards; `to_numpy` gathers the full
value on every process. See docs/distributed.md.
"""

from __future__ import annotations

import errno
import socket

import jax
import numpy as np
from jax.experimental import multihost_utils

from lowering.layout import ValueLayout, check_divisible, partition_spec
from lowering.mesh import Mesh
from namedmesh.errors import LayoutError, MeshError


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise MeshError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _check_port(coordinator: str) -> None:
    """MeshError unless process 0 can serve the coordinator on its port: jax's service
    listens on every address (`[::]:PORT`), and a port another program holds makes it
    fail, at times by a segmentation fault, not an error."""
    port = int(coordinator.rpartition(":")[2])
    for family, anywhere in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host: IPv4's check alone
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as jax's service does
            try:
                s.bind((anywhere, port))
            except OSError as e:
                if e.errno not in (errno.EADDRINUSE, errno.EACCES):
                    continue  # this family cannot be served here: the next one's check
                raise MeshError(
                    f"process 0 could not start the coordinator service at {coordinator}: "
                    f"the port is in use or not allowed ({e.strerror}); pick another port"
                ) from None
        return


def initialize(
    coordinator: str | None,
    num_processes: int | None,
    process_id: int | None,
    *,
    timeout_s: int = 60,
    heartbeat_timeout_s: int = 10,
) -> None:
    """Join this process to a group of `num_processes` processes, as `process_id`, with the
    coordinator (run by process 0) at `coordinator` ("host:port"). Call it before any other
    JAX call. `timeout_s` bounds the wait for all processes to connect (and, at exit, for
    them to shut down); a process silent for `heartbeat_timeout_s` seconds is taken as dead
    and the others are stopped with an error. All three of coordinator, num_processes and
    process_id may be None where jax detects them (Cloud TPU, SLURM, Open MPI).
    MeshError for bad arguments or when JAX was already initialized."""
    if coordinator is not None:
        host, sep, port = coordinator.rpartition(":") if isinstance(coordinator, str) else ("",) * 3
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise MeshError(f"coordinator must be 'host:port', got {coordinator!r}")
    if num_processes is not None:
        num_processes = _positive_int("num_processes", num_processes)
    if process_id is not None:
        if isinstance(process_id, bool) or not isinstance(process_id, int | np.integer):
            raise MeshError(f"process_id must be an int, got {process_id!r}")
        process_id = int(process_id)
        if num_processes is not None and not 0 <= process_id < num_processes:
            raise MeshError(
                f"process_id {process_id} is not in range(num_processes={num_processes})"
            )
    timeout_s = _positive_int("timeout_s", timeout_s)
    heartbeat_timeout_s = _positive_int("heartbeat_timeout_s", heartbeat_timeout_s)
    if jax.distributed.is_initialized():
        raise MeshError("lowering.distributed.initialize was already called in this process")
    if process_id == 0 and coordinator is not None:
        _check_port(coordinator)
    # Only affects the CPU backend: collectives between CPU devices of different processes.
    previous = jax.config.jax_cpu_collectives_implementation
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
            shutdown_timeout_seconds=timeout_s,
        )
    except RuntimeError as e:
        jax.config.update("jax_cpu_collectives_implementation", previous)
        if "must be called before" in str(e) or "only be called once" in str(e):
            raise MeshError(
                "lowering.distributed.initialize must be called once, before any other JAX "
                f"call (jax.devices(), a computation, building a Mesh): {e}"
            ) from e
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if "Failed to start RPC server" in first:  # process 0 serves the coordinator
            raise MeshError(
                f"process {process_id} could not start the coordinator service at "
                f"{coordinator}: the port is in use (or the host is not this machine's "
                f"address); pick another port ({first})"
            ) from None
        raise
    except (ValueError, TypeError) as e:
        jax.config.update("jax_cpu_collectives_implementation", previous)
        raise MeshError(f"lowering.distributed.initialize: {e}") from e


def global_array(data, layout: ValueLayout, mesh: Mesh) -> jax.Array:
    """The global jax.Array of `data` (a host array holding the same global value on every
    process), sharded over `mesh` by the value layout `layout` (per dim, its mesh axes);
    each process fills only the shards of its own devices."""
    data = np.asarray(data)
    if len(layout) != data.ndim:
        raise LayoutError(
            f"layout {layout} has {len(layout)} entries for an array of shape {data.shape}"
        )
    check_divisible(layout, [f"axis{i}" for i in range(data.ndim)], data.shape, mesh, "array")
    sharding = jax.sharding.NamedSharding(mesh.jax_mesh, partition_spec(layout))
    return jax.make_array_from_callback(data.shape, sharding, lambda index: data[index])


def to_numpy(array) -> np.ndarray:
    """The full global value of `array` (a jax.Array, possibly spread over processes, or a
    Tensor holding one) as a NumPy array, on every process. Where the array spans several
    processes this is a collective: every process must call it."""
    data = getattr(array, "data", array) if not isinstance(array, jax.Array) else array
    if isinstance(data, jax.Array) and not data.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(data, tiled=True))
    return np.asarray(data)


def place(tree, mesh: Mesh, layout, padded=()) -> object:
    """`tree` with every Tensor's data a global jax.Array laid out on `mesh` as `layout`
    (a Layout or its string) gives it: the layout a lowered function expects of its
    inputs, so calling it moves nothing. A jax.Array is moved (`jax.device_put`); host
    data becomes a global array (`global_array`), also across processes. `padded`: the
    dims of layer stacks a pipeline may split into uneven stages (the lowered program
    pads them: namedmesh/uneven.py), left unsplit where their mesh axes do not divide."""
    from lowering.layout import Layout
    from namedmesh.tensor import Tensor

    layout = layout if isinstance(layout, Layout) else Layout(layout)

    def put(t):
        if not isinstance(t, Tensor):
            return t
        lay = layout.of(t.dims, t.shape, mesh, f"tensor {t.dims}", padded)
        lay = tuple(tuple(a for a in axes if mesh.sizes[a] > 1) for axes in lay)
        if isinstance(t.data, jax.Array) and jax.process_count() == 1:
            sharding = jax.sharding.NamedSharding(mesh.jax_mesh, partition_spec(lay))
            return Tensor._make(jax.device_put(t.data, sharding), t.dims)
        return Tensor._make(global_array(np.asarray(t.data), lay, mesh), t.dims)

    return jax.tree_util.tree_map(put, tree, is_leaf=lambda x: isinstance(x, Tensor))
