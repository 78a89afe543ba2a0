"""Which parameters a run trains: all, all but those `--freeze PATTERN` names, or with
LoRA only the adapters. A frozen parameter is not differentiated and has no optimizer
state; `split` and `join` cut a parameter tree into the trained and frozen parts and
put it back together.

Paths are the checkpoint's (`layers/attn/q`, `embed`); a pattern is a glob
(`layers/attn/*`) or, failing that, a regular expression matched against the whole
path (`layers/(attn|ffn)/w.*`).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable

from namedmesh.errors import ParameterError


class FreezeError(ParameterError):
    """A --freeze pattern that matches no parameter, or that leaves none to train."""


def paths(tree: dict, prefix: str = "") -> list[str]:
    """Every leaf's path in a nested dict (of Params or Tensors), sorted."""
    out = []
    for k in sorted(tree):
        path = f"{prefix}/{k}" if prefix else k
        out += paths(tree[k], path) if isinstance(tree[k], dict) else [path]
    return out


def matches(pattern: str, path: str) -> bool:
    """Whether `path` matches `pattern` as a glob, or as a regular expression whole."""
    if fnmatch.fnmatchcase(path, pattern):
        return True
    try:
        return re.fullmatch(pattern, path) is not None
    except re.error:
        return False


def chooser(all_paths: list[str], freeze=(), only: Callable[[str], bool] | None = None):
    """The predicate path -> trained of a run: `only`'s paths (all when None) less those
    a `freeze` pattern matches; None when every parameter trains. FreezeError naming a
    pattern that matches no parameter, or when nothing is left to train."""
    frozen = set()
    for pattern in freeze:
        hit = {p for p in all_paths if matches(pattern, p)}
        if not hit:
            shown = ", ".join(all_paths[:6]) + (", ..." if len(all_paths) > 6 else "")
            raise FreezeError(
                f"--freeze {pattern}: matches no parameter (a glob or regular expression on "
                f"paths like {shown})"
            )
        frozen |= hit
    trained = {p for p in all_paths if (only is None or only(p)) and p not in frozen}
    if not trained:
        raise FreezeError(
            f"--freeze {' '.join(freeze)}: leaves no parameter to train (of {len(all_paths)})"
        )
    return None if len(trained) == len(all_paths) else trained.__contains__


def split(tree: dict, trained: Callable[[str], bool] | None, prefix: str = ""):
    """(the trained leaves, the frozen ones) of `tree`, each a nested dict of the same
    nesting without the other's leaves (nor dicts left empty); (tree, {}) for None."""
    if trained is None:
        return tree, {}
    on, off = {}, {}
    for k, v in tree.items():
        path = f"{prefix}/{k}" if prefix else k
        if isinstance(v, dict):
            a, b = split(v, trained, path)
            if a:
                on[k] = a
            if b:
                off[k] = b
        elif trained(path):
            on[k] = v
        else:
            off[k] = v
    return on, off


def join(a: dict, b: dict) -> dict:
    """The tree whose leaves are `a`'s and `b`'s (`split`'s inverse)."""
    if not b:
        return a
    out = dict(a)
    for k, v in b.items():
        out[k] = join(a[k], v) if k in a and isinstance(v, dict) else v
    return out
