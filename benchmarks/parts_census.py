"""A census of how the zoo's models are put together (issue 42's "Done when" numbers):
`python -m benchmarks.parts_census [ROOT]` reads the source under ROOT (default: this
checkout) and prints them. Run it before and after a refactor, on either tree.

Rules (static, by reading the source with `ast`; nothing is imported from ROOT but its
models.architecture and models.families, whose records and canonical configs are counted):

- Config fields: the dataclass fields of `models.architecture.Config`, and the fields of each
  other record that models/architecture.py or models/run_settings.py defines (a dataclass or
  NamedTuple), per record.
- Family-only fields: Config fields that the canonical configs (every family module's
  NAMED, made by models.io.hub.family_config) set to a non-default value in exactly one
  family.
- Branches in the shared forward pass: in the shared files (SHARED below: the parts,
  the block, the stacks, the decoding step), each `if`/`elif` test, conditional
  expression, comprehension `if` and `and`/`or` operand that reads `<name>.<field>` of
  a Config field or property, where <name> is cfg, c or config (one per test; the
  distinct fields are listed too).
- Branches in the block: the same count over the functions that make one block, its
  parts aside (BLOCK_FUNCTIONS, in the shared files, and every function of
  models/residual.py, the compositions): the family branches the issue asks to be 0.
- "Parameter present" checks: in the same files, each `in`/`not in` comparison whose
  right side is a name among p, params, m, layer, shapes or cache and whose left side
  is a string (a literal, an f-string or a `+` of them).
- The largest parameter list: over every function and lambda in models/ (and its
  sub-folders), the count of its parameters (positional, keyword-only, *args and
  **kwargs each one; self and cls not counted); the largest few and how many exceed 6.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import sys
from pathlib import Path

# paths from the root, so that a move of models/ into folders (restructure_models.py,
# issue 42) rewrites them with every other mention of the files
SHARED = (
    "models/transformer.py",
    "models/layers/common.py",
    "models/inference/decoding.py",
    "models/layers/mla.py",
    "models/layers/moe.py",
    "models/blocks.py",
    "models/parts.py",
    "models/layers/blockwise.py",
    "models/layers/kernels.py",
    "models/layers/rope.py",
)
CFG_NAMES = {"cfg", "c", "config"}
BLOCK_FUNCTIONS = {"block", "decode_block", "_compose", "post_norm", "residual"}
PARAM_DICTS = {"p", "params", "m", "layer", "shapes", "cache"}


def records(root: Path) -> dict[str, int]:
    """Record name -> its field count, for the records of models/architecture.py (and
    models/run_settings.py where it exists)."""
    out = {}
    for name in ("models/architecture.py", "models/run_settings.py"):
        path = root / name
        if not path.exists():
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and is_record(node):
                fields = [s for s in node.body if isinstance(s, ast.AnnAssign)]
                out[node.name] = len(fields)
    return out


def is_record(node: ast.ClassDef) -> bool:
    decorated = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
    return decorated or any(ast.unparse(b) == "NamedTuple" for b in node.bases)


def config_names(root: Path) -> set[str]:
    """Config's fields and properties (what a branch on `cfg.<name>` reads)."""
    tree = ast.parse((root / "models/architecture.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    names = {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign)}
    props = {
        f.name for f in cls.body if isinstance(f, ast.FunctionDef)
        and any(ast.unparse(d) == "property" for d in f.decorator_list)
    }  # fmt: skip
    return names | props


def reads_config(expr: ast.AST, names: set[str]) -> set[str]:
    return {
        n.attr for n in ast.walk(expr)
        if isinstance(n, ast.Attribute) and n.attr in names
        and isinstance(n.value, ast.Name) and n.value.id in CFG_NAMES
    }  # fmt: skip


def tests_of(tree: ast.AST):
    """Every branch test of a module: if/elif, x if t else y, comprehension ifs, and
    each operand of and/or outside those."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If | ast.IfExp | ast.While):
            yield node.test
        elif isinstance(node, ast.comprehension):
            yield from node.ifs
        elif isinstance(node, ast.BoolOp):
            yield from node.values


def block_trees(root: Path) -> list[ast.AST]:
    """The functions that make one block (BLOCK_FUNCTIONS; all of models/residual.py)."""
    out = []
    for path in [*shared_files(root), root / "models/residual.py"]:
        if not path.exists():
            continue
        tree = ast.parse(path.read_text())
        whole = path.name == "residual.py"
        out += [
            n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
            and (whole or n.name in BLOCK_FUNCTIONS)
        ]  # fmt: skip
    return out


def branches(root: Path, names: set[str], trees=None) -> tuple[int, collections.Counter]:
    count, fields, seen = 0, collections.Counter(), set()
    if trees is None:
        trees = [ast.parse(path.read_text()) for path in shared_files(root)]
    for tree in trees:
        for test in tests_of(tree):
            if id(test) in seen or not (read := reads_config(test, names)):
                continue
            seen.update(id(n) for n in ast.walk(test))  # an and/or inside an if: once
            count += 1
            fields.update(read)
    return count, fields


def shared_files(root: Path) -> list[Path]:
    return [root / n for n in SHARED if (root / n).exists()]


def is_string(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return is_string(node.left) or is_string(node.right)
    return isinstance(node, ast.JoinedStr)


def presence_checks(root: Path) -> int:
    n = 0
    for path in shared_files(root):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare) or not is_string(node.left):
                continue
            for op, right in zip(node.ops, node.comparators, strict=True):
                is_dict = isinstance(right, ast.Name) and right.id in PARAM_DICTS
                n += isinstance(op, ast.In | ast.NotIn) and is_dict
    return n


def parameter_lists(root: Path) -> list[tuple[int, str]]:
    out = []
    for path in sorted((root / "models").rglob("*.py")):
        rel = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                names = [x for x in names if x not in ("self", "cls")]
                n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
                label = getattr(node, "name", "<lambda>")
                out.append((n, f"{rel}:{node.lineno} {label}"))
    return sorted(out, reverse=True)


def family_only(root: Path) -> list[str]:
    """Config fields that exactly one family's canonical configs set off their default."""
    sys.path.insert(0, str(root))
    from models.architecture import Config
    from models.families import NAMED
    from models.io.hub import family_config

    default = Config()
    by_field = collections.defaultdict(set)
    for name, (family, keys) in NAMED.items():
        cfg = family_config(family, keys, set(), f"<{name}>")
        for f in dataclasses.fields(Config):
            if getattr(cfg, f.name) != getattr(default, f.name):
                by_field[f.name].add(family)
    return sorted(f for f, fams in by_field.items() if len(fams) == 1)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0] if argv else Path(__file__).resolve().parents[1]).resolve()
    recs = records(root)
    print(f"records (fields): {', '.join(f'{k} {v}' for k, v in recs.items())}")
    only = family_only(root)
    print(f"family-only Config fields: {len(only)}: {', '.join(only)}")
    n, fields = branches(root, config_names(root))
    print(f"branches on Config in the shared forward pass: {n} on {len(fields)} fields")
    print("  " + ", ".join(f"{k} {v}" for k, v in fields.most_common()))
    n, fields = branches(root, config_names(root), block_trees(root))
    print(f"  of them in the block itself (block, its composition): {n} {dict(fields)}")
    print(f"parameter-present checks in the shared forward pass: {presence_checks(root)}")
    lists = parameter_lists(root)
    print(f"functions in models/ with > 6 parameters: {sum(n > 6 for n, _ in lists)}")
    for n, where in lists[:5]:
        print(f"  {n:2d}  {where}")


if __name__ == "__main__":
    main()
