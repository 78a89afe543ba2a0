"""docs/language.md is a test: its python blocks run in order, and it names every public op."""

import contextlib
import inspect
import io
import linecache
import re
import traceback
from pathlib import Path

import pytest

import namedmesh as nm
from namedmesh import random as nm_random
from namedmesh.primitive import REGISTRY

DOCS = Path(__file__).resolve().parent.parent / "docs"
DOC = DOCS / "language.md"
# Pages whose python blocks run in order, each in a fresh namespace.
RUNNABLE = [
    "language.md",
    "layouts.md",
    "lowering.md",
    "testing.md",
    "models.md",
    "finetune.md",
    "generate.md",
    "export.md",
    "zoo.md",
    "faults.md",
    "lora.md",
    "chat.md",
]

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)

# Public names of namedmesh that are plumbing rather than ops a user calls.
NOT_CHECKED = {"REGISTRY", "Aval", "Cost", "Primitive", "bind", "Eqn", "__version__"}


def _text() -> str:
    return DOC.read_text(encoding="utf-8")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, source) of each ```python block, in page order."""
    return [
        (text.count("\n", 0, m.start()) + 1, m.group(2))
        for m in FENCE.finditer(text)
        if m.group(1) == "python"
    ]


def outputs(text: str) -> dict[int, str]:
    """line of a ```python block -> the ```output block right after it: what the block
    prints, checked at test time so that printouts in the docs cannot drift."""
    fences = list(FENCE.finditer(text))
    out = {}
    for m, nxt in zip(fences, fences[1:], strict=False):
        if m.group(1) == "python" and nxt.group(1) == "output":
            out[text.count("\n", 0, m.start()) + 1] = nxt.group(2)
    return out


def _run_block(code, namespace) -> str:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        exec(code, namespace)
    return buffer.getvalue()


def inline_code(text: str) -> list[str]:
    """The `...` spans of the prose (fenced blocks removed)."""
    prose = FENCE.sub("", text)
    return re.findall(r"`([^`\n]+)`", prose)


def test_page_has_python_blocks():
    blocks = python_blocks(_text())
    assert len(blocks) >= 10
    first = blocks[0][1]
    assert "import numpy as np" in first and "import namedmesh as nm" in first


@pytest.mark.parametrize("page", RUNNABLE)
def test_python_blocks_run_in_order(page):
    """Every ```python block, exec'd in page order in one fresh namespace."""
    doc = DOCS / page
    before = set(REGISTRY)
    namespace: dict = {"__name__": "docs_" + doc.stem}
    try:
        text = doc.read_text(encoding="utf-8")
        blocks, printed = python_blocks(text), outputs(text)
        assert blocks, f"{page} has no python blocks"
        for number, (line, source) in enumerate(blocks, start=1):
            filename = f"{doc.name}:block{number}(line {line})"
            # so that a traceback shows the failing line of the block
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
            code = compile(source, filename, "exec")
            try:
                got = _run_block(code, namespace)
            except Exception as e:  # any failure, reported with its block
                tb = "".join(traceback.format_exception(e, limit=-3))
                pytest.fail(
                    f"python block {number} (line {line} of {doc.name}) raised "
                    f"{type(e).__name__}: {e}\n{tb}",
                    pytrace=False,
                )
            if line in printed:
                assert got.rstrip() == printed[line].rstrip(), (
                    f"the ```output block after python block {number} (line {line} of "
                    f"{doc.name}) is not what the block prints now:\n{got}"
                )
    finally:
        for name in set(REGISTRY) - before:  # primitives the page registers as examples
            del REGISTRY[name]


def _public_ops(module, exclude=()) -> list[str]:
    names = []
    for name, obj in vars(module).items():
        if name.startswith("_") or name in exclude or inspect.ismodule(obj):
            continue
        if inspect.isclass(obj) or callable(obj):
            names.append(name)
    return sorted(names)


def _mentioned(spans: list[str], qualified: str) -> bool:
    pattern = re.compile(r"(?<![\w.])" + re.escape(qualified) + r"(?!\w)")
    return any(pattern.search(s) for s in spans)


def test_every_public_op_is_documented():
    spans = inline_code(_text())
    missing = [n for n in _public_ops(nm, NOT_CHECKED) if not _mentioned(spans, f"nm.{n}")]
    assert not missing, f"not mentioned as `nm.<name>` in {DOC.name}: {missing}"


def test_every_random_function_is_documented():
    spans = inline_code(_text())
    own = [
        n
        for n in _public_ops(nm_random)
        if getattr(getattr(nm_random, n), "__module__", None) == nm_random.__name__
    ]
    assert "normal" in own and "key" in own
    missing = [n for n in own if not _mentioned(spans, f"nm.random.{n}")]
    assert not missing, f"not mentioned as `nm.random.<name>` in {DOC.name}: {missing}"


# What a printout of the code looks like: a plan, a report or a graph.
PRINTOUT = re.compile(r"^(\w+: \[.*\] -> |per-device flops: |graph\()", re.MULTILINE)


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_printouts_are_output_blocks(page):
    """A plan, report or graph printout shown in a page is an ```output block, which
    `test_python_blocks_run_in_order` compares with what the code prints."""
    text = (DOCS / page).read_text(encoding="utf-8")
    stale = [
        text.count("\n", 0, m.start()) + 1
        for m in FENCE.finditer(text)
        if m.group(1) != "output" and PRINTOUT.search(m.group(2))
    ]
    assert not stale, f"{page}: printouts in non-output blocks at lines {stale}"
    if page not in RUNNABLE:
        assert "```output" not in text, f"{page} has output blocks but its code is not run"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but - and _ dropped,
    spaces as dashes."""
    heads = re.findall(r"^#+ (.+)$", FENCE.sub("", text), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", [*sorted(p.name for p in DOCS.glob("*.md")), "../README.md"])
def test_links_between_pages_reach_a_page_and_heading(page):
    """Every relative link of a page (README.md included) names a file that exists and,
    after `#`, a heading of it."""
    doc = DOCS / page
    broken = []
    for target in LINK.findall(FENCE.sub("", doc.read_text(encoding="utf-8"))):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists() or (
            anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text())
        ):
            broken.append(target)
    assert not broken, f"{page}: links to nothing: {broken}"
