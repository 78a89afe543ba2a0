"""Reading collectives out of compiled HLO text, to hold the plan against what XLA runs."""

from __future__ import annotations

import math
import re

from lowering.ops import HLO_KINDS as KINDS
from lowering.ops import HLO_PIECES

_LINE = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(KINDS) + r")(?:-start)?\(")
_SHAPE = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
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
