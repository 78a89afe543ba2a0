"""Every op in every dtype (issue 26): `DTYPE_OPS` applies each op of the language to
x[r, d] (two of them for the binary ops), and `dtype_cases()` draws one with x of any
dtype of `DTYPES`, `d` split or not, so that a property can hold the result's dtype and
values to one device's: a float-valued op of integers or bools computes in its float
result's dtype, and a bool moved along a split dim stays bool."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

import namedmesh as nm
from namedmesh.testing.strategies import DTYPES, VALUE_MESHES, value_arrays

_IDX = np.array([3, 0, -1, 2], np.int32)  # gathered positions: one from each end


def _q(x) -> int:
    return x.sizes["d"] // 4


def _unary(name):
    return lambda x: getattr(nm, name)(x)


def _binary(name):
    return lambda x: getattr(nm, name)(x, nm.shift(x, "d", 1, wrap=True))


def _along(name):
    return lambda x: getattr(nm, name)(x, "d")


UNARY_OPS = ("abs", "negative", "sign", "square", "reciprocal", "exp", "log", "log1p",
             "expm1", "sqrt", "rsqrt", "sin", "cos", "tan", "tanh", "erf", "sigmoid",
             "relu", "gelu", "silu", "floor", "ceil", "round", "logical_not", "isnan",
             "isfinite")  # fmt: skip
BINARY_OPS = ("add", "subtract", "multiply", "divide", "floor_divide", "mod", "power",
              "maximum", "minimum", "arctan2", "equal", "not_equal", "less", "less_equal",
              "greater", "greater_equal", "logical_and", "logical_or", "logical_xor")  # fmt: skip
ALONG_OPS = ("sum", "prod", "max", "min", "mean", "any", "all", "logsumexp", "softmax",
             "log_softmax", "var", "std", "argmax", "argmin", "cumsum")  # fmt: skip
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
        nm.rename(x, r="length", d="d_kv"),
        nm.rename(x, r="memory", d="d_kv"),
        nm.rename(x, r="memory", d="d_kv"),
        causal=True,
    ),
}

DTYPE_OPS = {
    **{n: _unary(n) for n in UNARY_OPS},
    **{n: _binary(n) for n in BINARY_OPS},
    **{n: _along(n) for n in ALONG_OPS},
    **STRUCTURAL_OPS,
    **KERNEL_OPS,
}


@dataclass(frozen=True, eq=False)
class DtypeCase:
    """Op `op` of DTYPE_OPS on x[r, d] of `dtype`, under `layout` on `mesh`."""

    op: str
    dtype: str
    x: np.ndarray
    mesh: dict
    layout: str

    def __repr__(self) -> str:
        return (f"DtypeCase({self.op}, {self.dtype}, x={self.x.tolist()!r}, mesh={self.mesh}, "
                f"layout={self.layout!r})")  # fmt: skip


@st.composite
def dtype_cases(draw, ops=tuple(DTYPE_OPS), dtypes=DTYPES, split=(True, False)) -> DtypeCase:
    """A DtypeCase: any op, any dtype, values drawn from the dtype's special values, `d`
    split over one or two mesh axes (in either order) or `r` split instead."""
    op = draw(st.sampled_from(ops))
    dtype = draw(st.sampled_from(dtypes))
    mesh = draw(st.sampled_from(VALUE_MESHES))
    axes = draw(st.permutations(list(mesh)))
    n_d = draw(st.integers(1, len(axes)))
    n = 4 * int(np.prod([mesh[a] for a in axes[:n_d]]))
    along = draw(st.sampled_from(split))
    layout = ("d:" if along else "r:") + ",".join(axes[:n_d] if along else axes[:1])
    x = draw(value_arrays((2 * mesh[axes[0]], n), dtype))
    return DtypeCase(op, dtype, x, mesh, layout)


__all__ = ["ALONG_OPS", "DTYPE_OPS", "KERNEL_OPS", "STRUCTURAL_OPS", "DtypeCase", "dtype_cases"]
