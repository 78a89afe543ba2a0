"""The caches that let auto_layout cost thousands of candidate layouts of one program.

Each holds the results of a pure function, so a hit is exactly what the call would
give: `per_object` keeps what depends on one program (a Graph, an equation) and not on
the layout, for as long as that object lives; `memo` keeps a pure function of
hashable values (a primitive's shape or cost rule on local avals), bounded. Callers
must not change a result. `clear()` empties them all, so that a benchmark can cost
a candidate from cold caches.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

_CLEARS: list[Callable[[], None]] = []
_UNHASHABLE = object()  # the key of a list of (args, result) for args that do not hash


def per_object(fn: Callable) -> Callable:
    """`fn(obj, *args)`, kept per `obj` (weakly: dropped with it) and per `args`. Args
    that do not hash (a params dict) are compared by equality."""
    cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @functools.wraps(fn)
    def cached(obj, *args):
        known = cache.get(obj)
        if known is None:
            known = cache[obj] = {}
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

    _CLEARS.append(cache.clear)
    return cached


def memo(maxsize: int = 1 << 16) -> Callable[[Callable], Callable]:
    """`functools.lru_cache(maxsize)` of a pure function of hashable arguments, emptied
    by `clear()`."""

    def wrap(fn: Callable) -> Callable:
        cached = functools.lru_cache(maxsize)(fn)
        _CLEARS.append(cached.cache_clear)
        return cached

    return wrap


def clear() -> None:
    """Empty every cache of this module's helpers (cold caches for a benchmark)."""
    for c in _CLEARS:
        c()
