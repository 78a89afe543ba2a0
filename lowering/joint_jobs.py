"""A joint search's pairs searched ahead in worker processes (`joint_search(jobs=N)`).

The serial search (lowering/joint.py) takes the (mesh, settings) pairs in order and
decides each from the ones before it: pruned by the best plan that fits so far, or
left out after the fewest microbatches of its chain that fit. That decision stays in
the calling process, in the same order; what moves to the workers is the work it
waits on: each group of pairs that share scan bodies (`_body_group`: one mesh, its
settings alike but remat), or one pipelined pair, searched into cache entries that the
caller merges into the joint search's cache, where the serial code finds them. So the
result is the serial search's, exactly (tests/test_joint_jobs.py). A worker searches
the pairs of its group the caller still wants when the group is handed out: not
decided, not pruned by the best plan found so far (which stays pruned: the best only
gets better), not after fewer microbatches of its chain that fit in a search already
answered (the caller will most likely leave it out). A pair searched that the caller
then leaves out is work thrown away; one the caller needs that was not handed out
(its guess wrong) is searched in the caller, as the serial search would.

Groups are handed out in the order the caller gives them (lowering/joint.py `_ahead`:
each chain's fewest microbatches first), `jobs` at a time, each when the caller next
waits (so `wanted` sees its latest decisions), but a group whose pairs climb from their
mesh's lead's layout (lowering/joint.py `_seeds`) waits until the lead's group is
answered (`after`; later groups go first meanwhile), and its seeds go with its task;
`need(pair)` hands out the pair's group at once if it was not, and waits for it.
Workers are started by `spawn` (jax is imported: forking it is unsafe), each importing
the packages (about 3 s) and holding its own plans (0.3 to 1 GB each for the
walk-throughs of docs/layouts.md). They
ignore SIGINT: Ctrl-C reaches the caller alone, whose `close` ends them, so the command
ends in its one line. A worker's error comes back as the same typed error; a worker
that dies (killed, out of memory) is a JobsError naming it, not a hang; a worker whose
caller dies (SIGTERM, SIGKILL) ends too.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import threading
from collections.abc import Callable, Hashable

from namedmesh.errors import NamedMeshError

POLL_SECONDS = 0.5  # how often a wait looks for a dead worker


class JobsError(NamedMeshError):
    """A worker process ended without answering (killed: out of memory?)."""


def _work(tasks, answers) -> None:
    """A worker: `serve`, ending at once if the caller ends without `close` (a SIGTERM
    or SIGKILL), not waiting for a task that will never come."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle
    threading.Thread(target=_end_with, args=(multiprocessing.parent_process(),),
                     daemon=True).start()  # fmt: skip
    serve(tasks, answers)


def serve(tasks, answers) -> None:
    """Run each task of `tasks` ((id, a pickled callable)) until None, answering (id,
    ok, its pickled result or error) in `answers`."""
    while (item := tasks.get()) is not None:
        tid, data = item
        try:
            answers.put((tid, True, pickle.dumps(pickle.loads(data)())))
        except Exception as e:  # noqa: BLE001 - any error goes back to the caller
            answers.put((tid, False, _portable(e)))


def _end_with(parent) -> None:
    """End this process when `parent` ends."""
    multiprocessing.connection.wait([parent.sentinel])
    os._exit(1)


def _portable(error: Exception) -> bytes:
    """`error` pickled; where its attributes do not pickle (a LayoutError's `search`
    holds the traced program), the same type with the same message."""
    try:
        return pickle.dumps(error)
    except Exception:  # noqa: BLE001 - an attribute that does not pickle
        try:
            return pickle.dumps(type(error)(*error.args))
        except Exception:  # noqa: BLE001 - a type that does not pickle either
            return pickle.dumps(NamedMeshError(f"{type(error).__name__}: {error}"))


