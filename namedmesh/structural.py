"""Structural ops by name: rename, transpose, reshape, concat, split, slice, pad, shift,
stack, one_hot, gather, stop_gradient."""

from __future__ import annotations

import builtins
import math
import operator
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from namedmesh.checks import (
    agreed_sizes,
    axis_of,
    did_you_mean,
    fits_dtype,
    integer,
    names_not_positions,
    require_dims,
)
from namedmesh.eager import remembered
from namedmesh.elementwise import align
from namedmesh.errors import ArgumentError, LayoutError, ShapeError, fmt_dims
from namedmesh.layout_rules import Rules, format_rules, parse_rules
from namedmesh.primitive import Aval, bind, primitive, result_dtype, zero_flops_cost
from namedmesh.tensor import DimsLike, Tensor, native_dtype, parse_dims, renames_with


def _identity(x, **_):
    return x


# --- rename / transpose ---------------------------------------------------------------
_rename = primitive(
    "rename",
    lambda x, dims: Aval(dims, x.shape, x.dtype),
    _identity,
    _identity,
    cost_rule=lambda i, o, p: zero_flops_cost(i, o, p)._replace(bytes=0),
    backward_reads="nothing",
    aliases_input=True,
)


@remembered
def rename(x: Tensor, mapping: Mapping[str, str] | None = None, **names: str) -> Tensor:
    """`x` with dims renamed, `rename(x, {"a": "b"})` or `rename(x, a="b")`; data untouched."""
    mapping = {**(mapping or {}), **names}
    require_dims("rename", mapping, x.dims)
    dims = parse_dims(tuple(mapping.get(d, d) for d in x.dims), f"rename {mapping}")
    return bind(_rename, x, dims=dims)


renames_with(rename)  # what Tensor(traced value, new dims) records


_transpose = primitive(
    "transpose",
    lambda x, perm: Aval(tuple(x.dims[i] for i in perm), tuple(x.shape[i] for i in perm), x.dtype),
    lambda x, perm: np.transpose(x, perm),
    lambda x, perm: jnp.transpose(x, perm),
    cost_rule=zero_flops_cost,
    backward_reads="nothing",
    numpy_kernel=lambda perm: operator.methodcaller("transpose", perm),  # np.transpose's call
)


@remembered
def transpose(x: Tensor, *dims: str | Sequence[str]) -> Tensor:
    """`x` with its axes in the order `dims`; `...` stands for the other dims in their order."""
    dims = tuple("..." if d is Ellipsis else d for d in dims)  # x.transpose("c", ...)
    if len(dims) == 1 and not isinstance(dims[0], str) or len(dims) == 1 and " " in dims[0]:
        dims = tuple(dims[0].split()) if isinstance(dims[0], str) else tuple(dims[0])
    names_not_positions(tuple(dims), "transpose", x.dims)
    named = [d for d in dims if d != "..."]
    require_dims("transpose", named, x.dims)
    if len(set(named)) != len(named) or dims.count("...") > 1:
        raise ShapeError(f"transpose: {dims} is not an ordering of the dims {x.dims}")
    if "..." in dims:
        rest = [d for d in x.dims if d not in named]
        i = dims.index("...")
        named = named[:i] + rest + named[i:]
    elif len(named) != len(x.dims):
        raise ShapeError(f"transpose: {dims} is not an ordering of the dims {x.dims}")
    perm = tuple(x.dims.index(d) for d in named)
    return x if perm == tuple(range(x.ndim)) else bind(_transpose, x, perm=perm)


def _tensor_list(op: str, tensors) -> list[Tensor]:
    """`tensors` as a non-empty list of Tensors; ArgumentError naming the first that is not
    one (or a lone Tensor given for the list), ShapeError for none."""
    if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence):
        raise ArgumentError(f"{op}: takes a list of Tensors, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise ArgumentError(
                f"{op}: item {i} of the list is a {type(t).__name__}, not a Tensor; give it "
                "dims with nm.tensor(data, dims)"
            )
    if not tensors:
        raise ShapeError(f"{op}: needs at least one tensor")
    return list(tensors)


