"""A layout search holds Python's cycle collector back (lowering/collector.py
`few_collections`) and puts it back as it found it. Oracles: the gc module's own state,
read inside the traced function (which the search calls) and after, and the same search
with the hold switched off (its table)."""

import gc

import pytest

import namedmesh as nm
from lowering import Mesh, auto_layout, collector
from lowering.rates import hardware

A = nm.abstract
MESH = Mesh({"x": 2, "y": 2}, devices="abstract")


def _search(seen: list) -> list:
    def mlp(x, w1, w2):
        seen.append((gc.get_threshold(), gc.get_freeze_count()))
        return nm.einsum(nm.relu(nm.einsum(x, w1)), w2, out="batch d_model")

    x, w1 = A({"batch": 8, "d_model": 4}), A({"d_model": 4, "d_ff": 8})
    _, table = auto_layout(mlp, MESH, x, w1, A({"d_ff": 8, "d_model": 4}),
                           rates=hardware("tpu_v2"), beam=1)  # fmt: skip
    return [(str(c.layout), c.planned, c.memory, c.note) for c in table]


@pytest.fixture
def thresholds():
    old = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # Python's defaults, which the CLI runs at
    yield
    gc.set_threshold(*old)


def test_a_search_holds_the_collector_back_and_restores_it(thresholds, monkeypatch):
    """Inside: thresholds raised and the objects alive at entry (jax's modules and the
    rest: the saved work, tens of thousands of objects no collection rescans) frozen;
    after: the caller's thresholds and nothing frozen. The same table as with the hold
    off (an enclosing search's depth makes it a no-op)."""
    seen: list = []
    held = _search(seen)
    assert seen[0][0] == collector.THRESHOLDS and seen[0][1] > 10_000
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0
    monkeypatch.setattr(collector, "_depth", [1])  # as inside another search: held by it
    seen.clear()
    assert _search(seen) == held
    assert seen[0] == ((700, 10, 10), 0)


def test_a_callers_own_freeze_is_left_to_it(thresholds):
    """The search neither freezes again (the 10,000 objects made after the caller's
    freeze would join the count) nor unfreezes (0). The count is compared within 100,
    not exactly: a frozen object freed by its reference count leaves it (a suite's
    earlier tests leave such objects about)."""
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        fresh = [object() for _ in range(10_000)]
        seen: list = []
        _search(seen)
        assert abs(seen[0][1] - frozen) < 100 and abs(gc.get_freeze_count() - frozen) < 100
        assert len(fresh) == 10_000
    finally:
        gc.unfreeze()
