"""Reading collectives out of compiled HLO text, to hold the plan against what XLA runs."""

from __future__ import annotations

import math
import re
from typing import NamedTuple

from lowering.ops import HLO_KINDS as KINDS
from lowering.ops import HLO_PIECES

_LINE = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(KINDS) + r")(?:-start)?\(")
_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\]")  # f8e4m3fn[2,3] too
_GROUPS = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[\d+,(\d+)\]<=")  # [groups,size]<=[devices]
# replica_groups=mesh['a'=8,'b'=1] {'a'}: groups over the named axes of a mesh
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def _group_size(line: str) -> int:
    """Devices per replica group of a collective's HLO line (0 when it names none)."""
    if m := _GROUPS.search(line):
        return len(m.group(1).split("},{")[0].strip("{}").split(","))
    if m := _IOTA_GROUPS.search(line):
        return int(m.group(1))
    if m := _MESH_GROUPS.search(line):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2)))
    return 0


# XLA's 8- and 4-bit floats, and 2- and 4-bit ints: a byte an element, as XLA:CPU keeps them
_FLOAT8 = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz", "f8e4m3b11fnuz", "f8e3m4",
           "f8e8m0fnu", "f4e2m1fn")  # fmt: skip
_ITEMSIZE = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    **{f"{k}{n}": 1 for k in "su" for n in (2, 4)},
    **dict.fromkeys(_FLOAT8, 1),
}


