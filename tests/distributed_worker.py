"""One process of tests/test_distributed.py: 4 CPU devices of an 8-device, 2-process mesh.

    python tests/distributed_worker.py PORT PROCESS_ID MODE

MODE "mlp": lower an MLP on Mesh(rows=2, cols=4) over both processes' devices under two
layouts, check it against NumPy, exit 0.
MODE "die": initialize, start the backend (jax.devices(), which both processes must do),
then exit (os._exit(3)) 2 s later without running the MLP, while the peer waits for it
inside the collective program.
MODE "survive": like "mlp", but the peer dies. The collectives cannot complete and jax's
distributed service aborts this process (it stops hearing the peer's heartbeats, or loses
the coordinator) with "Terminating process because the JAX distributed service detected
fatal errors. This most likely indicates that another task died" on stderr; or a JAX call
fails first (the coordinator's socket closed), printed here as one line, exit 1.
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

NUM_PROCESSES = 2
LAYOUTS = ("batch:rows;d_ff:cols", "batch:rows;d_model:cols")


def log(msg: str) -> None:
    print(f"[worker {sys.argv[2]}] {msg}", file=sys.stderr, flush=True)


def mlp_inputs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 16), dtype=np.float32)
    w1 = rng.standard_normal((16, 32), dtype=np.float32)
    w2 = rng.standard_normal((32, 16), dtype=np.float32)
    return x, w1, w2


def run_mlp() -> None:
    import jax

    import namedmesh as nm
    from lowering import Mesh, lower
    from lowering.distributed import to_numpy

    assert jax.process_count() == NUM_PROCESSES, jax.process_count()
    assert len(jax.devices()) == 8 and len(jax.local_devices()) == 4, jax.devices()
    mesh = Mesh({"rows": 2, "cols": 4})
    x, w1, w2 = mlp_inputs()
    want = np.maximum(x @ w1, 0) @ w2

    def mlp(x, w1, w2):
        return nm.einsum(nm.relu(nm.einsum(x, w1)), w2, out="batch d_model")

    args = (
        nm.tensor(x, "batch d_model"),
        nm.tensor(w1, "d_model d_ff"),
        nm.tensor(w2, "d_ff d_model"),
    )
    for layout in LAYOUTS:
        out = lower(mlp, mesh, layout)(*args)
        assert out.dims == ("batch", "d_model"), out.dims
        assert not out.data.is_fully_addressable  # spread over both processes
        got = to_numpy(out)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=layout)
        log(f"layout {layout}: matches NumPy")


def main() -> None:
    port, process_id, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    from lowering import distributed

    distributed.initialize(
        f"127.0.0.1:{port}", NUM_PROCESSES, process_id, timeout_s=30, heartbeat_timeout_s=5
    )
    log("initialized")
    if mode == "die":
        import jax

        log(f"{len(jax.devices())} devices")
        time.sleep(2)  # the peer is now inside the MLP, waiting on this process
        log("exiting without taking part")
        os._exit(3)
    start = time.monotonic()
    log("running the MLP over both processes")
    try:
        run_mlp()
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        log(
            f"failed after {time.monotonic() - start:.1f} s, a peer process is probably lost:"
            f" {type(e).__name__}: {first}"
        )
        os._exit(1)
    log("ok")


if __name__ == "__main__":
    main()
