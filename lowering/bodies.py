"""Scan bodies shared between the programs of one plan's (mesh, settings) pairs.

A plan traces one program per pair, and most of a candidate's planning is that of its
scan bodies (the layers, attention's blocks), whose passes are memoised per body object
(lowering/rules/control.py `settled`, `widenings`, keyed by everything a pass depends
on: the mesh, the rules of the body's dims, the local shapes, types and layouts). Pairs
that differ in remat trace the same bodies (remat is a parameter of the scan equation
that holds the body, read only when the plan is costed, not when it is planned), as do
the candidates of pairs whose program differs outside its layers. `share_bodies` makes
such programs hold one body object, so a pass planned for one pair's candidate is taken
by the next pair's: the same plan, planned once.

Bodies are the same when `fingerprint` says so: every equation's primitive, params (a
nested body's fingerprint, an array's bytes, a pytree's structure, a number, string or
dtype by `repr`, any other object by identity, which only forgoes a share), and its
values' dims, shapes, dtypes and wiring; constants by their bytes.
"""

from __future__ import annotations

import jax
import numpy as np

from lowering.rules.control import settled, widenings
from namedmesh.trace import Graph


def fingerprint(graph: Graph) -> tuple:
    """What planning `graph` can depend on, hashable: equal for structurally equal
    graphs (values numbered in order of appearance), else different."""
    number: dict = {}

    def value(v) -> tuple:
        const = None if v.const is None else _param(v.const)
        return (number.setdefault(v, len(number)), v.dims, v.shape, str(v.dtype), const)

    out: list = [_param(graph.in_tree), _param(graph.out_tree), tuple(map(value, graph.inputs))]
    out += [(value(v), _param(c)) for v, c in graph.consts.items()]
    for e in graph.eqns:
        params = tuple((k, _param(p)) for k, p in sorted(e.params.items()))
        out.append((e.primitive.name, id(e.primitive), tuple(map(value, e.inputs)),
                    tuple(map(value, e.outputs)), params))  # fmt: skip
    out.append(tuple(map(value, graph.outputs)))
    return tuple(out)


def _param(p) -> object:
    """A param (or constant) as fingerprint: its content where its type is known to
    show it whole, else the object itself by identity (never equal to another's)."""
    if isinstance(p, Graph):
        return ("graph", fingerprint(p))
    if isinstance(p, np.ndarray | np.generic | jax.Array):
        a = np.asarray(p)
        return ("array", a.dtype.str, a.shape, a.tobytes())
    if isinstance(p, tuple | list):
        return (type(p).__name__, *map(_param, p))
    if p is None or isinstance(p, str | int | float | complex | np.dtype | type):
        return (type(p).__name__, repr(p))
    if isinstance(p, jax.tree_util.PyTreeDef):  # compared by structure (a scan's `trees`)
        return ("tree", p)
    return ("object", id(p))  # alive while the graphs that hold it are: ids unique


def share_bodies(graph: Graph, known: dict) -> int:
    """Each scan body of `graph` (nested ones too) that is the same (`fingerprint`) as one
    in `known` (fingerprint -> body) replaced by that one; the rest join `known`. Call it
    on a program just traced, before it is planned. How many bodies it replaced."""
    shared = 0
    for e in graph.eqns:
        for k, p in e.params.items():
            if not isinstance(p, Graph):
                continue
            key = fingerprint(p)
            if key in known:
                e.params[k] = known[key]
                shared += 1
            else:
                known[key] = p
                shared += share_bodies(p, known)
    return shared


def forget_shared(known: dict) -> None:
    """Empty the pass memos of the bodies in `known` (their planned passes: gigabytes
    over a plan's searches) once no program will plan them again."""
    for body in known.values():  # nested bodies are in `known` too (`share_bodies`)
        settled(body).clear()
        widenings(body).clear()
