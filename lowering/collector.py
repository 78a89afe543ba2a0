"""Python's cycle collector held back while a layout search runs.

A search plans thousands of candidates, each making hundreds of thousands of small
objects (Locals, Steps, layouts) that reference counting frees at once; at the default
thresholds the cycle collector runs a young collection every 700 of them, and now and
then rescans every object the process holds (jax's modules, the traced program, the
caches that the candidates share: a million objects), which was a fifth of a Llama 3
70B plan's CPU. `few_collections` moves the objects alive when the search starts out
of the collector's sight (`gc.freeze`) and collects less often while it runs; both
are put back when it ends, and it changes no result (the collector only frees
garbage that refcounting could not).
"""

from __future__ import annotations

import contextlib
import gc

THRESHOLDS = (50_000, 20, 100)  # as conftest.py sets them for the test suite
_depth = [0]  # searches running, nested (joint_search -> auto_layout)


@contextlib.contextmanager
def few_collections():
    """Within: the objects alive at entry frozen (unless the caller froze some itself)
    and the collector's thresholds at least `THRESHOLDS`; on exit, as they were."""
    if _depth[0]:  # an enclosing search set it up
        _depth[0] += 1
        try:
            yield
        finally:
            _depth[0] -= 1
        return
    old = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0  # a caller's own freeze is theirs to undo
    if freeze:
        gc.freeze()
    gc.set_threshold(*(max(a, b) for a, b in zip(old, THRESHOLDS, strict=True)))
    _depth[0] = 1
    try:
        yield
    finally:
        _depth[0] = 0
        gc.set_threshold(*old)
        if freeze:
            gc.unfreeze()
