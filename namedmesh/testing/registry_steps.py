"""How the property strategies apply each registered primitive, read from the registry
(issue 42): a primitive's `Primitive.example`, declared beside its definition, or for
an elementwise op without one, its public op; and which primitives a function binds,
so that a strategy with hand-written cases derives the rest from the registry."""

from __future__ import annotations

import functools

import namedmesh as nm
from namedmesh.primitive import REGISTRY


def drawn_kinds() -> tuple[str, ...]:
    """The registered primitives random programs draw: every one whose `example` is a
    function or derived from its flags (`step_of`), read from the registry at each call,
    so a primitive registered later is drawn too."""
    return tuple(name for name in REGISTRY if step_of(name) is not None)


def not_drawn() -> dict[str, str]:
    """{primitive: why random programs do not draw it} for the registered primitives that
    are not drawn: each declares its reason as its `example` (a str), or is named here
    with "no example" (a primitive to give one)."""
    return {
        name: p.example if isinstance(p.example, str) else "no example and no flag to derive one"
        for name, p in REGISTRY.items()
        if step_of(name) is None
    }


def step_of(name: str):
    """How a random program applies primitive `name`: its `example`, or for an elementwise
    op without one, its public op on positive inputs (in [0.5, 1.5]: every op's domain)
    with as many operands as it takes; None where neither applies."""
    prim = REGISTRY[name]
    if callable(prim.example):
        return prim.example
    if prim.example is None and prim.elementwise and (n := arity(prim)):
        op = public_op(prim)

        def elementwise(a, b, d, k):
            ins = [a, b, a][:n]
            return op(*(abs(x) * 0.25 + 0.5 for x in ins))

        return elementwise
    return None


@functools.cache
def public_op(prim):
    """The public function of `nm` (or `nm.random`) that binds `prim`, or None."""
    for space in (nm, nm.random):
        for name in dir(space):
            if getattr(getattr(space, name), "primitive", None) is prim:
                return getattr(space, name)
    return None


@functools.cache
def arity(prim) -> int | None:
    """How many operands `prim`'s public op takes (1 to 3): the first count it accepts."""
    op = public_op(prim)
    x = nm.ones({"p": 2})
    for n in (1, 2, 3):
        try:
            op(*[x] * n)
        except (TypeError, nm.NamedMeshError):
            continue
        return n
    return None


def bound_by(fn, *inputs) -> set[str]:
    """The primitives `fn(*inputs)`'s trace binds, those of loop bodies too."""
    names, graphs = set(), [nm.trace(fn, *inputs)]
    while graphs:
        for e in graphs.pop().eqns:
            names.add(e.primitive.name)
            graphs += [v for v in e.params.values() if isinstance(v, nm.Graph)]
    return names


def not_bound_by(fns, *inputs) -> tuple[str, ...]:
    """The drawn kinds (`drawn_kinds`) that none of the functions `fns` binds on
    `inputs`: what a strategy with hand-written cases derives from the registry, so
    that every registered primitive is drawn there too."""
    bound = set().union(*(bound_by(fn, *inputs) for fn in fns))
    return tuple(name for name in drawn_kinds() if name not in bound)
