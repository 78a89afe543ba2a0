"""Every op in every dtype (issue 26): `dtype_ops()` applies each registered primitive
to x[r, d] (two of them for the binary ops), and `dtype_cases()` draws one with x of
any dtype of `DTYPES`, `d` split or not, so that a property can hold the result's dtype
and values to one device's: a float-valued op of integers or bools computes in its float
result's dtype, and a bool moved along a split dim stays bool.

The ops are read from the registry (issue 42): the structural ops and the kernels are
written here (they keep x's dtype where a primitive's `example`, made for float
programs, scales by 0.5), and every other primitive is derived: an elementwise op of
its arity on x, x shifted along d and x again, any other by its `example` along d. A
primitive registered later is drawn with no list to edit."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

import namedmesh as nm
from namedmesh.primitive import REGISTRY
from namedmesh.testing.registry_steps import arity, drawn_kinds, not_bound_by, public_op, step_of
from namedmesh.testing.strategies import (
    DTYPES,
    VALUE_MESHES,
    np_dtype,
    special_values,
    value_arrays,
)

_IDX = np.array([3, 0, -1, 2], np.int32)  # gathered positions: one from each end


def _q(x) -> int:
    return x.sizes["d"] // 4


def _shifted(x):
    return nm.shift(x, "d", 1, wrap=True)


# The structural ops, each moving x's values along d (split or not) without arithmetic
STRUCTURAL_OPS = {
    "gather": lambda x: nm.gather(x, "d", nm.tensor(_IDX, "i")),
    # (sizes that the layouts divide: x's d is 4 blocks of the split, a quarter is one)
    "slice": lambda x: nm.slice(x, "d", _q(x), 3 * _q(x)),
    "isel": lambda x: nm.isel(x, d=slice(0, None, 2)),
    "pad": lambda x: nm.pad(x, {"d": (_q(x), _q(x))}),
    "pad_true": lambda x: nm.pad(x, {"d": (0, 2 * _q(x))}, value=True),
    "shift": lambda x: nm.shift(x, "d", 1),
    "shift_wrap": lambda x: nm.shift(x, "d", -3, wrap=True),
    "max_pool": lambda x: nm.pool(x, {"d": 3}, stride=1, padding="SAME"),
    "mean_pool": lambda x: nm.pool(x, {"d": 2}, kind="mean"),
    "top_k": lambda x: nm.top_k(x, "d", 2, new_dim="k")[0],
    "concat": lambda x: nm.concat([x, nm.slice(x, "d", 0, 2 * _q(x))], "d"),
    "split": lambda x: nm.split(x, "d", 2)[1],
    "stack": lambda x: nm.stack([x, x], "s"),
    "reshape": lambda x: nm.reshape(x, {"d0": 2, "d1": -1}, "d"),
    "transpose": lambda x: nm.transpose(x, "d", "r"),
    "squeeze": lambda x: nm.squeeze(nm.slice(x, "d", 0, 1), "d"),
    "expand_dims": lambda x: nm.expand_dims(x, {"e": 2}),
    "where": lambda x: nm.where(nm.isel(x, r=0) == nm.isel(x, r=1), x, nm.shift(x, "d", 1)),
    "rename": lambda x: nm.rename(x, d="dd"),
    "stop_gradient": lambda x: nm.stop_gradient(x),
    "einsum": lambda x: nm.einsum(x, nm.rename(x, r="t"), out="r t"),
}


def _experts(x):
    """x's rows [r, d] times two experts' weights made of x (experts, f, d), row i by
    expert i % 2: grouped_matmul on x's dtype."""
    f = nm.rename(x, r="f")
    w = nm.stack([f, nm.shift(f, "f", 1)], "experts")
    return nm.grouped_matmul(x, w, nm.tensor(np.arange(x.size_of("r"), dtype=np.int32) % 2, "r"))


# The contractions that take x's dtype into a kernel of their own
KERNEL_OPS = {
    "grouped_matmul": _experts,
    "dot_product_attention": lambda x: nm.dot_product_attention(
        x,
        nm.rename(x, r="m"),
        nm.rename(x, r="m"),
        causal=True,
        length="r",
        memory="m",
        features="d",
    ),  # fmt: skip
}


def _derived(name: str):
    """Primitive `name` on x[r, d]: an elementwise op (its `example` unset) of its arity
    on x, x shifted along d and x again; any other by its `example` along d (k = 2: a
    reduction's example reduces the dims k's bits pick, d's), x itself where the
    example has none for x's shape."""
    prim = REGISTRY[name]
    if prim.example is None and prim.elementwise:
        op, n = public_op(prim), arity(prim)
        return lambda x: op(*[x, _shifted(x), x][:n])
    example = step_of(name)

    def apply(x):
        out = example(x, _shifted(x), "d", 2)
        return x if out is None else out

    return apply


def dtype_ops() -> dict:
    """op -> its function of x[r, d], for every drawn primitive of the registry (read at
    each call): STRUCTURAL_OPS and KERNEL_OPS, then under its own name each elementwise
    primitive and each other primitive none of them binds, derived (`_derived`)."""
    return dict(_dtype_ops(tuple((name, p.example) for name, p in REGISTRY.items())))