def _aligned_to(x: Tensor, dims: tuple[str, ...], op: str) -> Tensor:
    if set(x.dims) != set(dims):
        raise ShapeError(f"{op}: operands have different dims: {dims} and {x.dims}")
    return transpose(x, *dims)


# --- reshape ----------------------------------------------------------------------------
_reshape = primitive(
    "reshape",
    lambda x, shape, dims: Aval(dims, shape, x.dtype),
    lambda x, shape, dims: np.reshape(x, shape),
    lambda x, shape, dims: jnp.reshape(x, shape),
    cost_rule=zero_flops_cost,
    backward_reads="nothing",
    numpy_kernel=lambda shape, dims: operator.methodcaller("reshape", shape),
)


@remembered
def reshape(x: Tensor, new: Mapping[str, int], from_: DimsLike) -> Tensor:
    """Merge or split dims: the dims `from_` become the dims `new` (name -> size, in order),
    placed where the first of `from_` was. One size may be -1 (inferred).

    `reshape(x, {"heads": 8, "d_head": 64}, from_="d_model")` splits;
    `reshape(x, {"d_model": 512}, from_="heads d_head")` merges.
    """
    src = parse_dims(from_, "reshape from_", have=x.dims)
    require_dims("reshape from_", src, x.dims)
    if not src:
        raise ShapeError(f"reshape: from_ names no dim of the tensor {x.dims}")
    names = parse_dims(tuple(new), "reshape new dims")
    clash = [d for d in names if d in x.dims and d not in src]
    if clash:
        raise ShapeError(f"reshape: new dim(s) {clash} already name other dims of {x.dims}")
    total = math.prod(x.size_of(d) for d in src)
    sizes = [integer("reshape", f"the size of new dim {d!r}", s) for d, s in new.items()]
    if sizes.count(-1) == 1:
        known = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = total // known if known and total % known == 0 else -2
    if any(s < 0 for s in sizes) or math.prod(sizes) != total:
        raise ShapeError(
            f"reshape: new dims {dict(zip(names, new.values(), strict=True))} do not hold the "
            f"{total} elements of {fmt_dims(src, [x.size_of(d) for d in src])}"
        )
    first = builtins.min(x.dims.index(d) for d in src)
    rest = [d for d in x.dims if d not in src]
    order = rest[:first] + list(src) + rest[first:]
    x = transpose(x, *order)
    dims = tuple(rest[:first]) + names + tuple(rest[first:])
    shape = tuple(x.sizes[d] for d in rest[:first]) + tuple(sizes)
    shape += tuple(x.sizes[d] for d in rest[first:])
    return bind(_reshape, x, shape=shape, dims=dims)


# --- concat / split / stack -----------------------------------------------------------
def _concat_rule(*xs, axis):
    first = xs[0]
    for x in xs[1:]:
        for i, (d, s) in enumerate(zip(x.dims, x.shape, strict=True)):
            if i != axis and s != first.shape[i]:
                raise ShapeError(
                    f"concat: dim {d!r} has size {first.shape[i]} in operand 0 but {s} in another "
                    f"operand {fmt_dims(x.dims, x.shape)}"
                )
    n = builtins.sum(x.shape[axis] for x in xs)
    shape = first.shape[:axis] + (n,) + first.shape[axis + 1 :]
    return Aval(first.dims, shape, result_dtype(*(x.dtype for x in xs)))


_concat = primitive(
    "concat",
    _concat_rule,
    lambda *xs, axis: np.concatenate(xs, axis=axis),
    lambda *xs, axis: jnp.concatenate(xs, axis=axis),
    cost_rule=zero_flops_cost,
    backward_reads="nothing",
    numpy_kernel=lambda axis: lambda *xs: np.concatenate(xs, axis=axis),
)


@remembered
def concat(tensors: Sequence[Tensor], dim: str) -> Tensor:
    """Join tensors along their existing dim `dim`; the other dims must agree by name."""
    tensors = _tensor_list("concat", tensors)
    first = tensors[0]
    axis = axis_of(first, dim, "concat")
    ts = [first] + [_aligned_to(t, first.dims, "concat") for t in tensors[1:]]
    return bind(_concat, *ts, axis=axis)


