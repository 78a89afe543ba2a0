"""A step's memory as the operating system sees it, measured the same way for any
library: the peak resident memory (VmHWM) while the step runs, less the resident
memory just before it. Before the step, glibc is asked to give its free pages back
(`malloc_trim`), so memory an earlier computation freed but glibc kept is not reused
unseen, and the kernel's peak counter is reset (`/proc/self/clear_refs`, Linux).

That reading holds once per process only. Memory that earlier work frees after the
reading starts (XLA:CPU frees a step's temporaries on its own thread after the step's
outputs are ready) is kept by glibc (benchmarks/fair.py's `keep_freed_memory`) and
reused by the step being measured, which then reads low: in stop 50's run PyTorch's
2048-token step, measured after namedmesh's in one process, read 19 MiB against about
390 MiB alone, and on this machine 17 MiB in one run of three. So `step_bytes`
refuses a second measurement in one process, and `fresh` runs one in a new process.

`python -m benchmarks.rss MODULE:FUNCTION JSON_ARGS`: `FUNCTION(*args)` in this fresh
process, set up as a benchmark's (benchmarks/fair.py's `single_threaded`), its result
printed as JSON on the last line (what `fresh` runs)."""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


class MeasurementError(RuntimeError):
    """A memory measurement that cannot be right (a second one in a process) or did not
    finish (its process failed or ran out of time)."""


measured: list[str] = []  # what this process's one measurement measured


def resident() -> int:
    """Bytes resident now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_resident() -> int:
    """Bytes of the resident peak since it was last reset."""
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def release() -> None:
    """Give glibc's free pages back to the system (`malloc_trim`): a benchmark that keeps
    freed memory (benchmarks/fair.py's `keep_freed_memory`) would otherwise hold its
    largest step's peak for the rest of the run."""
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim:
            trim(0)


def peak_above_now(step: Callable[[], object]) -> int:
    """Bytes `step()` adds to the resident peak of this process (Linux only), right only
    when nothing frees memory during the step that it did not allocate: use `step_bytes`."""
    release()
    before = resident()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the resident memory now
    step()
    return peak_resident() - before


def step_bytes(step: Callable[[], object], what: str = "the step") -> int:
    """Bytes `step()` adds to the resident peak of this process, the one measurement
    this process makes; a second raises MeasurementError (run it by `fresh`)."""
    if measured:
        raise MeasurementError(
            f"rss.step_bytes({what}): this process already measured {measured[0]}, whose "
            "memory freed late would be reused unseen; measure each step in its own "
            "process (benchmarks.rss.fresh)"
        )
    measured.append(what)
    return peak_above_now(step)


def checkout_env() -> dict:
    """This environment with the checkout first on PYTHONPATH (under `namedmesh bench`
    too), for a benchmark's child process."""
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def fresh(target: str, args: list, limit_s: float) -> object:
    """The JSON result of `target` ("module:function") called with `args` in a new
    Python process set up as a benchmark's (one CPU, one thread per library, glibc
    keeping freed memory: `python -m benchmarks.rss`); MeasurementError naming the
    target where it fails or runs over `limit_s` seconds."""
    argv = [sys.executable, "-m", "benchmarks.rss", target, json.dumps(args)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit_s,
                              env=checkout_env())  # fmt: skip
    except subprocess.TimeoutExpired:
        raise MeasurementError(f"{target}{tuple(args)}: not done within {limit_s:.0f} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise MeasurementError(f"{target}{tuple(args)}: exit status {done.returncode}: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# Steps of known size, for the measurement's own test (tests/test_benchmark_rss.py).
_HELD: list = []  # a step's memory that a later step frees, as XLA's late frees land


def _filled(mib: int) -> list:
    import numpy as np

    return [np.ones(2**20 // 8) for _ in range(mib)]  # 1 MiB pieces, every page written


def known_step_bytes(mib: int) -> int:
    """`step_bytes` of a step that fills `mib` MiB."""
    return step_bytes(lambda: _filled(mib))


def one_process(big: int, small: int) -> list[int]:
    """The fault `step_bytes` refuses: a step of `big` MiB whose memory is freed late
    (during the next step), then a step of `small` MiB, both measured in this process;
    the second reads low, its pages taken from the first's."""

    def second():
        _HELD.clear()  # the first step's memory, freed after the reading started
        return _filled(small)

    return [peak_above_now(lambda: _HELD.append(_filled(big))), peak_above_now(second)]


def main(argv=None) -> int:
    from benchmarks import fair

    target, args = argv or sys.argv[1:]
    module, name = target.split(":")  # a malformed target fails before the set-up
    fair.single_threaded()  # before jax's first computation and torch's import
    print(json.dumps(getattr(importlib.import_module(module), name)(*json.loads(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
