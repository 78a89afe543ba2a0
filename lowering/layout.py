"""Layout rules: which mesh axes split which tensor dims.

Rules are ordered pairs dim -> mesh axes, written `"batch:rows;d_ff:cols"`
(Mesh-TensorFlow's syntax) or `"batch:rows,cols"` for a dim over two axes, or
given as a dict or a list of pairs. For one tensor, dims take their axes in rule
order and an axis already taken by an earlier dim of that tensor is skipped;
with `strict=True` such a conflict is an error instead.

Rule order is the lowering's default, not its last word: where the rules give one
mesh axis to two dims of an einsum, one of them held by every operand and the
result (experts, in an expert FFN), the einsum is computed in whichever of the rule
order and "that dim first" moves the fewest bytes (lowering/rules/einsum.py `einsum_rule`);
a value whose own dims conflict (`Layout.conflicts`), made by an einsum or an
elementwise op, keeps the layout it was computed in. Inputs and outputs of a
lowered program always take the rule order.

Beside its rules a layout string may carry options, `name=value`:
`"layers:stage;batch:data;microbatches=8"` cuts the batch of a pipelined scan (one whose
scanned dim a rule splits, lowering/pipeline.py) into 8 microbatches;
`microbatch_dim=NAME` names the carry dim cut (default `batch`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec

from lowering.caches import memo
from namedmesh.checks import did_you_mean
from namedmesh.errors import LayoutError, fmt_dims
from namedmesh.layout_rules import format_options, format_rules, parse_rules, split_options

# A value's layout: for each of its dims, the mesh axes splitting it (empty: replicated).
ValueLayout = tuple[tuple[str, ...], ...]


class Layout:
    """Ordered rules dim -> mesh axes; see the module docstring."""

    def __init__(
        self, rules=(), strict: bool = False, shared: bool = False, options: dict | None = None
    ):
        """`rules` as in the module docstring, a string's `name=value` options among them.
        `strict`: a mesh axis that would split two dims of one value is an error.
        `shared`: the layout serves several programs (a train and an eval program, a
        whole model zoo), so a rule may name a dim that a given program lacks; otherwise
        `lower` rejects such a rule as a typo. `options`: more options, as a dict."""
        rules, parsed = split_options(rules)
        self.rules = parse_rules(rules)
        given = ";".join(f"{k}={v}" for k, v in (options or {}).items())
        self.options = {**parsed, **split_options(given)[1]}  # checked as a string's are
        self.strict = bool(strict)
        self.shared = bool(shared)

    def _text(self) -> str:
        """The rules and options as one string, `"layers:stage;microbatches=8"`."""
        return ";".join(filter(None, (format_rules(self.rules), format_options(self.options))))

    def __str__(self) -> str:
        """The rules as `"batch:rows;d_ff:cols"`; no rules print as `(replicated)`."""
        return self._text() or "(replicated)"

    def __repr__(self) -> str:
        rules = self._text()
        flags = (", strict=True" if self.strict else "") + (", shared=True" if self.shared else "")
        return f"Layout({rules!r}{flags})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Layout) and (self.rules, self.strict, self.options) == (
            other.rules,
            other.strict,
            other.options,
        )

    def __hash__(self) -> int:
        return hash((self.rules, self.strict, tuple(sorted(self.options.items()))))

    def check_dims(self, dims, what: str = "the program") -> None:
        """LayoutError for a rule naming a dim none of `dims` is (unless `shared`): listing
        `what`'s dims and the closest name. A rule for a missing dim does nothing, so a
        typo would otherwise run replicated without a word."""
        if self.shared:
            return
        dims = set(dims)
        for dim, axes in self.rules:
            if dim not in dims:
                raise LayoutError(
                    f"rule {dim}:{','.join(axes)} of layout {self} names dim {dim!r}, which no "
                    f"value of {what} has{did_you_mean(dim, dims) or '.'} "
                    f"{what[0].upper() + what[1:]}'s dims: {sorted(dims)}. "
                    "(Layout(..., shared=True) allows rules for dims a program lacks.)"
                )

    def check(self, mesh) -> None:
        """LayoutError for a rule naming a mesh axis the mesh lacks."""
        if any(a not in mesh.sizes for _, axes in self.rules for a in axes):
            check_axes(self.rules, mesh, f"layout {self}")  # the message, only when needed

    def of(
        self, dims: Sequence[str], shape: Sequence[int], mesh, what: str = "tensor", padded=()
    ) -> ValueLayout:
        """The layout of a value with `dims` and `shape` under these rules on `mesh`;
        LayoutError when a dim's size is not divisible by its mesh axes, but for a dim of
        `padded` (the stack of uneven pipeline stages, which the program pads itself:
        namedmesh/uneven.py), left unsplit then."""
        self.check(mesh)
        layout = self.assign(dims, shape, what)
        if padded:
            sizes = mesh.sizes
            layout = tuple(
                () if d in padded and n % math.prod(sizes[a] for a in axes) else axes
                for d, n, axes in zip(dims, shape, layout, strict=True)
            )
        check_divisible(layout, dims, shape, mesh, what, self)
        return layout

    def conflicts(self, dims: Sequence[str], sizes: Mapping[str, int] | None = None) -> tuple:
        """The dims of `dims`, in rule order, whose rules share a mesh axis with the rule of
        another of `dims` (mesh axes of size 1 in `sizes`, if given, split nothing and
        are left out)."""
        relevant = tuple(r for r in self.rules if r[0] in dims)  # all that decides it
        return _conflicts(relevant, tuple(sizes.items()) if sizes is not None else None)

    def first(self, dim: str) -> Layout:
        """These rules with `dim`'s rule moved to the front (not strict): `dim` takes its
        mesh axes before any dim that shares them."""
        # kept: asked of the same dim by every einsum that shares its axis, per candidate
        known = self.__dict__.setdefault("_first", {})
        if dim not in known:
            first = [r for r in self.rules if r[0] == dim]
            known[dim] = Layout(first + [r for r in self.rules if r[0] != dim])
        return known[dim]

    def assign(self, dims: Sequence[str], shape=None, what: str = "tensor") -> ValueLayout:
        """The mesh axes each of `dims` takes, in rule order; sizes not checked, but for
        a dim of size 0 in `shape`, left unsplit: it has nothing to split, and XLA
        rejects a collective over a dim of size 0 (an all_gather or all_to_all that
        moved it would be a raw verifier error)."""
        dims = tuple(dims)
        # the rules of these dims alone decide it: kept by them, as many candidate
        # layouts that auto_layout costs share them
        relevant = tuple(r for r in self.rules if r[0] in dims)
        layout, conflict = _assign(dims, relevant, self.strict)
        if conflict:
            a, first, dim = conflict
            shown = fmt_dims(dims, shape) if shape is not None else fmt_dims(dims)
            raise LayoutError(
                f"{what} {shown}: mesh axis {a!r} would split both {first!r} and "
                f"{dim!r} (strict layout {self})"
            )
        if shape is not None and 0 in shape:
            layout = tuple(() if n == 0 else a for n, a in zip(shape, layout, strict=True))
        return layout


@memo()  # the rules of one value's dims recur in many candidate layouts
def _conflicts(rules: tuple, sizes: tuple | None) -> tuple:
    """The dims of `rules` whose mesh axes (of size over 1 in `sizes` items, if given)
    another of them shares, in rule order."""
    mesh = dict(sizes) if sizes is not None else None
    used = lambda axes: {a for a in axes if mesh is None or mesh[a] > 1}
    mapped = [(d, used(axes)) for d, axes in rules]
    return tuple(d for d, a in mapped if any(a & b for e, b in mapped if e != d))


@memo()
def _assign(dims: tuple, rules: tuple, strict: bool) -> tuple[ValueLayout, tuple | None]:
    """(the mesh axes each of `dims` takes under `rules`, in rule order; None), or under
    `strict` (None, (mesh axis, the dim that took it, the dim that wants it too))."""
    taken: dict[str, str] = {}
    split = {d: () for d in dims}
    for dim, axes in rules:
        if dim not in split:
            continue
        free = tuple(a for a in axes if a not in taken)
        if len(free) < len(axes) and strict:
            a = next(a for a in axes if a in taken)
            return None, (a, taken[a], dim)
        taken.update((a, dim) for a in free)
        split[dim] = free
    return tuple(split[d] for d in dims), None


def check_axes(rules, mesh, where: str) -> None:
    """LayoutError for the first of `rules` (parsed (dim, axes) pairs) naming a mesh axis
    `mesh` lacks, said of `where` (the layout or constraint that holds the rule), with
    the closest axis name."""
    for dim, axes in rules:
        unknown = [a for a in axes if a not in mesh.sizes]
        if unknown:
            hint = did_you_mean(unknown[0], mesh.sizes) or "."
            raise LayoutError(
                f"{where}: rule {dim}:{','.join(axes)} names mesh axis {unknown[0]!r}, which "
                f"{mesh} lacks{hint} Its axes: {list(mesh.sizes)}."
            )


def check_divisible(layout: ValueLayout, dims, shape, mesh, what: str, rules=None) -> None:
    """LayoutError for a dim whose size its mesh axes' product does not divide."""
    for i, axes in enumerate(layout):  # (indexes: zip's strict= costs more than this)
        d, n = dims[i], shape[i]
        k = math.prod(mesh.sizes[a] for a in axes)
        if n % k:
            by = f" (rule {d}:{','.join(axes)} of {rules!r})" if rules is not None else ""
            raise LayoutError(
                f"{what} {fmt_dims(dims, shape)}: dim {d!r} of size {n} is not divisible by "
                f"mesh axes {axes} of total size {k}{by}"
            )


def partition_spec(layout: ValueLayout) -> PartitionSpec:
    """The jax PartitionSpec of a value layout."""
    return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else a for a in layout))


def local_shape(layout: ValueLayout, shape: Sequence[int], mesh) -> tuple[int, ...]:
    """The per-device shard shape of a value of global `shape` with `layout`."""
    try:
        return _local_shape(tuple(layout), tuple(shape), tuple(mesh.sizes.items()))
    except TypeError:  # a layout of lists, which does not hash
        return _local_shape.__wrapped__(layout, shape, tuple(mesh.sizes.items()))


@memo()  # asked of the same layouts and shapes by every candidate
def _local_shape(layout: ValueLayout, shape: tuple, sizes: tuple) -> tuple[int, ...]:
    mesh = dict(sizes)
    split = zip(shape, layout, strict=True)
    return tuple(n // math.prod(mesh[a] for a in axes) for n, axes in split)
