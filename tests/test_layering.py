"""The import floors of the house, read from the source (ast), so they cannot slip back.

Bottom to top: namedmesh's language (every module of `namedmesh` but `namedmesh.testing`)
< `lowering` < `models`; `namedmesh.testing` stands above `lowering` (it lowers programs
to check them) and below `models`. A floor imports only from the floors below it, inside
a function too. Inside a package no module imports a module that imports it back, at
module level or inside a function (a circle loads only in one order), and no module
imports another's private (`_name`) helper.
"""

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("namedmesh", "lowering", "models")
FLOORS = ("namedmesh", "lowering", "namedmesh.testing", "models")  # bottom to top


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {
        module_name(p): ast.parse(p.read_text(), str(p))
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
    }


MODULES = modules()


def target(node: ast.ImportFrom, importer: str) -> str:
    """The module a `from ... import` reads, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    is_pkg = (ROOT / Path(*base) / "__init__.py").exists()
    base = base[: len(base) - node.level + is_pkg]
    return ".".join(base + ([node.module] if node.module else []))


def imports(tree: ast.Module, importer: str, top_only: bool):
    """(module imported, name or None, line, at module level) for each import in `tree`;
    `from pkg import mod` reads the module pkg.mod where there is one."""
    top = {id(n) for n in tree.body} | {
        id(n) for stmt in tree.body if isinstance(stmt, ast.If | ast.Try) for n in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        at_top = id(node) in top
        if top_only and not at_top:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None, node.lineno, at_top
        elif isinstance(node, ast.ImportFrom):
            mod = target(node, importer)
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in MODULES:
                    yield sub, None, node.lineno, at_top
                else:
                    yield mod, a.name, node.lineno, at_top


def floor(module: str) -> str | None:
    """The floor `module` belongs to: the longest of FLOORS it is in."""
    found = [f for f in FLOORS if module == f or module.startswith(f + ".")]
    return max(found, key=len) if found else None


def test_each_floor_imports_only_from_the_floors_below_it():
    wrong = []
    for name, tree in MODULES.items():
        here = FLOORS.index(floor(name))
        for mod, _, line, _ in imports(tree, name, top_only=False):
            there = floor(mod)
            if there is not None and FLOORS.index(there) > here:
                wrong.append(f"{name}:{line} imports {mod} ({there} is above {floor(name)})")
    assert wrong == []


def circles(package: str) -> list[list[str]]:
    """The import circles among `package`'s modules (the package itself included), each a
    strongly connected set of two or more, counting imports inside functions too: a
    circle loads in one order only, and one closed inside a function hides it."""
    graph = {
        name: {m for m, _, _, _ in imports(tree, name, top_only=False) if m in inside}
        for inside in [{n for n in MODULES if n == package or n.startswith(package + ".")}]
        for name, tree in MODULES.items()
        if name in inside
    }
    index, low, stack, found = {}, {}, [], []

    def visit(m):  # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in sorted(graph[m]):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            part = stack[stack.index(m) :]
            del stack[stack.index(m) :]
            if len(part) > 1:
                found.append(sorted(part))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return found


@pytest.mark.parametrize(
    "package",
    [
        "namedmesh",
        "lowering",
        "models",
    ],
)
def test_no_import_circle_including_imports_inside_functions(package):
    assert circles(package) == []


def test_the_circle_check_sees_imports_inside_functions(monkeypatch):
    """A circle closed only inside a function (as tensor.py's import of structural
    once closed one through eager.py) is found."""
    code = "def f():\n    from namedmesh import structural\n"
    tree = ast.parse(code)
    monkeypatch.setitem(MODULES, "namedmesh.tensor", ast.Module(
        MODULES["namedmesh.tensor"].body + tree.body, []))  # fmt: skip
    assert any("namedmesh.tensor" in c and "namedmesh.structural" in c
               for c in circles("namedmesh"))  # fmt: skip


def test_no_private_name_is_imported_across_modules():
    wrong = [
        f"{name}:{line} imports {mod}.{what}"
        for name, tree in MODULES.items()
        for mod, what, line, _ in imports(tree, name, top_only=False)
        if what and what.startswith("_") and not what.startswith("__") and floor(mod)
    ]
    assert wrong == []


@pytest.mark.parametrize("first", ["namedmesh.einsum"])
def test_the_language_loads_alone_whatever_is_imported_first(first):
    """A fresh interpreter that imports `first` before anything else gets the whole
    language (Tensor's operators bound) and not the lowering."""
    code = (
        f"import {first}, sys\n"
        "import namedmesh as nm, numpy as np\n"
        "t = nm.tensor(np.arange(6.0).reshape(2, 3), 'a b')\n"
        "assert ((1 - t) @ t).item() == -40.0 and (t * 2).sum('a').dims == ('b',)\n"
        "assert 'lowering' not in sys.modules and 'models' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def documented_moves() -> list[tuple[str, str]]:
    """(old, new) of each module docs/models.md's table says moved and still imports from
    its old path (restructure_models.py writes the table, issue 42)."""
    text = (ROOT / "docs" / "models.md").read_text()
    return re.findall(r"^\| `(models[\w.]*)` \| `(models[\w.]*)` \| yes \|$", text, re.M)


def test_a_documented_module_that_moved_still_imports_from_its_old_path():
    """Users' code keeps working (issue 42, item 7): each public name of a moved module
    is, from its old path, the very object of its new home."""
    for old, new in documented_moves():
        before, after = importlib.import_module(old), importlib.import_module(new)
        names = [n for n in dir(after) if not n.startswith("_")]
        assert names and all(getattr(before, n) is getattr(after, n) for n in names), old
