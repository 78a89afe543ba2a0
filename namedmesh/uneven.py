"""Uneven pipeline stages: a scan of L iterations over a dim that a layout splits into S
stages where S does not divide L (DeepSeek-V3's 61 layers on 16 stages) runs as a scan
of S * ceil(L/S) iterations, its stack padded inside the program.

The lowering (`lower`) traces a program under `scan_stages({dim: (axes, S)})`; a
`scan` over such a dim whose length S does not divide then deals its L iterations to
the S stages as `lowering.stages.assign_stages` does (sizes differ by at most one, the
larger stages first) and fills each stage's block of K = ceil(L/S) with copies of the
stage's last layer, flagged not real. A padded iteration is the identity: the body's
carry is replaced by the one it was given (`where` on the flag), so its values and the
gradients of its inputs (zero: its results are dropped) do not change the step; lowered,
it is skipped (`Masked`: a jax.lax.cond on the flag per slot runs no layer work, forward
or backward, so a stage's tick costs its real layers alone). The
stack is padded by slices and a concat of the scanned inputs, whose transposes drop the
pad's gradients, and the ys are sliced back to the L real iterations. A stack of fewer
layers than stages (DeepSeek-V3's 3 dense layers on 16) puts one on each of the first
stages; the others hold only pads, which pass the carry through.

Where the stack comes in L long, it is whole on every stage device (L does not split over
S) and its gradients are all-reduced over the stages. A `PaddedStack` (`pad_stacks`) is
the stack already padded, S * K long: it splits over the stages as an even stack does, so
each stage device holds only its K layers and their gradients stay on it. The program
still sees the L-long stack (`viewed`: a gather of the real layers, dropped from the
graph where only the scan reads it), and the scan runs on the padded stack itself. The
trainer keeps its parameters and optimizer state padded; `unpad_stacks` gives the L-long
view a checkpoint or a user reads. The stacks of a chain (nm.scan_chain, namedmesh/chain.py:
one pipeline over consecutive stacks) are padded by the chain's deal (`pad_stacks`'
`chain`, `chain_slots`): stack i S * K_i long, K_i the most layers of it a stage holds."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from namedmesh.avals import TRACES
from namedmesh.creation import tensor
from namedmesh.elementwise import astype, where
from namedmesh.errors import LayoutError, ParameterError
from namedmesh.structural import gather, rename
from namedmesh.tensor import Tensor

# ({dim: (mesh axes, stages)} of the scans being traced, the dims padded so far, {the Var of
# an L-long view: its PaddedStack}, {(dim, padded length): its Deal}); empty outside `lower`
_STAGES: contextvars.ContextVar[tuple] = contextvars.ContextVar(
    "scan_stages", default=({}, set(), {}, {})
)


@contextlib.contextmanager
def scan_stages(stages: dict):
    """Within it, a `scan` over a dim of `stages` ({dim: (mesh axes, S)}) whose length S
    does not divide is padded to S equal stages (this module's docstring). Yields the
    set of dims padded, filled as the scans are traced."""
    padded: set = set()
    token = _STAGES.set((dict(stages), padded, {}, {}))
    try:
        yield padded
    finally:
        _STAGES.reset(token)


def uneven_stages(dim: str, length: int) -> int:
    """The stages S a scan of `length` over `dim` is padded to, or 0 when it is not
    (no stages for `dim`, or S divides `length`). Fewer iterations than stages (a model's
    short stack, DeepSeek-V3's 3 dense layers on 16 stages) take one stage each, the
    first ones; the stages after hold only pads, which pass the carry through."""
    stages, padded = _STAGES.get()[:2]
    _, s = stages.get(dim, ((), 1))
    if s <= 1 or length % s == 0:
        return 0
    padded.add(dim)
    return s


def splits_of(dim: str) -> int:
    """The ways the layout being lowered splits `dim` (any dim a rule splits; a scan's
    over it would run that many stages), within `scan_stages`; 1: none, or outside."""
    return _STAGES.get()[0].get(dim, ((), 1))[1]


def padded_scan(scan, f, init, xs, dim: str, length: int, stages: int, **kw):
    """`scan(f, init, xs, dim, **kw)` run as `stages` equal blocks of ceil(L/S)
    iterations, the padded ones the identity (this module's docstring)."""
    k = math.ceil(length / stages)
    src, real, at = chain_slots((length,), stages)  # slot s*K + j: the stage's layer j

    def pad(x):
        held = held_stack(x)  # a view of a PaddedStack: itself
        if held is not None and held.padding == (dim, (length,), 0, stages):
            return held.tensor
        return _taken(x, dim, src)

    padded = tree_map(pad, xs)
    flags = tensor(real, (dim,))
    record(dim, stages * k, Deal(tuple(chain_deal((length,), stages)), (k,)))
    carry, ys = scan(masked(f), init, (padded, flags), dim, **kw)
    return carry, tree_map(lambda y: _taken(y, dim, at), ys)


@dataclasses.dataclass(frozen=True)
class Deal:
    """The real layers of a padded pipeline: per stage its layers of each stack (in
    order), and the layer slots per stage each stack takes (`slots[i]` >= every stage's
    `counts[s][i]`; a slot without a layer is a pad: the identity, skipped where lowered)."""

    counts: tuple[tuple[int, ...], ...]
    slots: tuple[int, ...]
    names: tuple[str, ...] | None = None  # the stacks' (nm.scan_chain's `names`), for `words`

    def pads(self, stage: int) -> int:
        return sum(self.slots) - sum(self.counts[stage])

    @property
    def pad_share(self) -> float:
        """The share of the stages' layer slots that are pads (skipped: no layer work)."""
        total = len(self.counts) * sum(self.slots)
        return 1 - sum(map(sum, self.counts)) / total

    @property
    def idle_share(self) -> float:
        """The share of the stages' layer time idle, pads skipped: each stage runs its
        real layers a tick and waits for the stage of the most (what a plan charges)."""
        most = max(map(sum, self.counts))
        return 1 - sum(map(sum, self.counts)) / (len(self.counts) * most) if most else 0.0

    def words(self, names=None) -> str:
        """Each stage's real layers and pads in words, runs of like stages together:
        "stage 0: layers 0-3 (3 dense + 1 MoE); stages 13-15: 3 layers + 1 pad each"."""
        runs, first = [], 0
        for s, counts in enumerate(self.counts):
            n = sum(counts)
            key = (counts, self.pads(s))
            if runs and runs[-1][0] == key:
                runs[-1][2] = s
            else:
                runs.append([key, s, s, first])
            first += n
        return "; ".join(_run_words(*r, names) for r in runs)


def _run_words(key, a: int, b: int, first: int, names) -> str:
    """One run of like stages `a`..`b` (the first's layers from `first`), in words."""
    counts, pads = key
    n = sum(counts)
    where = f"stage {a}" if a == b else f"stages {a}-{b}"
    if a == b:
        held = f"layers {first}-{first + n - 1}" if n > 1 else f"layer {first}" if n else "no layer"
    else:
        held = f"{n} layers each" if n != 1 else "1 layer each"
        held = f"layers {first}-{first + n * (b - a + 1) - 1}, {held}" if n else "no layers"
    kinds = [f"{c} {names[i] if names else f'of stack {i}'}" for i, c in enumerate(counts) if c]
    if len(counts) > 1 and kinds:
        held += f" ({' + '.join(kinds)})"
    if pads:
        held += f" + {pads} pad{'s' if pads > 1 else ''}" + (" each" if a != b else "")
    return f"{where}: {held}"


def record(dim: str, length: int, how: Deal) -> None:
    """Note that the scan over `dim` of `length` iterations (padded) runs `how`'s deal,
    for the pipeline's report (`recorded`); the stacks along `dim` then come in whole
    (not split over the stages: the padded scan deals them itself)."""
    _STAGES.get()[1].add(dim)
    _STAGES.get()[3][(dim, length)] = how


def recorded(dim: str, length: int) -> Deal | None:
    """The Deal of the padded scan over `dim` of `length` iterations traced within
    `scan_stages`, or None (an even stack, or outside it)."""
    return _STAGES.get()[3].get((dim, length))


def chain_deal(lengths, stages: int) -> list[tuple[int, ...]]:
    """The layers of consecutive stacks of `lengths` dealt to `stages` stages, each
    stage's layers per stack: sizes differ by at most one, the larger stages first
    (lowering.stages.assign_stages; fewer layers than stages: one each on the first).
    One stack (lengths (L,)): each stage's (layers,), as `padded_scan` runs them."""
    total = sum(lengths)
    base, extra = divmod(total, stages)
    sizes = [base + 1] * extra + [base] * (stages - extra)
    bounds = np.cumsum([0, *lengths])
    out, first = [], 0
    for size in sizes:
        last = first + size
        out.append(tuple(int(max(0, min(last, b) - max(first, a)))
                         for a, b in zip(bounds[:-1], bounds[1:], strict=True)))  # fmt: skip
        first = last
    return out


def chain_slots(lengths, stages: int, i: int = 0):
    """(src, real, at) of stack i of the chain of stacks of `lengths` dealt to `stages`
    (`chain_deal`), each stage taking K slots of it, the most any stage holds: the layer
    each of its S*K slots holds (a pad: its stage's last, or the stack's nearest),
    whether it is real, and each real layer's slot. One stack (lengths (L,)): K =
    ceil(L/S), `padded_scan`'s padding."""
    counts = chain_deal(lengths, stages)
    k, length = max(c[i] for c in counts), lengths[i]
    src, real, at, first = [], [], [], 0
    for s, c in enumerate(counts):
        n = c[i]
        for j in range(k):
            src.append(min(first + min(j, max(n - 1, 0)), length - 1))
            real.append(j < n)
        at += [s * k + j for j in range(n)]
        first += n
    return np.array(src, np.int32), np.array(real), np.array(at, np.int32)


@jax.tree_util.register_pytree_node_class
class PaddedStack:
    """A layer stack of `length` (L) layers along `dim`, padded for `stages` (S) uneven
    pipeline stages: `tensor` holds S * ceil(L/S) layers, stage s's block its dealt
    layers then copies of its last (`pad_stacks`). A stack of a chain (`chain`: the
    chain's stack lengths and this one's index; nm.scan_chain runs them as one
    pipeline) is dealt as the chain is (`chain_deal`): S * K_i layers, stage s's block
    its layers of this stack then pads, K_i the most any stage holds. A pytree whose
    child is `tensor`, so jax.grad, optax and `place` treat it as they treat the Tensor
    (its gradient is a PaddedStack too, the pads' zero)."""

    def __init__(self, tensor, dim: str, length: int, stages: int, chain=None):
        self.tensor, self.dim, self.length, self.stages = tensor, dim, length, stages
        self.chain = ((length,), 0) if chain is None else (tuple(chain[0]), int(chain[1]))
        if self.chain[0][self.chain[1]] != length:
            raise ParameterError(f"PaddedStack: chain {self.chain} does not hold length {length}")

    @property
    def padding(self) -> tuple:
        """(dim, the chain's lengths, this stack's index, stages): what its layout is."""
        return self.dim, *self.chain, self.stages

    def positions(self):
        """(src, real, at) of its padded layers (`chain_slots`)."""
        return chain_slots(*self.chain[:1], self.stages, self.chain[1])

    def tree_flatten(self):
        return (self.tensor,), (self.dim, self.length, self.stages, self.chain)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def __repr__(self) -> str:
        at = f"{self.dim!r}, length={self.length}, stages={self.stages}"
        chained = f", chain={self.chain}" if len(self.chain[0]) > 1 else ""
        return f"PaddedStack({self.tensor!r}, {at}{chained})"

    def unpadded(self) -> Tensor:
        """The L real layers, in order (a Tensor as the program sees it)."""
        at = self.positions()[2]
        t = self.tensor
        return Tensor._make(jnp.take(t.data, at, axis=t.dims.index(self.dim)), t.dims)


def pad_stacks(tree, stages: dict, chain=()):
    """`tree` with each Tensor that has a dim of `stages` ({dim: S}) S does not divide
    a `PaddedStack` of it (S | L: left as it is; fewer layers than stages: one on each
    of the first stages, only pads on the others). `chain`: keys of a dict whose stacks
    a model runs chained (nm.scan_chain: `models.transformer.CHAIN`); in any dict of
    `tree` (dicts nest) holding them all, they are padded by the chain's deal (one
    pipeline, `chain_slots`), each stage device then holding only its slots of each."""
    if isinstance(tree, dict):
        links = _chain_links(tree, stages, chain)
        return {k: _pad_leaves(v, stages, links[k]) if k in links else pad_stacks(v, stages, chain)
                for k, v in tree.items()}  # fmt: skip
    return _pad_leaves(tree, stages, None)


def _chain_links(tree: dict, stages: dict, chain) -> dict:
    """{key: (dim, (the chain's lengths, the key's index))} of the stacks `chain` names in
    `tree`, where it holds them all, stacked along one dim of `stages` that splits, at
    least two not empty (else scan_chain runs them one by one); else {}."""
    if not chain or not all(k in tree for k in chain):
        return {}
    found = [_stack_dim(tree[k], stages) for k in chain]
    if None in found or len({d for d, _ in found}) != 1 or sum(1 for _, n in found if n) < 2:
        return {}
    lengths = tuple(n for _, n in found)
    return {k: (found[0][0], (lengths, i)) for i, k in enumerate(chain)}


def _stack_dim(subtree, stages: dict):
    """(dim, length) of the first leaf of `subtree` with a dim `stages` splits, or None."""
    for t in jax.tree_util.tree_leaves(subtree, is_leaf=lambda x: isinstance(x, Tensor)):
        for dim in getattr(t, "dims", ()):
            if stages.get(dim, 1) > 1:
                return dim, t.size_of(dim)
    return None


def _pad_leaves(tree, stages: dict, link):
    """`tree`'s stacks padded (`pad_stacks`): by their own deal, or as `link` (dim, chain)
    says, for every leaf stacked along its dim."""

    def pad(t):
        if not isinstance(t, Tensor):
            return t
        if link is not None and link[0] in t.dims:
            dim, (lengths, i) = link
            if t.size_of(dim) != lengths[i]:
                raise ParameterError(
                    f"pad_stacks: stack {i} of a chain along {dim!r} has {lengths[i]} layers, "
                    f"but a tensor {t.dims} of it has {t.size_of(dim)}"
                )
            return _padded(t, dim, stages[dim], link[1])
        for dim in t.dims:
            s, n = stages.get(dim, 1), t.size_of(dim)
            if s > 1 and n % s:
                return _padded(t, dim, s, ((n,), 0))
        return t

    return tree_map(pad, tree)


def _padded(t: Tensor, dim: str, stages: int, chain) -> PaddedStack:
    src = chain_slots(chain[0], stages, chain[1])[0]
    data = _take(t.data, src, t.dims.index(dim))
    return PaddedStack(Tensor._make(data, t.dims), dim, t.size_of(dim), stages, chain)


def _take(data, index: np.ndarray, axis: int):
    """`data` at `index` along `axis`: on the host for host data, a shape alone for an
    abstract one (jax.ShapeDtypeStruct: what a report plans with)."""
    if isinstance(data, jax.ShapeDtypeStruct):
        shape = list(data.shape)
        shape[axis] = len(index)
        return jax.ShapeDtypeStruct(tuple(shape), data.dtype)
    return (np.take if isinstance(data, np.ndarray) else jnp.take)(data, index, axis=axis)


def unpad_stacks(tree):
    """`tree` with each `PaddedStack` its L real layers (`PaddedStack.unpadded`)."""
    return jax.tree_util.tree_map(
        lambda x: x.unpadded() if isinstance(x, PaddedStack) else x,
        tree,
        is_leaf=lambda x: isinstance(x, PaddedStack),
    )


def pad_like(tree, like):
    """`tree` (L-long stacks: a checkpoint's view) padded where `like` holds a
    PaddedStack, each on that stack's sharding; `unpad_stacks`' inverse."""

    def pad(p, t):
        if not isinstance(p, PaddedStack):
            return t
        data = jnp.take(t.data, p.positions()[0], axis=t.dims.index(p.dim))
        data = jax.device_put(data, p.tensor.data.sharding)
        return PaddedStack(Tensor._make(data, t.dims), p.dim, p.length, p.stages, p.chain)

    return jax.tree_util.tree_map(pad, like, tree, is_leaf=lambda x: isinstance(x, PaddedStack))


def viewed(fn, stages: dict):
    """`fn` taking PaddedStacks where it took their L-long stacks: each is handed to it
    as a gather of its real layers (for a scan over the padded dim, `padded_scan` takes
    the stack itself; `pruned` then drops the gather). `stages`: {dim: (mesh axes, S)}
    of the layout; a PaddedStack padded for another S is a LayoutError."""

    def run(*args):
        views = _STAGES.get()[2]

        def view(p):
            if not isinstance(p, PaddedStack):
                return p
            axes, s = stages.get(p.dim, ((), 1))
            if s != p.stages:
                raise LayoutError(
                    f"a PaddedStack of {p.length} layers along {p.dim!r} is padded for "
                    f"{p.stages} stages, but the layout splits {p.dim!r} over mesh axes "
                    f"{tuple(axes)} of size {s}; pad it for the layout's (pad_stacks)"
                )
            t = _taken(p.tensor, p.dim, p.positions()[2])
            views[t.data] = p
            return t

        return fn(*jax.tree_util.tree_map(view, args, is_leaf=lambda x: isinstance(x, PaddedStack)))

    return run


def held_stack(x: Tensor):
    """The PaddedStack that `x` is the L-long view of (`viewed`), or a dtype conversion
    of one (then converted too), within `lower`; else None."""
    views = _STAGES.get()[2]
    return views.get(x.data) or _cast_view(x, views)


def _cast_view(x: Tensor, views: dict):
    """The PaddedStack that `x` is a dtype conversion of a view of (a model's parameters
    cast to its compute dtype), converted too and recorded as `x`'s; else None."""
    for frame in reversed(TRACES.frames):
        made = next((e for e in reversed(frame.eqns) if x.data in e.outputs), None)
        if made is None:
            continue
        held = views.get(made.inputs[0]) if made.primitive.name == "convert" else None
        if held is None:
            return None
        cast = astype(held.tensor, x.dtype)
        views[x.data] = PaddedStack(cast, held.dim, held.length, held.stages, held.chain)
        return views[x.data]
    return None


def pruned(graph):
    """`graph` without the views `viewed` made that nothing reads (the scan took the
    padded stack itself): their gather would otherwise gather the whole stack."""
    views = _STAGES.get()[2]
    if not views:
        return graph
    made = {v for e in graph.eqns if any(o in views for o in e.outputs) for v in e.inputs}
    used = set(graph.outputs)
    kept = []
    for e in reversed(graph.eqns):
        view = any(o in views or o in made for o in e.outputs)
        if view and not any(o in used for o in e.outputs):
            continue
        used.update(e.inputs)
        kept.append(e)
    graph.eqns = kept[::-1]
    return graph


def _taken(x: Tensor, dim: str, index: np.ndarray) -> Tensor:
    """`x` at the positions `index` along `dim`: one gather, so that no part of it is
    laid out over the stages before the whole (a concat of slices would be gathered)."""
    other = f"{dim}~"  # (a gather's indices must not have the gathered dim)
    return gather(rename(x, {dim: other}), other, tensor(index, (dim,)))


class Masked:
    """`f` over (x, flag): a slot not flagged real (a pad) passes its carry through, the
    identity; its ys are dropped by the caller. `nm.scan` of a Masked body marks its
    equation `skip` (its last scanned input the flags), so that the lowered loop runs a
    pad's iteration as a `jax.lax.cond` that does no layer work, forward or backward
    (lowering/emit.py); the `where` here keeps the body's meaning where nothing skips
    (jax's and NumPy's scan), and is a select of the carry where the layer ran."""

    def __init__(self, f):
        self.f = f

    def __call__(self, carry, x):
        inner, flag = x
        new, y = self.f(carry, inner)
        return tree_map(lambda a, b: where(flag, a, b), new, carry), y


def masked(f) -> Masked:
    """`f` over (x, flag), the pads skipped where lowered (`Masked`)."""
    return Masked(f)


def tree_map(fn, *trees):
    """`jax.tree_util.tree_map` over Tensor leaves."""
    return jax.tree_util.tree_map(fn, *trees, is_leaf=lambda x: isinstance(x, Tensor))