def _stack_rule(*xs, dim):
    for x in xs[1:]:
        if x.shape != xs[0].shape:
            raise ShapeError(
                f"stack: operands have different sizes: {fmt_dims(xs[0].dims, xs[0].shape)} and "
                f"{fmt_dims(x.dims, x.shape)}"
            )
    return Aval((dim,) + xs[0].dims, (len(xs),) + xs[0].shape, result_dtype(*(x.dtype for x in xs)))


_stack = primitive(
    "stack",
    _stack_rule,
    lambda *xs, dim: np.stack(xs),
    lambda *xs, dim: jnp.stack(xs),
    cost_rule=zero_flops_cost,
    backward_reads="nothing",
)


@remembered
def stack(tensors: Sequence[Tensor], dim: str) -> Tensor:
    """Stack tensors with the same dims along a new first dim `dim`."""
    tensors = _tensor_list("stack", tensors)
    first = tensors[0]
    if dim in first.dims:
        raise ShapeError(f"stack: new dim {dim!r} is already a dim of {first.dims}")
    ts = [first] + [_aligned_to(t, first.dims, "stack") for t in tensors[1:]]
    return bind(_stack, *ts, dim=dim)


def _split_rule(x, axis, sizes):
    return tuple(Aval(x.dims, x.shape[:axis] + (s,) + x.shape[axis + 1 :], x.dtype) for s in sizes)


def _split_np(x, axis, sizes, xp=np):
    return tuple(xp.split(x, np.cumsum(sizes)[:-1].tolist(), axis=axis))


_split = primitive(
    "split",
    _split_rule,
    _split_np,
    lambda x, axis, sizes: _split_np(x, axis, sizes, jnp),
    cost_rule=zero_flops_cost,
    multiple_results=True,
    backward_reads="nothing",
)


