"""The caches that let auto_layout cost thousands of candidate layouts of one program.

Each holds the results of a pure function, so a hit is exactly what the call would
give: `per_object` keeps results per object (a Graph, an equation) for as long as that
object lives; `memo` keeps a pure function of hashable values (a primitive's shape or
cost rule on local avals), bounded. Callers must not change a result. A cache is of
one of two kinds: "program" (what depends on the program alone, found once for all
the candidates of a search, as its trace is) or "layouts" (what one candidate leaves
for another: a local op's shapes and flops on the same shards, an einsum's choice of
compute layouts under the same rules of its dims, shard bytes).
`clear(kind)` empties them, so that a benchmark can cost a candidate from cold
caches.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

_CLEARS: list[tuple[str, Callable[[], None]]] = []
_UNHASHABLE = object()  # the key of a list of (args, result) for args that do not hash


def per_object(fn: Callable | None = None, kind: str = "program") -> Callable:
    """`fn(obj, *args)`, kept per `obj` (weakly: dropped with it) and per `args`. Args
    that do not hash (a params dict) are compared by equality. `@per_object` or
    `@per_object(kind="layouts")`."""
    if fn is None:
        return functools.partial(per_object, kind=kind)
    # {id(obj): (weak reference to obj, {args: result})}: a plain dict by id, cheaper to
    # look up than a WeakKeyDictionary (which makes a reference per lookup); an entry
    # leaves with its object (the reference's callback runs before the id is free)
    cache: dict[int, tuple[weakref.ref, dict]] = {}

    def forget(ref, key: int) -> None:
        if cache.get(key, (None,))[0] is ref:
            del cache[key]

    @functools.wraps(fn)
    def cached(obj, *args):
        entry = cache.get(id(obj))
        if entry is None or entry[0]() is not obj:
            key = id(obj)
            entry = cache[key] = (weakref.ref(obj, lambda r: forget(r, key)), {})
        known = entry[1]
        try:
            return known[args]
        except KeyError:
            result = known[args] = fn(obj, *args)
            return result
        except TypeError:  # unhashable args
            seen = known.setdefault(_UNHASHABLE, [])
            for a, result in seen:
                if a == args:
                    return result
            result = fn(obj, *args)
            seen.append((args, result))
            return result

    _CLEARS.append((kind, cache.clear))
    return cached


def memo(maxsize: int = 1 << 16) -> Callable[[Callable], Callable]:
    """`functools.lru_cache(maxsize)` of a pure function of hashable arguments (of local
    shards: kind "layouts")."""

    def wrap(fn: Callable) -> Callable:
        cached = functools.lru_cache(maxsize)(fn)
        _CLEARS.append(("layouts", cached.cache_clear))
        return cached

    return wrap


def clear(kind: str | None = None) -> None:
    """Empty the caches of `kind` ("program", "layouts"; None: all), for a benchmark
    that costs a candidate from cold caches."""
    for k, c in _CLEARS:
        if kind is None or k == kind:
            c()