def _bytes(shape_text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(shape_text):
        n = math.prod(int(d) for d in dims.split(",") if d)
        total += n * _ITEMSIZE[dtype]
    return total


def collectives(hlo_text: str) -> list[tuple[str, int, int]]:
    """(kind, result bytes, group size) for each collective in `hlo_text`; one that XLA
    combined from several (a tuple result) counts as each of them."""
    found = []
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if not m or "-done" in line.split("=")[0]:
            continue
        size = _group_size(line)
        if m.group(2) in HLO_PIECES:  # one piece per peer, in a tuple: one collective
            found.append((m.group(2), _bytes(m.group(1)), size))
            continue
        # a combined collective has a tuple result: one entry per operand
        for shape in _SHAPE.finditer(m.group(1)):
            found.append((m.group(2), _bytes(shape.group(0)), size))
    return found


# Data movement in compiled HLO (`movement`): what XLA materialises besides the arithmetic.
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([\w\-]+)\((.*)$")
_CALLS = re.compile(r"(?:calls|body|to_apply|condition|branch_computations)=\{?%?([\w.\-]+)")
_BODY = re.compile(r"body=%?([\w.\-]+)")
_ENTRY = re.compile(r"^ENTRY\s+%?([\w.\-]+)", re.M)
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_COMPUTE = {"dot", "convolution", "custom-call", "reduce", "reduce-window", "scatter", "gather",
            "sort", "fft"}  # fmt: skip
_MOVES = ("dynamic-update-slice", "dynamic-slice", "transpose", "copy", "concatenate", "pad",
          "slice")  # fmt: skip
MOVEMENT_KINDS = ("fill", "stack", "unstack", "transpose", "copy")


def _computations(hlo_text: str) -> dict[str, list[tuple[str, str, str, str]]]:
    """{computation: [(name, shape, opcode, operands and attributes)]} of HLO text."""
    comps: dict[str, list] = {}
    current = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and (m := _COMP.match(line)):
            current = comps.setdefault(m.group(1), [])
        elif current is not None and (m := _INSTR.match(line)):
            current.append(m.groups())
        elif current and line.strip() and line.strip() != "}":
            # an instruction's attributes wrapped onto the next line (a while's
            # known_trip_count): they are still its own
            name, shape, op, rest = current[-1]
            current[-1] = (name, shape, op, f"{rest} {line.strip()}")
    return comps


def _kind(comps: dict, instr: tuple) -> tuple[str, int, str] | None:
    """(movement kind, bytes moved, the shape written) of one instruction of a
    computation that is not fused (a fusion read through its fused computation), or
    None for arithmetic."""
    name, shape, op, rest = instr
    body = [instr]
    if op == "fusion":
        body = comps.get(_CALLS.search(rest).group(1), [])
    ops = {i[2] for i in body}
    if ops & _COMPUTE or op in _COMPUTE | {"while", "call", "conditional", "tuple"}:
        return None
    shapes = {i[0]: i[1] for i in body}
    if "dynamic-update-slice" in ops:  # the update written into a (loop's) stacked buffer
        dus = next(i for i in body if i[2] == "dynamic-update-slice")
        update = re.findall(r"%([\w.\-]+)", dus[3])[1]
        written = shapes.get(update, shape)
        return "stack", _bytes(written), written
    if "dynamic-slice" in ops:
        kind = "unstack"
    elif ops <= {"broadcast", "constant", "parameter", "bitcast"} and "broadcast" in ops:
        kind = "fill"
    elif "transpose" in ops:
        kind = "transpose"
    elif ops & set(_MOVES):
        kind = "copy"
    else:
        return None
    return kind, _bytes(shape), shape


class Move(NamedTuple):
    """One data-moving instruction of compiled HLO: its kind (MOVEMENT_KINDS), the
    shape it writes (HLO text, e.g. "f32[2,8]"; a stack's update), the bytes it writes
    each time, and how many times it runs (its loops' trip counts multiplied)."""

    kind: str
    shape: str
    nbytes: int
    times: int


def _walked(comps: dict, entry: str, fusions: bool = False):
    """(computation, instruction, times it runs, kernel) of each instruction reached from
    `entry`, in program order: a while's body once with its trip count (its condition
    skipped), a call's or conditional's callees, and with `fusions` a fusion's fused
    computation (kernel "ynn" inside an XLA:CPU YNNPACK fusion, else "xla"); the loops,
    calls and fusions walked into are not yielded themselves."""

    def walk(comp: str, times: int, kernel: str):
        for instr in comps.get(comp, []):
            op, rest = instr[2], instr[3]
            if op == "while":
                n = int(m.group(1)) if (m := _TRIPS.search(rest)) else 1
                yield from walk(_BODY.search(rest).group(1), times * n, kernel)
            elif op in ("call", "conditional") or (fusions and op == "fusion"):
                inner = "ynn" if "__ynn_fusion" in rest else kernel
                for callee in _CALLS.findall(rest):
                    yield from walk(callee, times, inner)
            else:
                yield comp, instr, times, kernel

    yield from walk(entry, 1, "xla")


def moves(hlo_text: str) -> list[Move]:
    """Each instruction of compiled HLO text that moves data (`movement`'s kinds), in
    program order, a loop's body read once with its trip count in `times`."""
    comps = _computations(hlo_text)
    fills: set[str] = set()
    found: list[Move] = []
    for _, instr, times, _ in _walked(comps, _ENTRY.search(hlo_text).group(1)):
        got = _kind(comps, instr)
        if got is None:
            continue
        name, _, op, rest = instr
        kind, nbytes_, written = got
        if kind == "copy" and op == "copy" and rest.split(")")[0].lstrip("%") in fills:
            kind = "fill"
        if kind == "fill":
            fills.add(name)
        found.append(Move(kind, written, nbytes_, times))
    return found


def movement(hlo_text: str) -> dict[str, tuple[int, int]]:
    """{kind: (instructions, bytes written)} of the data movement XLA runs in compiled
    HLO text (`jitted.lower(...).compile().as_text()`), each instruction inside a loop
    counted once per iteration (XLA's known trip count): "fill" a buffer filled with one
    value (a loop's stacked outputs are zero-filled first), "stack" a value written into
    a stacked buffer (dynamic-update-slice; its update's bytes), "unstack" a slice read
    out of one (dynamic-slice), "transpose" a value whose dims XLA reorders in memory,
    "copy" any other copy, slice, pad or concatenation (a copy of a fill is a fill).
    An instruction that also does arithmetic (a dot, a reduction) is not counted;
    `moves` lists the instructions."""
    found = {k: [0, 0] for k in MOVEMENT_KINDS}
    for move in moves(hlo_text):
        found[move.kind][0] += move.times
        found[move.kind][1] += move.times * move.nbytes
    return {k: (n, b) for k, (n, b) in found.items()}


# The dots of compiled HLO (`dots`): what a step multiplies, for timing per shape.
_LAYOUT = re.compile(r"\[([\d,]*)\](?:\{([\d,]*)\})?")
_DIMS = re.compile(r"(lhs|rhs)_(batch|contracting)_dims=\{([\d,]*)\}")


class Dot(NamedTuple):
    """One dot instruction of compiled HLO: its operands' shapes and layouts (HLO's
    minor-to-major dim order; row-major `(n-1, ..., 0)` where the text gives none), the
    contracting and batch dims of each, the kernel that runs it ("ynn" inside an XLA:CPU
    YNNPACK fusion, else "xla"), and how many times it runs (its loops' trip counts)."""

    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    lhs_layout: tuple[int, ...]
    rhs_layout: tuple[int, ...]
    lhs_contracting: tuple[int, ...]
    rhs_contracting: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    kernel: str
    times: int


def _shape_layout(text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    dims, layout = _LAYOUT.search(text).groups()
    shape = tuple(int(d) for d in dims.split(",") if d)
    order = tuple(int(d) for d in layout.split(",") if d) if layout else ()
    return shape, order or tuple(range(len(shape)))[::-1]


def dots(hlo_text: str) -> list[Dot]:
    """Each dot instruction of compiled HLO text (`jitted.lower(...).compile().as_text()`),
    in program order, a fusion's read through its fused computation and a loop's body
    once with its trip count in `times`."""
    comps = _computations(hlo_text)
    found: list[Dot] = []
    entry = _ENTRY.search(hlo_text).group(1)
    for comp, (_, _, op, rest), times, kernel in _walked(comps, entry, fusions=True):
        if op != "dot":
            continue
        shapes = {i[0]: i[1] for i in comps[comp]}
        a, b = re.findall(r"%([\w.\-]+)", rest.split(")")[0])[:2]
        (la, ya), (lb, yb) = _shape_layout(shapes[a]), _shape_layout(shapes[b])
        nums = {(s, k): tuple(int(d) for d in v.split(",") if d) for s, k, v in _DIMS.findall(rest)}
        get = lambda s, k, nums=nums: nums.get((s, k), ())
        found.append(Dot(la, lb, ya, yb, get("lhs", "contracting"), get("rhs", "contracting"),
                         get("lhs", "batch"), get("rhs", "batch"), kernel, times))  # fmt: skip
    return found
