"""A layout search holds Python's cycle collector back (lowering/collector.py
`few_collections`) and puts it back as it found it. Oracles: the gc module's own state
read inside the traced function (which the search calls) and after, the same search
with the hold switched off (its table), and gc's callbacks counting the collections."""

import gc

import pytest

import namedmesh as nm
from lowering import Mesh, auto_layout, collector
from lowering.rates import hardware

A = nm.abstract
MESH = Mesh({"x": 2, "y": 2}, devices="abstract")


def _search(seen: list):
    def mlp(x, w1, w2):
        seen.append((gc.get_threshold(), gc.get_freeze_count()))
        return nm.einsum(nm.relu(nm.einsum(x, w1)), w2, out="batch d_model")

    x, w1 = A({"batch": 8, "d_model": 4}), A({"d_model": 4, "d_ff": 8})
    inputs = x, w1, A({"d_ff": 8, "d_model": 4})
    counts = [0]
    count = lambda phase, info: counts.__setitem__(0, counts[0] + (phase == "start"))
    gc.callbacks.append(count)
    try:
        _, table = auto_layout(mlp, MESH, *inputs, rates=hardware("tpu_v2"), beam=1)
    finally:
        gc.callbacks.remove(count)
    return [(str(c.layout), c.planned, c.memory, c.note) for c in table], counts[0]


@pytest.fixture
def thresholds():
    old = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # Python's defaults, which the CLI runs at
    yield
    gc.set_threshold(*old)


def test_a_search_holds_the_collector_back_and_restores_it(thresholds, monkeypatch):
    """Inside: thresholds raised and the objects alive at entry frozen; after: the
    caller's thresholds and no frozen objects. The same table as with the hold off (an
    enclosing search's depth makes it a no-op), with fewer collections."""
    seen: list = []
    held, collections = _search(seen)
    assert seen[0] == (collector.THRESHOLDS, seen[0][1]) and seen[0][1] > 0
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0
    monkeypatch.setattr(collector, "_depth", [1])  # as inside another search: held by it
    seen.clear()
    plain, plain_collections = _search(seen)
    assert seen[0] == ((700, 10, 10), 0)
    assert held == plain
    assert collections < plain_collections


def test_a_callers_own_freeze_is_left_to_it(thresholds):
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        seen: list = []
        _search(seen)
        assert seen[0][1] == frozen and gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