class Workers:
    """`jobs` worker processes running `task(items)` for each of `groups` (lists of
    hashable items, in the order they will be needed), each group's items filtered by
    `wanted(item)` when it is handed out; each answer (a dict) goes to `merge`. A group
    `g` of `after` is handed out once group `after[g]` is answered (its task is made
    from that answer: a joint search's seeds); a later group that waits on nothing may
    go first."""

    def __init__(
        self,
        jobs: int,
        groups: list[list[Hashable]],
        task: Callable[[list], Callable[[], dict]],
        wanted: Callable[[Hashable], bool],
        merge: Callable[[dict], None],
        after: dict[int, int] | None = None,
    ):
        self.groups, self.task, self.wanted, self.merge = groups, task, wanted, merge
        self.after = after or {}
        self.group_of = {item: g for g, items in enumerate(groups) for item in items}
        self.handed: set[int] = set()  # groups handed out (or found with nothing wanted)
        self.answered: set[int] = set()
        self.next = 0  # the next group to hand out in order
        self.jobs, self.procs = jobs, []  # started with the first group handed out
        context = multiprocessing.get_context("spawn")
        self.tasks, self.answers = context.Queue(), context.Queue()
        self._top_up()

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited: no traceback
        try:  # from a worker's imports at Ctrl-C
            self.procs = [context.Process(target=_work, args=(self.tasks, self.answers),
                                          daemon=True) for _ in range(self.jobs)]  # fmt: skip
            for p in self.procs:
                p.start()
        finally:
            signal.signal(signal.SIGINT, old)

    def _busy(self) -> int:
        return len(self.handed - self.answered)

    def _hand_out(self, g: int) -> None:
        self.handed.add(g)
        items = [i for i in self.groups[g] if self.wanted(i)]
        if items:
            try:  # here, not in the queue's thread, where an error would be lost (a hang)
                data = pickle.dumps(self.task(items))
            except Exception as e:  # noqa: BLE001 - whatever does not pickle, named
                raise JobsError(
                    f"joint_search: with jobs={self.jobs} the work of a group must "
                    f"pickle (build and staged of module-level classes), it does not: "
                    f"{type(e).__name__}: {e}; or run with jobs=1"
                ) from None
            if not self.procs:
                self._start()
            self.tasks.put((g, data))
        else:
            self.answered.add(g)

    def _ready(self, g: int) -> bool:
        return g not in self.after or self.after[g] in self.answered

    def _top_up(self) -> None:
        g = self.next
        while self._busy() < self.jobs and g < len(self.groups):
            if g not in self.handed and self._ready(g):
                self._hand_out(g)
            g += 1
        while self.next in self.handed:
            self.next += 1

    def need(self, item: Hashable) -> None:
        """Wait until `item`'s group is answered and merged (at once if it is not one of
        the groups), and the group it waits on (`after`) before it is handed out."""
        g = self.group_of.get(item)
        if g is not None:
            if g in self.after:
                self._wait(self.after[g])
            self._wait(g)

    def _wait(self, g: int) -> None:
        if g not in self.handed:
            self._hand_out(g)
        self._top_up()  # here, not as an answer comes: `wanted` knows the caller's decisions
        while g not in self.answered:
            self._receive()
            self._top_up()

    def _receive(self) -> None:
        try:
            g, ok, data = self.answers.get(timeout=POLL_SECONDS)
        except queue.Empty:
            dead = [p for p in self.procs if p.exitcode is not None]
            if dead:
                raise JobsError(
                    f"joint_search: worker process {dead[0].pid} ended with exit code "
                    f"{dead[0].exitcode} before answering (killed: out of memory? a script "
                    f"calling joint_search(jobs=N) needs `if __name__ == '__main__':`); "
                    f"run with fewer jobs (--jobs 1: in this process)"
                ) from None
            return
        self.answered.add(g)
        if not ok:
            raise pickle.loads(data)
        self.merge(pickle.loads(data))

    def close(self) -> None:
        """End the workers, whatever they are doing."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join()
        for q in (self.tasks, self.answers):
            q.cancel_join_thread()
            q.close()
