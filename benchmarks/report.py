"""What every benchmark writes with its figures: the machine, the command that made them,
markdown tables, and its own section of docs/benchmarks.md (replaced on a rerun)."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from pathlib import Path

PAGE_HEAD = "# Benchmarks\n\nEvery figure on this page is made by the command shown with it.\n\n"


FIELDS = (
    "bench",
    "case",
    "layout",
    "mesh",
    "metric",
    "namedmesh",
    "minimum",
    "gspmd",
    "hand",
    "ratio_to_min",
    "ratio_to_gspmd",
    "ratio_to_hand",
)  # fmt: skip  -- one results row (benchmarks/results/<date>.json)


def row(bench, case, layout, mesh, metric, namedmesh, minimum=None, gspmd=None, hand=None):
    """A results row; each ratio is namedmesh over the other figure (4 digits), None where
    that figure is absent or zero."""
    ratio = lambda other: None if not other else round(namedmesh / other, 4)
    return dict(zip(FIELDS, (bench, case, layout, mesh, metric, namedmesh, minimum, gspmd, hand,
                             ratio(minimum), ratio(gspmd), ratio(hand)), strict=True))  # fmt: skip


def heading(section: str, made_by: str, info: dict) -> list[str]:
    """A section's first lines: its heading, what made it, and the machine."""
    machine_line = "Machine: " + "; ".join(f"{k}: {v}" for k, v in info.items()) + "."
    return [section, "", made_by, "", machine_line, ""]


def machine() -> dict[str, str]:
    """The CPU, OS, core counts and the versions of Python, NumPy and jax."""
    import jax
    import numpy as np

    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), ""
            )
    except OSError:
        model = ""
    try:
        usable = str(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        usable = "n/a"
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "platform.processor()": repr(platform.processor()),
        "platform.platform()": platform.platform(),
        "os.cpu_count()": str(os.cpu_count()),
        "usable CPUs": usable,
        "Python": platform.python_version(),
        "NumPy": np.__version__,
        "jax": jax.__version__,
    }


def command(module: str, argv: list[str]) -> str:
    """The shell command that runs `python -m module argv` with this interpreter."""
    exe = Path(sys.executable)
    try:
        exe_s = str(exe.relative_to(Path.cwd()))
    except ValueError:
        exe_s = str(exe)
    return shlex.join([exe_s, "-m", module, *argv])


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def replace_section(text: str, heading: str, new: str) -> str:
    """`text` with the section under `heading` (up to the next `#` or `##` heading outside
    code fences, or the end) replaced by `new`, or `new` appended when absent."""
    lines = text.splitlines(keepends=True)
    fence, heads = False, []
    for i, ln in enumerate(lines):
        if ln.lstrip().startswith(("```", "~~~")):
            fence = not fence
        elif not fence and ln.startswith("#"):
            heads.append((i, ln.rstrip()))
    start = next((i for i, h in heads if h == heading), None)
    if start is None:
        return text.rstrip("\n") + "\n\n" + new if text.strip() else PAGE_HEAD + new
    end = next((i for i, h in heads if i > start and h.startswith(("## ", "# "))), len(lines))
    rest = "".join(lines[end:])
    return "".join(lines[:start]) + new + ("\n" + rest if rest else "")


def write_section(path: Path, heading: str, new: str) -> None:
    """Replace (or add) the section under `heading` of the markdown file at `path`."""
    path = Path(path)
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(replace_section(text, heading, new), encoding="utf-8")
