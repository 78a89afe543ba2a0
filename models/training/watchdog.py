"""A step watchdog: a run of several processes whose peer died or hangs ends within a
bounded time, with exit status 75 ("resume me", as after preemption), instead of waiting
forever inside a collective (a peer that hangs while alive keeps sending jax's
heartbeats, so nothing else notices it).

The main thread calls `expect(seconds)` before each wait it cannot bound itself (a step,
a validation, a save, an agreement); a daemon thread ends the process with
`os._exit(75)` after one line on stderr when the main thread has not called again in
time. The limit of a step comes from the measured step times (`step_limit`) unless
`--step-timeout` sets it; the first step and the first validation compile, so they get
`COMPILE_S` at least.
"""

from __future__ import annotations

import os
import sys
import threading
import time

EXIT_LOST = 75  # a peer lost: the same status as preemption (resume from the checkpoint)
FLOOR_S = 10.0  # no measured limit is shorter (scheduling noise on a busy host)
FACTOR = 10.0  # a step may take this many times the slowest step measured so far
COMPILE_S = 900.0  # a compile (the first step, the first validation) or the agreement
SAVE_S = 300.0  # a checkpoint's save barrier


def step_limit(times: list[float], floor_s: float = FLOOR_S, factor: float = FACTOR) -> float:
    """The seconds a step may take, from the steps measured so far (compiles excluded):
    `factor` times the slowest, and at least `floor_s`; COMPILE_S before any."""
    if not times:
        return max(COMPILE_S, floor_s)
    return max(floor_s, factor * max(times))


class Watchdog:
    """`with Watchdog(step_timeout) as dog:` ... `dog.expect(s)` ... `dog.step_done(t)`.
    `step_timeout` None: the limit is measured (`step_limit`); a number: every step's.
    `enabled` False: nothing is watched (one process, where no peer can be lost)."""

    def __init__(self, step_timeout: float | None = None, enabled: bool = True):
        self.step_timeout, self.enabled = step_timeout, enabled
        self.times: list[float] = []
        self._deadline, self._what = float("inf"), ""
        self._lock, self._done = threading.Lock(), threading.Event()

    def __enter__(self) -> Watchdog:
        if self.enabled:
            threading.Thread(target=self._watch, daemon=True, name="watchdog").start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()

    def expect(self, seconds: float, what: str) -> None:
        """The main thread's next call must come within `seconds` (`what` it is doing)."""
        with self._lock:
            self._deadline, self._what = time.monotonic() + seconds, what

    def step_limit(self) -> float:
        """The limit of the next step: --step-timeout, else measured."""
        if self.step_timeout is not None:
            return self.step_timeout if self.times else max(self.step_timeout, COMPILE_S)
        return step_limit(self.times)

    def step_done(self, seconds: float, compiled: bool = False) -> None:
        """A step ended after `seconds` (`compiled`: its time included a compile, which
        is not a step time)."""
        if not compiled:
            self.times.append(seconds)

    def _watch(self) -> None:
        while not self._done.wait(0.5):
            with self._lock:
                late = time.monotonic() - self._deadline
                what = self._what
            if late > 0:
                print(
                    f"watchdog: {what} did not end in time: a peer process is lost or hangs; "
                    f"exiting with status {EXIT_LOST} (resume from the last checkpoint)",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(EXIT_LOST)


def paced(items, dog: Watchdog, what: str):
    """`items`, each given the watchdog's limit from the moment it is handed out to the
    next one's; the times measured (the first item's held the compile)."""
    last = None
    for i, item in enumerate(items):
        now = time.monotonic()
        if last is not None:
            dog.step_done(now - last, compiled=i == 1)
        dog.expect(dog.step_limit(), f"{what} {i + 1}")
        last = now
        yield item
