"""A step's memory as the operating system sees it, measured the same way for any
library: the peak resident memory (VmHWM) while the step runs, less the resident
memory just before it. Before the step, glibc is asked to give its free pages back
(`malloc_trim`), so memory an earlier computation freed but glibc kept is not reused
unseen, and the kernel's peak counter is reset (`/proc/self/clear_refs`, Linux)."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
from collections.abc import Callable


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


def step_bytes(step: Callable[[], object]) -> int:
    """Bytes `step()` adds to the resident peak of this process (Linux only)."""
    release()
    before = resident()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the resident memory now
    step()
    return peak_resident() - before
