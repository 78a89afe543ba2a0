"""Strategies for the cases `programs()` draws too rarely: a dim over two or three mesh
axes in every order of the axes, on meshes whose axes all have size > 1; ops that
compute positions along that dim (halo exchanges, offsets, indices); index tensors of
every integer dtype with their dims in any order relative to the table's; 64-bit
inputs; and layout rules of any value.

`axis_order_cases()` draws `(AlongProgram, mesh, layout)`: one op along dim "p" of
x[p, q], "p" split by a permutation of 2 or 3 mesh axes. An AlongProgram is data, so
hypothesis shrinks it and it prints as code. Its kinds are ALONG_KINDS, written here
(index tensors, integer inputs, parameters), and half the time one of the registry's
other primitives (`registry_kinds()`: those no kind of ALONG_KINDS binds), applied by
its `Primitive.example` along "p": a primitive registered later is drawn too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

import namedmesh as nm
from lowering import Layout, Mesh
from namedmesh.primitive import REGISTRY
from namedmesh.testing.registry_steps import not_bound_by, step_of

ALONG_KINDS = (
    "shift",
    "conv",
    "pool_max",
    "pool_mean",
    "cumsum",
    "top_k",
    "argmax",
    "argmin",
    "random",
    "iota",
    "gather",
    "one_hot",
    "where",
    "reshape",
    "relayout",
)
INDEX_KINDS = ("gather", "one_hot", "where")
INT_KINDS = ("shift", "cumsum", "top_k", "argmax", "argmin", "gather", "where", "reshape")
INDEX_DTYPES = ("int8", "uint8", "int16", "int32")
X_DTYPES = ("float32", "float64", "int32", "int64")


def split_meshes(max_devices: int | None = None):
    """Meshes of 2 or 3 axes, every axis of size > 1 (2x2, 2x4, 4x2, 2x2x2 on 8 devices):
    an axis of size 1 splits nothing, so an order of axes that includes it is no order."""
    import jax

    limit = max_devices or len(jax.devices())

    @st.composite
    def draw(draw_):
        n = draw_(st.integers(2, 3)) if limit >= 8 else 2
        sizes: dict[str, int] = {}
        for name in ("m0", "m1", "m2")[:n]:
            room = limit // int(np.prod(list(sizes.values()) or [1])) // 2 ** (n - 1 - len(sizes))
            sizes[name] = draw_(st.sampled_from([s for s in (2, 4) if s <= room]))
        return Mesh(sizes)

    return draw()


def axis_orders(mesh, min_axes: int = 2, max_axes: int = 3):
    """A tuple of `min_axes`..`max_axes` distinct axes of `mesh`, in any order (every
    permutation is drawn, not only the mesh's order)."""
    axes = list(mesh.sizes)
    hi = min(max_axes, len(axes))
    return st.integers(min(min_axes, hi), hi).flatmap(
        lambda k: st.permutations(axes).map(lambda p: tuple(p[:k]))
    )


@dataclass(frozen=True)
class AlongProgram:
    """One op of `kind` along dim "p" of x[p, q] (an index tensor `idx` with dims
    `idx_dims` for gather, one_hot and where). `param` picks the op's parameters."""

    kind: str
    p: int
    q: int
    param: int
    wrap: bool
    x_dtype: str = "float32"
    idx_dims: tuple[str, ...] = ("i",)
    idx_dtype: str = "int32"
    seed: int = 0

    def example_inputs(self) -> list[nm.Tensor]:
        r = np.random.default_rng(self.seed)
        dt = np.dtype(self.x_dtype)
        if dt.kind == "f":
            x = r.normal(size=(self.p, self.q)).astype(dt)
        else:  # beyond 32 bits for int64
            hi = 2**40 if dt.itemsize == 8 else 2**20
            x = r.integers(-hi, hi, size=(self.p, self.q)).astype(dt)
        sizes = {"p": self.p, "q": self.q, "i": self.q}  # |i| == |q|: the order matters
        info = np.iinfo(self.idx_dtype)
        lo, hi = max(info.min, -2 * self.p), min(info.max, 2 * self.p)
        idx = r.integers(lo, hi + 1, size=[sizes[d] for d in self.idx_dims])
        return [nm.tensor(x, "p q"), nm.tensor(idx.astype(self.idx_dtype), self.idx_dims)]

    def __call__(self, x: nm.Tensor, idx: nm.Tensor):
        k, n = self.param, self.p
        if self.kind == "shift":
            return nm.shift(x, "p", k % (2 * n + 1) - n, wrap=self.wrap, fill=1)
        if self.kind == "conv":
            taps = 1 + k % 3
            w = nm.tensor(np.arange(1, taps + 1, dtype=x.dtype) * 0.5, "kp")
            pad = {"p": (taps - 1, 0)} if self.wrap else "SAME"
            return nm.conv(x, w, {"p": "kp"}, padding=pad)
        if self.kind in ("pool_max", "pool_mean"):
            return nm.pool(x, {"p": 1 + k % 3}, stride=1, padding="SAME", kind=self.kind[5:])
        if self.kind == "cumsum":
            return nm.cumsum(x, "p", reverse=self.wrap)
        if self.kind == "top_k":
            vals, at = nm.top_k(x, "p", 1 + k % n, new_dim="k")
            return [vals, at]
        if self.kind in ("argmax", "argmin"):
            return getattr(nm, self.kind)(x, "p")
        if self.kind == "random":
            return x + nm.random.normal(nm.random.key(k), x.sizes, dtype=x.dtype)
        if self.kind == "iota":
            return x + nm.arange("p", n, start=k % 5 - 2, step=1 + k % 3, dtype=x.dtype)
        if self.kind == "gather":
            return nm.gather(x, "p", idx)
        if self.kind == "one_hot":
            return nm.one_hot(idx, "p", n, dtype=x.dtype)
        if self.kind == "where":
            return [nm.where(idx > 0, x, -x), nm.where(idx, idx, idx * 2)]
        if self.kind == "reshape" and n % 2 == 0:
            split = nm.reshape(x, {"p_hi": 2, "p_lo": n // 2}, from_="p")
            return nm.reshape(split, {"p": n}, from_=("p_hi", "p_lo"))
        if self.kind == "relayout":
            return nm.constrain(x * 2, {"q": "m0"} if k % 2 else {})
        if self.kind not in ALONG_KINDS and self.kind in REGISTRY:  # registry_kinds()
            out = step_of(self.kind)(x, x, "p", k)
            return x if out is None else out
        return x


def registry_kinds() -> tuple[str, ...]:
    """The drawn primitives (`strategies.drawn_kinds`) that no kind of ALONG_KINDS binds,
    but the elementwise ones (each element alone: nothing along "p"), read from the
    registry at each call: AlongProgram applies them by their example."""
    return _registry_kinds(tuple((name, p.example) for name, p in REGISTRY.items()))


@functools.cache  # per registry state: its primitives and their examples
def _registry_kinds(registered: tuple) -> tuple[str, ...]:
    probes = [AlongProgram(kind, 4, 2, 1, False) for kind in ALONG_KINDS]
    kinds = not_bound_by(probes, *probes[0].example_inputs())
    return tuple(k for k in kinds if not REGISTRY[k].elementwise)


@st.composite
def axis_order_cases(draw, kinds=None, x_dtypes=X_DTYPES):
    """(AlongProgram, mesh, layout): "p" over 2 or 3 mesh axes in any order (every axis
    of size > 1), its size 1..4 per shard; "q" sometimes on another axis; the index
    tensor's dims in any order, shared with x's ("q") or new ("i", of q's size). The
    kind is one of `kinds`, by default ALONG_KINDS or (half the time, shrinking to the
    former) `registry_kinds()`, float x only (their examples are made for floats)."""
    mesh = draw(split_meshes())
    axes = draw(axis_orders(mesh))
    if kinds is None:
        kinds = registry_kinds() if draw(st.booleans()) else ALONG_KINDS
    kind = draw(st.sampled_from(kinds))
    per = int(np.prod([mesh.sizes[a] for a in axes]))
    p = per * draw(st.sampled_from([2, 1, 3, 4, 40]))  # 40: past an int8 index's range
    q = draw(st.sampled_from([2, 4]))
    if kind == "relayout":  # its constraint puts q on m0, whose size must divide it
        q = max(q, mesh.sizes["m0"])
    dtypes = [d for d in x_dtypes if kind in INT_KINDS or d.startswith("float")]
    dtypes = dtypes or ["float32"]
    if kind == "random":  # drawn in float32 (NumPy's and XLA's log/cos differ by an ulp)
        dtypes = ["float32"]
    idx_dims = tuple(draw(st.permutations(["i", "q"]))[: draw(st.integers(1, 2))])
    program = AlongProgram(
        kind,
        p,
        q,
        draw(st.integers(0, 50)),
        draw(st.booleans()),
        draw(st.sampled_from(dtypes)),
        idx_dims if kind in INDEX_KINDS else ("i",),
        draw(st.sampled_from(INDEX_DTYPES)),
        draw(st.integers(0, 2**16)),
    )
    rules = [("p", axes)]
    rest = [a for a in mesh.sizes if a not in axes]
    if rest and q % mesh.sizes[rest[0]] == 0 and draw(st.booleans()):
        rules.append((draw(st.sampled_from(["q", "i"])), (rest[0],)))
    return program, mesh, Layout(rules)


def has_64_bit(graph) -> bool:
    """Whether any value of `graph` is 64-bit (which the lowering refuses with x64 off)."""
    return any(np.dtype(v.dtype).itemsize == 8 and v.dtype.kind in "iuf" for v in graph.values())


def rule_values():
    """Anything a user might put as a layout rule's value: axis names, lists of them, and
    values that are not (ints, None, nested lists, empty strings, repeats)."""
    name = st.sampled_from(["rows", "cols", ""])
    return st.one_of(
        name,
        st.lists(st.one_of(name, st.integers(0, 3), st.none()), max_size=3),
        st.tuples(name, name),
        st.integers(-1, 3),
        st.none(),
        st.floats(allow_nan=False, width=16),
    )


__all__ = [
    "ALONG_KINDS",
    "registry_kinds",
    "AlongProgram",
    "axis_order_cases",
    "axis_orders",
    "has_64_bit",
    "rule_values",
    "split_meshes",
]