def split(x: Tensor, dim: str, sizes: int | Sequence[int]) -> tuple[Tensor, ...]:
    """Cut `x` along `dim` into `sizes` equal parts (an int) or parts of the given sizes."""
    axis = axis_of(x, dim, "split")
    n = x.shape[axis]
    if isinstance(sizes, int | np.integer) and not isinstance(sizes, bool):
        sizes = int(sizes)
        if sizes < 1 or n % sizes:
            raise ShapeError(f"split: {sizes} equal parts do not divide dim {dim!r} of size {n}")
        sizes = (n // sizes,) * sizes
    if not isinstance(sizes, Sequence | np.ndarray):
        raise ArgumentError(f"split: sizes must be an int or a list of ints, got {sizes!r}")
    sizes = tuple(integer("split", f"a part's size along {dim!r}", s) for s in sizes)
    if builtins.sum(sizes) != n or builtins.min(sizes) < 0:
        raise ShapeError(f"split: sizes {sizes} do not add up to the size {n} of dim {dim!r}")
    return bind(_split, x, axis=axis, sizes=sizes)


# --- slice / pad / shift --------------------------------------------------------------
def _slice_rule(x, axis, start, stop, step):
    n = len(range(start, stop, step))
    return Aval(x.dims, x.shape[:axis] + (n,) + x.shape[axis + 1 :], x.dtype)


def _slicer(axis, start, stop, step):
    return (builtins.slice(None),) * axis + (builtins.slice(start, stop, step),)


_slice = primitive(
    "slice",
    _slice_rule,
    lambda x, axis, start, stop, step: x[_slicer(axis, start, stop, step)],
    lambda x, axis, start, stop, step: x[_slicer(axis, start, stop, step)],
    cost_rule=zero_flops_cost,
    backward_reads="nothing",
    numpy_kernel=lambda **p: operator.itemgetter(_slicer(**p)),
)


@remembered
def slice_(
    x: Tensor, dim: str, start: int | None = None, stop: int | None = None, step: int = 1
) -> Tensor:
    """Elements `start:stop:step` along `dim` (Python slice rules, positive step)."""
    axis = axis_of(x, dim, "slice")
    if not isinstance(step, int | np.integer) or step < 1:
        raise ShapeError(f"slice: step must be a positive int, got {step!r} for dim {dim!r}")
    for what, v in (("start", start), ("stop", stop)):
        if v is not None:
            integer("slice", f"{what} along {dim!r}", v)
    start, stop, step = builtins.slice(start, stop, step).indices(x.shape[axis])
    stop = builtins.max(stop, start)
    return bind(_slice, x, axis=axis, start=start, stop=stop, step=step)


def _pad_rule(x, widths, value):
    shape = tuple(s + lo + hi for s, (lo, hi) in zip(x.shape, widths, strict=True))
    return Aval(x.dims, shape, x.dtype)


_pad = primitive(
    "pad",
    _pad_rule,
    lambda x, widths, value: np.pad(x, widths, constant_values=np.asarray(value, x.dtype)),
    lambda x, widths, value: jnp.pad(x, widths, constant_values=value),
    cost_rule=zero_flops_cost,
    backward_reads="nothing",
)


@remembered
def pad(x: Tensor, widths: Mapping[str, int | tuple[int, int]], value=0) -> Tensor:
    """Pad dims with `value`: `widths` maps a dim to (before, after) or to one int for both."""
    require_dims("pad", widths, x.dims)
    pairs = []
    for d in x.dims:
        w = widths.get(d, (0, 0))
        pair = tuple(w) if isinstance(w, tuple | list | np.ndarray) else (w, w)
        if len(pair) != 2:
            raise ShapeError(f"pad: width for dim {d!r} must be an int or (lo, hi), got {w!r}")
        lo, hi = (integer("pad", f"the width for dim {d!r}", v) for v in pair)
        if lo < 0 or hi < 0:
            raise ShapeError(f"pad: negative width {w!r} for dim {d!r}")
        pairs.append((lo, hi))
    fits_dtype("pad", "value", value, x.dtype)
    return bind(_pad, x, widths=tuple(pairs), value=value)


def _shift_impl(xp):
    def impl(x, axis, offset, wrap, fill):
        if wrap:
            return xp.roll(x, offset, axis=axis)
        n = x.shape[axis]
        k = builtins.min(builtins.abs(offset), n)
        fill_shape = x.shape[:axis] + (k,) + x.shape[axis + 1 :]
        filler = xp.full(fill_shape, fill, dtype=x.dtype)
        if offset >= 0:
            kept = x[_slicer(axis, 0, n - k, 1)]
            return xp.concatenate([filler, kept], axis=axis)
        kept = x[_slicer(axis, k, n, 1)]
        return xp.concatenate([kept, filler], axis=axis)

    return impl


_shift = primitive(
    "shift",
    lambda x, axis, offset, wrap, fill: Aval(x.dims, x.shape, x.dtype),
    _shift_impl(np),
    _shift_impl(jnp),
    cost_rule=zero_flops_cost,
    backward_reads="nothing",
)


@remembered
def shift(x: Tensor, dim: str, offset: int, wrap: bool = False, fill=0) -> Tensor:
    """Move values `offset` places along `dim` (out[i] = x[i - offset]).

    Positions left empty get `fill`; with `wrap=True` values leaving one end enter the other.
    """
    axis = axis_of(x, dim, "shift")
    offset = integer("shift", "offset", offset)
    fits_dtype("shift", "fill", fill, x.dtype)
    return bind(_shift, x, axis=axis, offset=offset, wrap=bool(wrap), fill=fill)


# --- one_hot / gather / stop_gradient ------------------------------------------------
def wide_indices(idx):
    """Integer indices (NumPy or jax) of at least 32 bits, so that sizes, offsets and
    `idx + n` fit their dtype; every rule doing arithmetic on indices widens first."""
    return idx.astype(np.int32) if idx.dtype.itemsize < 4 else idx


def _one_hot_rule(idx, dim, n, dtype):
    if idx.dtype.kind not in "iu":
        raise ShapeError(f"one_hot: indices must be integers, got {idx.dtype} {idx.dims}")
    return Aval(idx.dims + (dim,), idx.shape + (n,), dtype)


_one_hot = primitive(
    "one_hot",
    _one_hot_rule,
    lambda i, dim, n, dtype: (i[..., None] == np.arange(n)).astype(dtype),
    lambda i, dim, n, dtype: jax.nn.one_hot(wide_indices(i), n, dtype=dtype),
    backward_reads="nothing",
)


@remembered
def one_hot(indices: Tensor, dim: str, n: int, dtype=np.float32) -> Tensor:
    """A new last dim `dim` of size `n`: 1 where its index equals `indices`, else 0 (also
    for out-of-range indices)."""
    if dim in indices.dims:
        raise ShapeError(f"one_hot: new dim {dim!r} is already a dim of {indices.dims}")
    n = integer("one_hot", f"the size of the new dim {dim!r}", n, 0)
    return bind(_one_hot, indices, dim=dim, n=n, dtype=native_dtype(dtype))


def _gather_dims(x, idx, axis):
    new = tuple(d for d in idx.dims if d not in x.dims)
    return x.dims[:axis] + new + x.dims[axis + 1 :]


def _gather_rule(x, idx, axis, dims):
    if idx.dtype.kind not in "iu":
        raise ShapeError(f"gather: indices must be integers, got {idx.dtype} {idx.dims}")
    dim = x.dims[axis]
    if dim in idx.dims:
        raise ShapeError(f"gather: indices {idx.dims} must not have the gathered dim {dim!r}")
    sizes = agreed_sizes("gather", (x, idx), ("the tensor", "the indices"))
    out = _gather_dims(x, idx, axis)
    return Aval(out, tuple(sizes[d] for d in out), x.dtype)


def _gather_impl(xp):
    def impl(x, idx, axis, dims):
        x_dims, idx_dims, out_dims = dims
        n = x.shape[axis]
        idx = wide_indices(idx)
        idx = xp.clip(xp.where(idx < 0, idx + n, idx), 0, n - 1)
        if not set(idx_dims) & set(x_dims):
            # whole slices of x at each index (an embedding's rows): one row gather, its
            # gradient one row scatter; an arange index per other dim made XLA gather
            # and scatter element by element over an index array per element
            return xp.take(x, idx, axis=axis, mode="clip")
        index = []
        for a, d in enumerate(x_dims):
            if a == axis:
                index.append(align(idx, idx_dims, out_dims, xp))
            else:
                shape = [1] * len(out_dims)
                shape[out_dims.index(d)] = x.shape[a]
                index.append(xp.arange(x.shape[a]).reshape(shape))
        return x[tuple(index)]

    return impl


_gather = primitive(
    "gather",
    _gather_rule,
    _gather_impl(np),
    _gather_impl(jnp),
    cost_rule=zero_flops_cost,
    backward_reads="constant",
)


@remembered
def gather(x: Tensor, dim: str, indices: Tensor) -> Tensor:
    """Pick elements of `x` along `dim` at integer `indices` (xarray's vectorized `isel`).

    Dims of `indices` that `x` also has are matched pointwise; its other dims replace `dim`,
    in place. Negative indices count from the end; out-of-range ones are clamped.
    """
    axis = axis_of(x, dim, "gather")
    out = _gather_dims(x, indices, axis)
    if x.shape[axis] == 0 and math.prod(indices.shape):  # (NumPy and jax: a bare IndexError)
        raise ShapeError(
            f"gather: dim {dim!r} of {fmt_dims(x.dims, x.shape)} has size 0: there is no "
            f"element to pick at the indices {fmt_dims(indices.dims, indices.shape)}"
        )
    return bind(_gather, x, indices, axis=axis, dims=(x.dims, indices.dims, out))


_stop_gradient = primitive(
    "stop_gradient",
    lambda x: Aval(x.dims, x.shape, x.dtype),
    _identity,
    jax.lax.stop_gradient,
    cost_rule=lambda i, o, p: zero_flops_cost(i, o, p)._replace(bytes=0),
    backward_reads="nothing",
    stops_gradient=True,
)


def stop_gradient(x: Tensor) -> Tensor:
    """`x`, through which no gradient flows."""
    return bind(_stop_gradient, x)


def _constraint_rules(x: Tensor, layout) -> Rules:
    """The rules of `nm.constrain(x, layout)`, checked as far as no mesh is needed: well
    formed, naming dims of x, no mesh axis on two dims (a constraint is strict)."""
    try:
        rules = parse_rules(layout)
    except LayoutError as e:
        raise LayoutError(f"constrain of the value {fmt_dims(x.dims, x.shape)}: {e}") from None
    shown = format_rules(rules)
    unknown = [d for d, _ in rules if d not in x.dims]
    if unknown:
        raise LayoutError(
            f"constrain {shown!r}: names dim(s) {unknown} that the value {x.dims} lacks"
            + did_you_mean(unknown[0], x.dims)
        )
    taken: dict[str, str] = {}
    for d, axes in rules:
        for a in axes:
            if a in taken:
                raise LayoutError(
                    f"constrain {shown!r}: mesh axis {a!r} would split both {taken[a]!r} and "
                    f"{d!r} of the value {fmt_dims(x.dims, x.shape)}"
                )
            taken[a] = d
    return rules


_constrain = primitive(
    "constrain",
    lambda x, layout: Aval(x.dims, x.shape, x.dtype),
    _identity,
    _identity,
    cost_rule=lambda i, o, p: zero_flops_cost(i, o, p)._replace(bytes=0),
    backward_reads="nothing",
    pins_layout=True,
    aliases_input=True,
)


def constrain(x: Tensor, layout) -> Tensor:
    """`x`, pinned by the lowering to `layout` at this point of the program.

    `layout` is a rule string such as `"batch:rows;seq:cols"` (or a dict / list of pairs);
    dims it does not name are replicated there. Eagerly, and on one device, the identity.
    A malformed rule, a dim x lacks, or a mesh axis given to two dims is a LayoutError
    here; a mesh axis the mesh lacks, one when lowered, naming this constraint.
    """
    if not isinstance(layout, str | Mapping | Sequence):
        raise ShapeError(f"constrain: layout must be a rule string, dict or list, got {layout!r}")
    return bind(_constrain, x, layout=_constraint_rules(x, layout))


# How the property strategies' random programs apply these (Primitive.example; the
# signature is there): each keeps the tensor's dims, so later steps can use it.
def _reshaped(a, b, d, k):
    n = a.size_of(d)
    if n % 2 or n <= 2:
        return None
    split_ = reshape(a, {d + "_hi": 2, d + "_lo": n // 2}, from_=d)
    return reshape(split_ * 0.5, {d: n}, from_=(d + "_hi", d + "_lo"))


def _gathered(a, b, d, k):
    n = a.size_of(d)
    idx = b.argmax(b.dims[k % len(b.dims)]) % n if b.dims else a.argmax(d)
    if d in idx.dims:  # indices may not have the gathered dim
        idx = idx.sum(d) % n
    return gather(a, d, idx - n if k % 2 else idx)  # -n..-1: counted from the end


def _split_and_joined(a, b, d, k):
    n = a.size_of(d)
    return None if n < 2 else concat(split(a, d, [1 + k % (n - 1), n - 1 - k % (n - 1)])[::-1], d)


_rename.example = lambda a, b, d, k: rename(rename(a, {d: d + "_r"}) * 0.5, {d + "_r": d})
_transpose.example = lambda a, b, d, k: transpose(a, *reversed(a.dims))
_reshape.example = _reshaped
_concat.example = lambda a, b, d, k: concat(
    [a, b * 0.5] if d in b.dims and set(b.dims) == set(a.dims) else [a, a * 0.5], d
)
_stack.example = lambda a, b, d, k: stack([a, a * 0.5], d + "_s").sum(d + "_s")
_split.example = _split_and_joined
_slice.example = lambda a, b, d, k: None if not a.size_of(d) else slice_(
    a, d, k % a.size_of(d), None if k % 2 else max(k % a.size_of(d) + 1, a.size_of(d) - 1),
    1 + k // 2 % 2,
)  # fmt: skip
_pad.example = lambda a, b, d, k: pad(a, {d: (k % 3, k // 3 % 2)}, value=0.25)
_shift.example = lambda a, b, d, k: shift(
    a, d, k % (2 * a.size_of(d) + 1) - a.size_of(d), wrap=bool(k % 2), fill=0.5
)
_one_hot.example = lambda a, b, d, k: one_hot(a.argmax(d), d, a.size_of(d)) * a
_gather.example = _gathered
_stop_gradient.example = lambda a, b, d, k: stop_gradient(a) * b
_constrain.example = "drawn as Program.constraints (strategies.constraints): a layout per mesh"
