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

from dataclasses import replace

import jax
import numpy as np

from lowering.caches import per_object
from lowering.interpret import io_layouts, plan_program
from lowering.lower import graph_report, plan_report
from lowering.plan import Plan
from lowering.rules.control import settled, widenings
from namedmesh.errors import NamedMeshError
from namedmesh.trace import Eqn, Graph


def fingerprint(graph: Graph, drop: tuple = ()) -> tuple:
    """What planning `graph` can depend on, hashable: equal for structurally equal
    graphs (values numbered in order of appearance), else different; without the
    params named in `drop` of its own equations (not of its bodies')."""
    number: dict = {}

    def value(v) -> tuple:
        const = None if v.const is None else _param(v.const)
        return (number.setdefault(v, len(number)), v.dims, v.shape, str(v.dtype), const)

    out: list = [_param(graph.in_tree), _param(graph.out_tree), tuple(map(value, graph.inputs))]
    out += [(value(v), _param(c)) for v, c in graph.consts.items()]
    for e in graph.eqns:
        params = tuple((k, _param(p)) for k, p in sorted(e.params.items()) if k not in drop)
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


class Shared:
    """What the layout searches of one group of a plan's pairs share (`joint_search`
    keeps one per mesh and settings but remat): their scan bodies (`share_bodies`), and
    the plans of their programs, which differ in the remat of their top-level scans
    alone: a layout one pair's search planned is planned once for all of them, each
    pair costing it (`plan_report`: remat's recompute and saved activations) as its
    own (`plans`: kept for programs to come; without, a program adopted after takes
    those kept before). A plan that depends on remat (a pipelined scan's:
    lowering/pipeline.py saves its ticks' results as remat keeps them) or holds an
    equation made while planning is not shared."""

    def __init__(self, plans: bool = True):
        self.keep = plans  # whether plans are kept for programs adopted later
        self.bodies: dict = {}  # fingerprint -> body (`share_bodies`)
        self.programs: dict = {}  # fingerprint but top-level remat -> the first program
        self.roots: dict = {}  # id(program) -> (it, the first of its kind, its eqns')
        self.plans: dict = {}  # (first, mesh, layout, wrt) -> (program, plan, wanted) | error

    def adopt(self, graph: Graph) -> Graph:
        """`graph`, just traced, with its bodies shared; where a program of its kind
        (`fingerprint` but its top-level scans' remat) was adopted before, that
        program's values with `graph`'s remat (the same program, its plans shared)."""
        share_bodies(graph, self.bodies)
        first = self.programs.setdefault(fingerprint(graph, drop=("remat",)), graph)
        if first is not graph:
            eqns = [a if a.params.get("remat") == b.params.get("remat") else _remat_of(a, b)
                    for a, b in zip(first.eqns, graph.eqns, strict=True)]  # fmt: skip
            graph = Graph(first.inputs, first.outputs, eqns, first.in_tree, first.out_tree,
                          first.consts)  # fmt: skip
        self.roots[id(graph)] = (graph, first)
        return graph

    def report(self, graph: Graph, mesh, layout, wrt=None, names=None):
        """`lowering.lower.graph_report` of `graph` (adopted), its plan shared with the
        programs of its kind: planned once per layout, costed per program."""
        known, first = self.roots.get(id(graph), (None, None))
        if known is not graph or not (self.keep or first is not graph):
            return graph_report(graph, mesh, layout, wrt, names)
        key = (id(first), tuple(mesh.sizes.items()), layout.rules, layout.strict,
               repr(sorted(layout.options.items())), tuple(wrt or ()))  # fmt: skip
        if key not in self.plans:
            try:
                wanted, outs = io_layouts(graph, mesh, layout, names)
                plan = plan_program(graph, mesh, layout, wanted, outs, record=False)
            except NamedMeshError as e:
                self.plans[key] = e
                raise
            self.plans[key] = (graph, plan, wanted)
        found = self.plans[key]
        if isinstance(found, NamedMeshError):
            raise found
        source, plan, wanted = found
        if source is not graph:
            plan = _moved(plan, source, graph)
            if plan is None:  # a plan of its own
                return graph_report(graph, mesh, layout, wrt, names)
        return plan_report(plan, graph, wanted, mesh, wrt)

    def forget(self) -> None:
        """Empty the bodies' pass memos and the plans (`forget_shared`)."""
        forget_shared(self.bodies)
        self.plans.clear()


def _remat_of(a: Eqn, b: Eqn) -> Eqn:
    """Equation `a` (its values, its shared body) with `b`'s remat."""
    params = {k: p for k, p in a.params.items() if k != "remat"}
    if "remat" in b.params:
        params["remat"] = b.params["remat"]
    return Eqn(a.primitive, a.inputs, a.outputs, params)


def _moved(plan: Plan, source: Graph, graph: Graph) -> Plan | None:
    """`plan` of `source` as the plan of `graph`, the same program but its top-level
    scans' remat: its steps of those scans' equations moved to `graph`'s; None where
    the plan depends on remat (a pipelined scan's) or holds an equation neither has (one
    made while planning)."""
    moved = {a: b for a, b in zip(source.eqns, graph.eqns, strict=True) if a is not b}
    known = _equations(source)
    out = Plan()
    for step in plan:
        if step.pipeline is not None or (step.eqn is not None and step.eqn not in known):
            return None
        out.append(replace(step, eqn=moved[step.eqn]) if step.eqn in moved else step)
    out.inputs, out.consts, out.outputs = plan.inputs, plan.consts, plan.outputs
    return out


@per_object
def _equations(graph: Graph) -> frozenset:
    """The equations of `graph` and of the bodies nested in it."""
    eqns = set(graph.eqns)
    for e in graph.eqns:
        for p in e.params.values():
            if isinstance(p, Graph):
                eqns |= _equations(p)
    return frozenset(eqns)
