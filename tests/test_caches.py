"""lowering/caches.py: a `per_object` result is its object's, found once, and leaves
with it (the cache looks objects up by id, which a new object may reuse)."""

import gc

from lowering import caches


class _Obj:
    def __init__(self, name: str):
        self.name = name


def _counted():
    calls = []

    @caches.per_object
    def of(obj, k):
        calls.append((obj.name, k))
        return obj.name, k

    return of, calls


def test_a_result_is_found_once_per_object_and_args():
    of, calls = _counted()
    a, b = _Obj("a"), _Obj("b")
    assert [of(a, 1), of(a, 1), of(a, 2), of(b, 1)] == [("a", 1), ("a", 1), ("a", 2), ("b", 1)]
    assert calls == [("a", 1), ("a", 2), ("b", 1)]


def test_an_object_at_a_dead_objects_id_gets_its_own_result():
    of, calls = _counted()
    dead: set = set()
    reused = 0
    for batch in range(20):  # a batch dies together: the next takes over its memory (ids)
        objs = [_Obj(f"{batch}.{i}") for i in range(50)]
        reused += sum(id(o) in dead for o in objs)
        assert [of(o, 0) for o in objs] == [(o.name, 0) for o in objs]
        dead |= {id(o) for o in objs}
        del objs
    assert reused  # ids were reused, so the check above could have failed
    assert len(calls) == 20 * 50


def test_clear_forgets_results_of_live_objects():
    of, calls = _counted()
    a = _Obj("a")
    of(a, 0)
    caches.clear("program")
    gc.collect()
    of(a, 0)
    assert calls == [("a", 0), ("a", 0)]
