"""SIGTERM (a scheduler's or a preemptible VM's notice) and SIGINT (Ctrl-C) as requests
to stop at the next step boundary, where the run saves a checkpoint and exits.

Python runs a signal handler only between bytecodes of the main thread, so a handler
alone would leave a process stuck inside a compiled program (a collective waiting on a
lost peer) deaf to SIGTERM. The C-level handler also writes the signal's number to a
socket (`signal.set_wakeup_fd`), which a watcher thread reads even then: a second signal
ends the process at once, and the first ends it after `grace_s` seconds if the main
thread has not reached a step boundary and finished by then. So no code path of ours
blocks a signal.

Several processes agree on the step to stop at: `should_stop` is the same on every
process at each step (`jax.experimental.multihost_utils.process_allgather` of each
process's flag), so they all save the same step."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)
GRACE_S = 120.0  # after the first signal, the most a step and a save may take


def exit_at_once(prog: str):
    """Make SIGTERM and SIGINT end this process at once (128 + the signal's number) with
    one line on stderr, never a traceback and never swallowed by a library's `except`;
    the function that puts the previous handlers back. Outside the main thread: no-op."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        line = f"{prog}: error: stopped by {signal.Signals(signum).name}; nothing saved since "
        os.write(2, (line + "the last checkpoint (if any)\n").encode())
        os._exit(128 + signum)

    old = {s: signal.signal(s, handler) for s in SIGNALS}
    return lambda: [signal.signal(s, h) for s, h in old.items()] and None


class Preemption:
    """`with Preemption() as p:` ... `if p.should_stop(): save; exit`; the signal that
    asked is `p.signal` (None before any). Outside the main thread it does nothing."""

    def __init__(self, grace_s: float = GRACE_S):
        self.grace_s, self.signal = grace_s, None
        self._old, self._done = {}, threading.Event()

    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._read, write = socket.socketpair()
        write.setblocking(False)
        self._write = write
        self._old = {s: signal.signal(s, self._note) for s in SIGNALS}
        self._old_fd = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, daemon=True, name="preemption").start()
        return self

    def __exit__(self, *exc) -> None:
        if not self._old:
            return
        self._done.set()
        signal.set_wakeup_fd(self._old_fd)
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._write.close()  # wakes the watcher, which then closes its end

    def _note(self, signum, frame) -> None:
        """The Python-level handler: remember the first signal (the watcher acts too)."""
        if self.signal is None:
            self.signal = signal.Signals(signum)

    def _watch(self) -> None:
        seen = 0
        while True:
            try:
                got = self._read.recv(1)
            except OSError:
                got = b""
            if not got or self._done.is_set():
                self._read.close()
                return
            if got[0] not in {int(s) for s in SIGNALS}:
                continue
            seen += 1
            name = signal.Signals(got[0]).name
            if seen == 1:
                print(
                    f"{name}: saving a checkpoint at the end of this step, then exiting "
                    f"(again: exit at once)",
                    file=sys.stderr,
                    flush=True,
                )
                timer = threading.Timer(self.grace_s, self._abort, (got[0], "no step ended"))
                timer.daemon = True
                timer.start()
            else:
                self._abort(got[0], f"a second {name}")

    def _abort(self, signum: int, why: str) -> None:
        if self._done.is_set():
            return
        print(f"aborted without saving: {why}", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def should_stop(self) -> bool:
        """Whether any process was asked to stop (the same answer on every process)."""
        import jax

        local = self.signal is not None
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        return bool(multihost_utils.process_allgather(local).any())