@functools.cache  # per registry state: its primitives and their examples
def _dtype_ops(registered: tuple) -> tuple:
    hand = {**STRUCTURAL_OPS, **KERNEL_OPS}
    x = nm.tensor(np.ones((2, 8), np.float32), "r d")
    uncovered = set(not_bound_by(hand.values(), x))
    derived = {
        name: _derived(name)
        for name in drawn_kinds()
        if name not in hand and (REGISTRY[name].elementwise or name in uncovered)
    }
    return tuple({**hand, **derived}.items())


def elementwise_ops() -> tuple[str, ...]:
    """The ops of `dtype_ops()` derived from an elementwise primitive: their values on
    special floats differ by ulps between NumPy and XLA (their dtypes are compared)."""
    hand = {**STRUCTURAL_OPS, **KERNEL_OPS}
    return tuple(n for n in dtype_ops() if n not in hand and REGISTRY[n].elementwise)


@dataclass(frozen=True, eq=False)
class DtypeCase:
    """Op `op` of `dtype_ops()` on x[r, d] of `dtype`, under `layout` on `mesh`; x may be
    big-endian (`x.dtype.isnative` false), as some files and network formats give."""

    op: str
    dtype: str
    x: np.ndarray
    mesh: dict
    layout: str

    def __repr__(self) -> str:
        order = "" if self.x.dtype.isnative else f", byte order {self.x.dtype.byteorder!r}"
        return (f"DtypeCase({self.op}, {self.dtype}, x={self.x.tolist()!r}, mesh={self.mesh}, "
                f"layout={self.layout!r}{order})")  # fmt: skip


def swappable(dtype: str) -> bool:
    """Whether `dtype` has a byte order (bool has none; ml_dtypes' bfloat16 only its own)."""
    return dtype not in ("bool", "int8", "uint8", "bfloat16")


def byte_orders(dtype: str):
    """'=' (native, the shrunk case) or '>' (big-endian) where `dtype` has an order."""
    return st.sampled_from(("=", ">") if swappable(dtype) else ("=",))


def in_order(x: np.ndarray, order: str) -> np.ndarray:
    return x if order == "=" else x.astype(x.dtype.newbyteorder(order))


@st.composite
def dtype_cases(draw, ops=None, dtypes=DTYPES, split=(True, False)) -> DtypeCase:
    """A DtypeCase: any op of `ops` (default: every one of `dtype_ops()`), any dtype,
    values drawn from the dtype's special values, in either byte order, `d` split over
    one or two mesh axes (in either order) or `r` split instead."""
    op = draw(st.sampled_from(tuple(dtype_ops()) if ops is None else ops))
    dtype = draw(st.sampled_from(dtypes))
    mesh = draw(st.sampled_from(VALUE_MESHES))
    axes = draw(st.permutations(list(mesh)))
    n_d = draw(st.integers(1, len(axes)))
    n = 4 * int(np.prod([mesh[a] for a in axes[:n_d]]))
    along = draw(st.sampled_from(split))
    layout = ("d:" if along else "r:") + ",".join(axes[:n_d] if along else axes[:1])
    x = draw(value_arrays((2 * mesh[axes[0]], n), dtype))
    return DtypeCase(op, dtype, in_order(x, draw(byte_orders(dtype))), mesh, layout)


@dataclass(frozen=True, eq=False)
class PowerCase:
    """power(x, y) of x[r, d] and y[r, d] of any two dtypes (either byte order), under
    `layout` on a mesh of 4 devices."""

    x: np.ndarray
    y: np.ndarray
    layout: str

    def __repr__(self) -> str:
        return (f"PowerCase(x={self.x.tolist()!r} {self.x.dtype.str}, "
                f"y={self.y.tolist()!r} {self.y.dtype.str}, layout={self.layout!r})")  # fmt: skip


# Exponents beyond the special values: negative ones, and 64 and more (jnp.power of
# integers squares six times)
EXPONENTS = [-3, -2, -1, 2, 3, 7, 64, 65, 127]


def _exponents(dtype: str):
    if dtype in ("bool", "uint8"):
        return value_arrays((4, 8), dtype)
    pool = special_values(dtype) + EXPONENTS
    return st.lists(st.sampled_from(pool), min_size=32, max_size=32).map(
        lambda v: np.array(v).astype(np_dtype(dtype)).reshape(4, 8)
    )


@st.composite
def power_cases(draw, dtypes=DTYPES) -> PowerCase:
    """A PowerCase: every pair of dtypes, bases from the special values, exponents from
    them and `EXPONENTS` (negative integers, 64 and more), each in either byte order."""
    a, b = draw(st.sampled_from(dtypes)), draw(st.sampled_from(dtypes))
    x = in_order(draw(value_arrays((4, 8), a)), draw(byte_orders(a)))
    y = in_order(draw(_exponents(b)), draw(byte_orders(b)))
    return PowerCase(x, y, draw(st.sampled_from(("d:m0", "r:m0"))))


__all__ = [
    "dtype_ops",
    "elementwise_ops",
    "KERNEL_OPS",
    "STRUCTURAL_OPS",
    "DtypeCase",
    "PowerCase",
    "dtype_cases",
    "power_cases",
]
