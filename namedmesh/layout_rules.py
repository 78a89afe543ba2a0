"""Parsing layout rules, mesh-independent: shared by `lowering.Layout` and `nm.constrain`,
so that a malformed rule fails at the call that wrote it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from namedmesh.checks import did_you_mean
from namedmesh.errors import LayoutError

# Ordered rules: (dim, the mesh axes that split it, major to minor).
Rules = tuple[tuple[str, tuple[str, ...]], ...]


def _pairs(rules) -> list:
    if isinstance(rules, str):
        pairs = []
        for part in filter(None, (p.strip() for p in rules.split(";"))):
            dim, sep, axes = part.partition(":")
            if not sep or not dim.strip() or not axes.strip() or ":" in axes:
                hint = "; rules are separated by ';'" if ":" in axes else ""
                raise LayoutError(
                    f"malformed rule {part!r} in {rules!r}: expected 'dim:axis[,axis]'{hint}"
                )
            pairs.append((dim.strip(), tuple(a.strip() for a in axes.split(","))))
        return pairs
    if isinstance(rules, Mapping):
        return list(rules.items())
    if isinstance(rules, Sequence):
        return list(rules)
    raise LayoutError(f"layout rules must be a string, dict or list of pairs, got {rules!r}")


def _axes(dim: str, axes) -> tuple[str, ...]:
    """A rule's mesh axes: one axis name or a list/tuple of them, each once."""
    if isinstance(axes, str):
        axes = (axes,)
    elif isinstance(axes, list | tuple):
        axes = tuple(axes)
    else:
        raise LayoutError(
            f"rule for dim {dim!r}: mesh axes must be an axis name or a list of axis names, "
            f"got {axes!r}"
        )
    if not axes or not all(isinstance(a, str) and a for a in axes) or len(set(axes)) != len(axes):
        raise LayoutError(
            f"malformed rule for dim {dim!r}: mesh axes {axes!r} (expected distinct, "
            "non-empty axis names)"
        )
    return axes


# Options a layout string may carry beside its rules, `name=value` (docs/layouts.md,
# "Pipelines"): the microbatches of a pipelined scan and the carry dim they cut, its
# schedule (gpipe or circular) and a circular schedule's repeats.
OPTIONS = {"microbatches": int, "microbatch_dim": str, "schedule": str, "repeats": int}


def split_options(rules) -> tuple:
    """(rules, options): a rule string's `name=value` parts (e.g. `microbatches=8` in
    `"layers:stage;batch:data;microbatches=8"`) taken out as a dict of OPTIONS, the rest
    left as given. LayoutError naming the part for an unknown option or a bad value."""
    if not isinstance(rules, str):
        return rules, {}
    kept, options = [], {}
    for part in filter(None, (p.strip() for p in rules.split(";"))):
        name, sep, value = part.partition("=")
        if not sep or ":" in part:
            kept.append(part)
            continue
        name, value = name.strip(), value.strip()
        if name not in OPTIONS:
            raise LayoutError(
                f"unknown layout option {part!r} in {rules!r}{did_you_mean(name, OPTIONS) or '.'} "
                f"Options: {sorted(OPTIONS)}"
            )
        options[name] = _option(name, value, rules)
    return ";".join(kept), options


def _option(name: str, value: str, rules: str):
    if OPTIONS[name] is int:
        if not value.isdigit() or int(value) < 1:
            raise LayoutError(
                f"layout option {name}={value!r} in {rules!r}: expected a positive integer"
            )
        return int(value)
    if not value.isidentifier():
        raise LayoutError(f"layout option {name}={value!r} in {rules!r}: expected a name")
    return value


def format_options(options: Mapping) -> str:
    """`"microbatches=8"`: options in their string form, in OPTIONS' order."""
    return ";".join(f"{k}={options[k]}" for k in OPTIONS if k in options)


def parse_rules(rules) -> Rules:
    """Rules given as `"batch:rows;d_ff:cols"`, a dict dim -> axis or axes, or a list of
    (dim, axes) pairs, as ordered (dim, axes) pairs; LayoutError naming the rule and the
    value at fault for anything else, and for a dim mapped twice."""
    out = []
    for pair in _pairs(rules):
        if (
            isinstance(pair, str)
            or not (isinstance(pair, Sequence) and len(pair) == 2)
            or not (isinstance(pair[0], str) and pair[0])
        ):
            raise LayoutError(f"malformed rule {pair!r}: expected (dim, mesh axes)")
        out.append((pair[0], _axes(*pair)))
    dims = [d for d, _ in out]
    dup = sorted({d for d in dims if dims.count(d) > 1})
    if dup:
        raise LayoutError(f"dim(s) {dup} are mapped by more than one rule in {rules!r}")
    return tuple(out)


def format_rules(rules: Rules) -> str:
    """`"batch:rows;d_ff:cols"`: the string form of parsed rules."""
    return ";".join(f"{d}:{','.join(a)}" for d, a in rules)
