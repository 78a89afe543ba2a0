"""Convolution and pooling over named spatial dims.

`conv(x, kernel, spatial={"h": "kh", "w": "kw"})` slides the kernel's window dims
(`kh`, `kw`) over x's spatial dims (`h`, `w`). As in an einsum, the other dims that
x and kernel share are summed (input channels), x's own dims are kept (batch) and
the kernel's own dims are appended (output channels):
out[b, h, w, o] = sum_{kh, kw, c} x[b, h*s + kh*d - pad, w*s + kw*d - pad, c] k[kh, kw, c, o].
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from namedmesh.checks import agreed_sizes, integer, require_dims
from namedmesh.einsum import spec
from namedmesh.errors import ShapeError
from namedmesh.ordering import lowest
from namedmesh.primitive import Aval, Cost, bind, is_inexact, primitive, result_dtype
from namedmesh.reductions import wide_accumulation
from namedmesh.tensor import Tensor


def _positive(values, dims, what) -> tuple[int, ...]:
    for d, v in zip(dims, values, strict=True):
        if v < 1:
            raise ShapeError(f"{what} for dim {d!r} must be >= 1, got {v}")
    return tuple(values)


def _per_dim(value, dims, what, default=None) -> tuple[int, ...]:
    """An int or a dict by spatial dim, as one positive int per dim (missing dims take
    `default`, one per dim, or 1)."""
    if isinstance(value, Mapping):
        unknown = [d for d in value if d not in dims]
        if unknown:
            raise ShapeError(f"{what}: dim(s) {unknown} are not spatial dims {dims}")
        default = default or (1,) * len(dims)
        vals = tuple(
            integer(what, f"dim {d!r}", value.get(d, k)) for d, k in zip(dims, default, strict=True)
        )
        return _positive(vals, dims, what)
    return _positive((integer(what, "the value", value),) * len(dims), dims, what)


def _explicit_pad(p, dim) -> tuple[int, int]:
    if isinstance(p, int | str) or len(p) != 2:
        raise ShapeError(f"padding for dim {dim!r} must be a pair (lo, hi), got {p!r}")
    lo, hi = (integer("padding", f"a width for dim {dim!r}", v) for v in p)
    if lo < 0 or hi < 0:
        raise ShapeError(f"padding: negative width {p!r} for dim {dim!r}")
    return lo, hi


def _padding(padding, dims, sizes, windows, strides, dilations):
    """(lo, hi) per spatial dim for "VALID", "SAME" or an explicit {dim: (lo, hi)}."""
    if isinstance(padding, Mapping):
        unknown = [d for d in padding if d not in dims]
        if unknown:
            raise ShapeError(f"padding: dim(s) {unknown} are not spatial dims {dims}")
        return tuple(_explicit_pad(padding.get(d, (0, 0)), d) for d in dims)
    if padding == "VALID":
        return ((0, 0),) * len(dims)
    if padding == "SAME":
        pads = []
        for n, k, s, dl in zip(sizes, windows, strides, dilations, strict=True):
            total = max((-(-n // s) - 1) * s + dl * (k - 1) + 1 - n, 0)
            pads.append((total // 2, total - total // 2))
        return tuple(pads)
    raise ShapeError(f"padding must be 'VALID', 'SAME' or a dict dim -> (lo, hi), got {padding!r}")


def _out_size(n, k, s, d, pad, dim):
    span = d * (k - 1) + 1
    if n + pad[0] + pad[1] < span:
        raise ShapeError(
            f"window of span {span} is larger than spatial dim {dim!r} of size {n} padded by {pad}"
        )
    return (n + pad[0] + pad[1] - span) // s + 1


def _windows(x, axes, windows, strides, dilations, pads, fill, xp):
    """x with each spatial axis replaced by (output position, window offset) axes, appended
    window axes last: shape [..., out_i, ..., k_1, ..., k_n]."""
    x = xp.pad(
        x,
        [pads[axes.index(a)] if a in axes else (0, 0) for a in range(x.ndim)],
        constant_values=fill,
    )
    for a, k, s, d in zip(axes, windows, strides, dilations, strict=True):
        n_out = (x.shape[a] - d * (k - 1) - 1) // s + 1
        pos = np.arange(n_out)[:, None] * s + np.arange(k)[None, :] * d
        x = xp.take(x, pos, axis=a)  # axis a -> (n_out, k)
        x = xp.moveaxis(x, a + 1, -1)  # the window axis goes last, after earlier ones
    return x


def _conv_layout(x_dims, k_dims, spatial):
    windows = tuple(spatial.values())
    shared = tuple(d for d in x_dims if d in k_dims and d not in spatial)
    feats = tuple(d for d in k_dims if d not in x_dims and d not in windows)
    out = tuple(d for d in x_dims if d not in shared) + feats
    return shared, feats, out


def _conv_rule(x, k, spatial, strides, dilations, pads, dims):
    # the shape rule sees objects with .dims and .shape only (the planner passes Avals)
    sizes_of = lambda t: dict(zip(t.dims, t.shape, strict=True))
    x_sizes, k_sizes = sizes_of(x), sizes_of(k)
    agreed_sizes("conv", (x, k), ("x", "the kernel"))
    _, _, out = _conv_layout(x.dims, k.dims, dict(spatial))
    sizes = {**x_sizes, **k_sizes}
    for (d, w), s, dl, p in zip(spatial, strides, dilations, pads, strict=True):
        sizes[d] = _out_size(x_sizes[d], k_sizes[w], s, dl, p, d)
    return Aval(out, tuple(sizes[d] for d in out), result_dtype(x.dtype, k.dtype))


def _conv_np(x, k, spatial, strides, dilations, pads, dims):
    x_dims, k_dims, out = dims
    sp = dict(spatial)
    axes = tuple(x_dims.index(d) for d in sp)
    wk = tuple(k.shape[k_dims.index(w)] for w in sp.values())
    xw = _windows(x, axes, wk, strides, dilations, pads, 0, np)
    return np.einsum(spec((x_dims + tuple(sp.values()), k_dims), out), xw, k, optimize=True)


def _conv_jax(x, k, spatial, strides, dilations, pads, dims):
    x_dims, k_dims, out = dims
    sp = dict(spatial)
    shared, feats, _ = _conv_layout(x_dims, k_dims, sp)
    batch = tuple(d for d in x_dims if d not in shared and d not in sp)
    xs = dict(zip(x_dims, x.shape, strict=True))
    ks = dict(zip(k_dims, k.shape, strict=True))
    n_b, n_c, n_o = (
        math.prod(xs[d] for d in batch),
        math.prod(xs[d] for d in shared),
        math.prod(ks[d] for d in feats),
    )
    lhs = jnp.transpose(x, [x_dims.index(d) for d in batch + shared + tuple(sp)])
    lhs = lhs.reshape((n_b, n_c) + tuple(xs[d] for d in sp))
    rhs = jnp.transpose(k, [k_dims.index(d) for d in feats + shared + tuple(sp.values())])
    rhs = rhs.reshape((n_o, n_c) + tuple(ks[w] for w in sp.values()))
    # XLA's conv takes one dtype: both in the shape rule's (an int or bool x with a
    # float kernel raised jax's TypeError where NumPy's einsum promotes)
    dt = result_dtype(x.dtype, k.dtype)
    lhs, rhs = lhs.astype(dt), rhs.astype(dt)
    y = jax.lax.conv_general_dilated(lhs, rhs, strides, pads, rhs_dilation=dilations)
    y = y.reshape(tuple(xs[d] for d in batch) + tuple(ks[d] for d in feats) + y.shape[2:])
    y_dims = batch + feats + tuple(sp)
    return jnp.transpose(y, [y_dims.index(d) for d in out])


def _conv_cost(in_avals, out_avals, params) -> Cost:
    x, k = in_avals
    windows = {w for _, w in params["spatial"]}
    per_out = math.prod(
        s for d, s in zip(k.dims, k.shape, strict=True) if d in windows or d in x.dims
    )
    flops = 2 * math.prod(out_avals[0].shape) * per_out
    return Cost(flops, x.nbytes + k.nbytes + out_avals[0].nbytes)


_conv = primitive(
    "conv", _conv_rule, _conv_np, _conv_jax, cost_rule=_conv_cost, backward_reads="others"
)


def conv(
    x: Tensor, kernel: Tensor, spatial: Mapping[str, str], stride=1, padding="VALID", dilation=1
) -> Tensor:
    """Convolve (cross-correlate, as deep learning does) `x` with `kernel`.

    `spatial` maps each spatial dim of x to the kernel's window dim; `stride`, `dilation`
    are ints or dicts by spatial dim; `padding` is "VALID", "SAME" or {dim: (lo, hi)}.
    """
    sp = dict(spatial)
    if not sp:
        raise ShapeError("conv: `spatial` must map at least one spatial dim to a window dim")
    for d, w in sp.items():
        require_dims("conv spatial", [d], x.dims, "x")
        require_dims("conv window", [w], kernel.dims, "the kernel")
        if w in x.dims or d in kernel.dims:
            raise ShapeError(
                f"conv: window dim {w!r} and spatial dim {d!r} must each belong "
                f"to one operand: x {x.dims}, kernel {kernel.dims}"
            )
    dims = tuple(sp)
    strides = _per_dim(stride, dims, "stride")
    dilations = _per_dim(dilation, dims, "dilation")
    windows = _positive(
        tuple(kernel.size_of(w) for w in sp.values()), tuple(sp.values()), "conv: window size"
    )
    pads = _padding(padding, dims, [x.size_of(d) for d in dims], windows, strides, dilations)
    out = _conv_layout(x.dims, kernel.dims, sp)[2]
    return bind(
        _conv,
        x,
        kernel,
        spatial=tuple(sp.items()),
        strides=strides,
        dilations=dilations,
        pads=pads,
        dims=(x.dims, kernel.dims, out),
    )


def _pool_rule(x, axes, windows, strides, pads, kind):
    shape = list(x.shape)
    for a, k, s, p in zip(axes, windows, strides, pads, strict=True):
        shape[a] = _out_size(x.shape[a], k, s, 1, p, x.dims[a])
    dtype = x.dtype if kind == "max" or is_inexact(x.dtype) else np.dtype(np.float32)
    return Aval(x.dims, tuple(shape), dtype)


@wide_accumulation  # (a mean pool of 16-bit floats sums in float32, as jax's does)
def _pool_np(x, axes, windows, strides, pads, kind):
    # a mean pool of integers or bools computes in float32 (its result's dtype), as jax's
    if kind == "max":
        fill = lowest(x.dtype)
    else:
        fill, x = 0, x if is_inexact(x.dtype) else x.astype(np.float32)
    xw = _windows(x, axes, windows, strides, (1,) * len(axes), pads, fill, np)
    win_axes = tuple(range(x.ndim, xw.ndim))
    return xw.max(axis=win_axes) if kind == "max" else xw.mean(axis=win_axes)


def _pool_jax(x, axes, windows, strides, pads, kind):
    # Windows gathered as the NumPy impl does, not lax.reduce_window: its derivative
    # cannot be linearized inside shard_map (jax 0.10), so a lowered pool had no gradient.
    if kind == "max":
        fill = lowest(x.dtype)
    else:
        fill, x = 0, x.astype(jnp.float32) if not is_inexact(x.dtype) else x
    xw = _windows(x, axes, windows, strides, (1,) * len(axes), pads, fill, jnp)
    win_axes = tuple(range(x.ndim, xw.ndim))
    return xw.max(axis=win_axes) if kind == "max" else xw.mean(axis=win_axes)


def _pool_cost(in_avals, out_avals, params) -> Cost:
    flops = math.prod(out_avals[0].shape) * math.prod(params["windows"])
    return Cost(flops, in_avals[0].nbytes + out_avals[0].nbytes)


_pool = primitive(
    "pool", _pool_rule, _pool_np, _pool_jax, cost_rule=_pool_cost, backward_reads="both"
)


def pool(
    x: Tensor, window: Mapping[str, int], stride=None, padding="VALID", kind: str = "max"
) -> Tensor:
    """Max or mean ("mean") over windows of the spatial dims in `window` (dim -> size).

    `stride` defaults to the window (non-overlapping), also for dims a stride dict omits.
    A mean counts padded zeros.
    """
    if kind not in ("max", "mean"):
        raise ShapeError(f"pool: kind must be 'max' or 'mean', got {kind!r}")
    dims = tuple(window)
    if not dims:
        raise ShapeError(f"pool: window names no dim of x {x.dims}")
    require_dims("pool window", dims, x.dims, "x")
    axes = tuple(x.dims.index(d) for d in dims)
    windows = tuple(integer("pool", f"the window size of {d!r}", window[d]) for d in dims)
    windows = _positive(windows, dims, "pool: window size")
    strides = windows if stride is None else _per_dim(stride, dims, "stride", windows)
    pads = _padding(padding, dims, [x.size_of(d) for d in dims], windows, strides, (1,) * len(dims))
    return bind(_pool, x, axes=axes, windows=windows, strides=strides, pads=pads, kind=kind)


# How the property strategies' random programs apply these (Primitive.example): windows
# of 1 to 3 along d, padded to keep its size (so a layout may split it)
def _conv_example(a, b, d, k):
    if not a.size_of(d):  # an empty dim: no window fits (None: the strategy's fallback)
        return None
    w = 1 + k % min(3, a.size_of(d))
    return conv(a, _full_window(d + "_w", w), {d: d + "_w"}, padding="SAME")


def _full_window(dim: str, w: int) -> Tensor:
    """A [dim: w] kernel of weights 1/w..1 (not all equal: an order mistake shows)."""
    return Tensor._make(np.arange(1, w + 1, dtype=np.float32) / w, (dim,))


_conv.example = _conv_example
_pool.example = lambda a, b, d, k: (
    None
    if not a.size_of(d)
    else pool(
        a, {d: 1 + k % min(3, a.size_of(d))}, stride=1, padding="SAME", kind=("max", "mean")[k % 2]
    )
)
