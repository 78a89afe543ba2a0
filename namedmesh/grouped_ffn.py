"""`grouped_ffn`: a mixture of experts' whole expert FFN as one op, each row's weights
picked by its integer group:

    h = act(x @ wi[g]) (* (x @ wg[g]), gated), out = h @ wo[g]

the composition of `grouped_matmul`s it states, as one primitive so that a lowering
moves each row to its group's device once for the whole FFN (its hidden layer never
leaves that device: lowering/rules/grouped.py), where three grouped matmuls would move
it there and back three times. jax computes it with the rows sorted by group once,
then one loop over each group's rows in blocks, the whole FFN a block
(namedmesh/grouped_slots.py); a few rows (a decoding step's) by the row kernel
(`grouped_rows`); each product in the promoted dtype as the composition computes it;
the gradient written out (a custom vjp) by the same blocks.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

from namedmesh.errors import DtypeError, ParameterError, ShapeError, fmt_dims
from namedmesh.grouped import as_groups, as_rows, grouped_aval, grouped_rows, grouped_rows_np, roles
from namedmesh.grouped_slots import blocked_ffn, loop_blocks, saved_rows
from namedmesh.primitive import REGISTRY, Aval, Cost, bind, is_inexact, primitive, result_dtype
from namedmesh.tensor import Tensor


def _elementwise(name: str) -> tuple:
    """(NumPy, jax) of the registered elementwise op `name` on the hidden rows (n, f):
    the fused FFN applies the very functions nm.relu, nm.gelu and nm.silu apply."""
    p, rows = REGISTRY[name], ("rows", "hidden")
    return tuple(
        functools.partial(impl, in_dims=(rows,), out_dims=rows)
        for impl in (p.numpy_impl, p.jax_impl)
    )


def _gelu_exact(erf):
    """x * Phi(x), the exact normal CDF (BERT's "gelu"), as models/layers/common.py states it."""
    return lambda x: x * (0.5 + 0.5 * erf(x * np.asarray(0.5**0.5, x.dtype)))


# activation name -> (NumPy, jax): the activations of the zoo's FFNs (Config.ffn)
ACTIVATIONS = {
    "relu": _elementwise("relu"),
    "gelu": _elementwise("gelu"),  # the tanh approximation (GPT-2's "gelu_new")
    "gelu_exact": tuple(_gelu_exact(erf) for erf in _elementwise("erf")),
    "silu": _elementwise("silu"),
}


def _ffn_rule(x, wi, wo, group, *wg, dim, dims, activation):
    op = "grouped_ffn"
    if activation not in ACTIVATIONS:
        raise ParameterError(
            f"{op}: activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}"
        )
    names = ("x", "wi", "wo", "wg")
    for name, t in zip(names, (x, wi, wo, *wg), strict=False):
        if not is_inexact(t.dtype):
            raise DtypeError(f"{op}: {name} {t.dims} must be a float tensor, got {t.dtype}")
    h = grouped_aval(x, wi, group, dim, op)
    for g in wg:
        if dict(zip(g.dims, g.shape, strict=True)) != dict(zip(wi.dims, wi.shape, strict=True)):
            raise ShapeError(
                f"{op}: the gate's weight wg {fmt_dims(g.dims, g.shape)} must have the dims "
                f"and sizes of wi {fmt_dims(wi.dims, wi.shape)}"
            )
    out = grouped_aval(h, wo, group, dim, op)
    return Aval(out.dims, out.shape, result_dtype(*(t.dtype for t in (x, wi, wo, *wg))))


def ffn_rows(product, act, x, g, wi, wo, wg=None):
    """The FFN of rows x (n, c) with weights (groups, c, f) and wo (groups, f, o), each
    row's picked by g (n,), by `product(x, w, g)` (a grouped matmul of rows) and the
    activation `act`: each product's result in the operands' dtype, as the composition
    of grouped matmuls makes it."""
    h = act(product(x, wi, g))
    if wg is not None:
        h = h * product(x, wg, g)
    return product(h, wo, g)


def as_ffn_rows(xp, x, wi, wo, group, wg, dim, dims):
    """(x (rows, c), g (rows,), wi, wo, wg (or None) as (groups, in, out), the output
    shape) from the named operands, all in their promoted dtype (also the
    expert-parallel rule's, lowering/expert_routes.py)."""
    x_dims, wi_dims, wo_dims, group_dims, *wg_dims = dims
    dtype = result_dtype(*(t.dtype for t in (x, wi, wo, *([] if wg is None else [wg]))))
    contracted, hidden = roles(x_dims, wi_dims, dim)
    outs = roles(tuple(group_dims) + hidden, wo_dims, dim)[1]
    sizes = dict(zip(wo_dims, wo.shape, strict=True)) | dict(
        zip(group_dims, group.shape, strict=True)
    )
    x, wi, g, _ = as_rows(xp, x.astype(dtype), wi.astype(dtype), group, dim, x_dims, wi_dims,
                          group_dims)  # fmt: skip
    if wg is not None:
        wg = as_groups(xp, wg.astype(dtype), wg_dims[0], dim, contracted, hidden)
    wo = as_groups(xp, wo.astype(dtype), wo_dims, dim, hidden, outs)
    return x, g, wi, wo, wg, tuple(sizes[d] for d in (*group_dims, *outs))


def _ffn_np(x, wi, wo, group, *wg, dim, dims, activation):
    x, g, wi, wo, wg, shape = as_ffn_rows(np, x, wi, wo, group, *wg or [None], dim, dims)
    return ffn_rows(grouped_rows_np, ACTIVATIONS[activation][0], x, g, wi, wo, wg).reshape(shape)


def _ffn_jax(x, wi, wo, group, *wg, dim, dims, activation):
    x, g, wi, wo, wg, shape = as_ffn_rows(jnp, x, wi, wo, group, *wg or [None], dim, dims)
    act = ACTIVATIONS[activation][1]
    if 2 * x.shape[0] <= wi.shape[0]:  # a decoding step's few rows: each its own weights
        return ffn_rows(grouped_rows, act, x, g, wi, wo, wg).reshape(shape)
    return blocked_ffn(act, x, g, wi, wo, wg).reshape(shape)


def _ffn_cost(in_avals, out_avals, params) -> Cost:
    """Each row's products (2 flops per multiply-add) and its activation (and gate)."""
    x, wi = in_avals[:2]
    contracted, hidden = roles(x.dims, wi.dims, params["dim"])
    c, f = (math.prod(wi.shape[wi.dims.index(d)] for d in ds) for ds in (contracted, hidden))
    out = out_avals[0]
    group = in_avals[3]
    rows, o = math.prod(group.shape), math.prod(out.shape) // max(math.prod(group.shape), 1)
    gated = len(in_avals) == 5
    flops = rows * (2 * c * f * (1 + gated) + 2 * f * o + f * (1 + gated))
    return Cost(flops, sum(a.nbytes for a in in_avals) + out.nbytes)


def _hidden_saves(ins, params) -> float:
    """What the kernel's backward pass keeps besides the inputs, in x's sizes: the rows
    sorted by group (a row per group element: a token's k choices) and the hidden
    layer's products (x wi, and x wg gated), each as sorted rows and a smallest block
    after them (`grouped_slots.saved_rows`); the activation and its input to wo are
    recomputed from the products. (A decoding step's few rows take the row kernel,
    whose saves are as small.)"""
    x, wi, _, group, *wg = ins
    contracted, hidden = roles(x.dims, wi.dims, params["dim"])
    c, f = (math.prod(wi.shape[wi.dims.index(d)] for d in ds) for ds in (contracted, hidden))
    rows = saved_rows(math.prod(group.shape), wi.shape[wi.dims.index(params["dim"])])
    return rows * (c + f * (1 + len(wg))) / max(math.prod(x.shape), 1)


def _kernel_sizes(ins, params) -> tuple[int, ...]:
    """(c, f, o, k, n, groups, block) of the kernel's operands: the input, hidden and
    output widths, the products a row makes (2 gated), the rows, the groups and the
    largest block of the loop (`grouped_slots.loop_blocks`)."""
    x, wi, wo, group, *wg = ins
    dim = params["dim"]
    contracted, hidden = roles(x.dims, wi.dims, dim)
    c, f = (math.prod(wi.shape[wi.dims.index(d)] for d in ds) for ds in (contracted, hidden))
    groups, n = wi.shape[wi.dims.index(dim)], math.prod(group.shape)
    o = math.prod(wo.shape) // max(groups * f, 1)
    return c, f, o, 1 + len(wg), n, groups, loop_blocks(n, groups)[0]


def _backward_working(ins, params) -> float:
    """What the kernel's backward pass holds beside its saves, in x's sizes: the sorted
    rows' cotangent (n rows of the wider of x and the output), a largest block's
    masked slices of the rows, the output's cotangent and the products, its activation
    recomputed and that's cotangent (2 hidden rows a row), and one group's weights
    sliced and their float32 gradient accumulators (`grouped_slots._loop_backward`).
    Against XLA's temporaries of the kernel's gradient (jax.grad of
    `grouped_slots.blocked_ffn` on XLA:CPU, less the saves) this and the saves count
    1.01-1.12 of what XLA holds over 13 shapes (256 to 4096 rows, 2 to 16 groups,
    hidden 64 to 1024, gated or not): 1.02 at 256 rows, gated, d_model 64, hidden 128,
    4 groups; 1.08 at 1024 rows, 8 groups, hidden 96; 1.05 at the realistic size (4096
    rows, d_model 512, hidden 1024, 8 groups)."""
    c, f, o, k, n, groups, block = _kernel_sizes(ins, params)
    rows = saved_rows(n, groups) * max(c, o) + block * (c + o + k * f + 2 * f)
    return (rows + 2 * (k * c * f + f * o)) / max(math.prod(ins[0].shape), 1)


def _forward_working(ins, params) -> float:
    """What the kernel's forward holds beside its inputs, output and saves, in x's
    sizes: the sorted rows' output (`grouped_slots._loop_forward`'s ys, saved rows of
    the output's width) before they are put back in the rows' order, a largest block's
    rows and hidden-layer products, and one group's weights sliced. Against XLA:CPU's
    temporaries of the kernel's forward alone (jax.vjp of grouped_ffn, gated, silu; its
    saves are the vjp's outputs there) this is 1.00 at 128 rows in 4 groups, hidden 64,
    d_model 64; 256 rows, hidden 128; 1,024 rows in 8 groups, hidden 96; and 4,096 rows,
    hidden 1,024, d_model 512 (within 0.5%)."""
    c, f, o, k, n, groups, block = _kernel_sizes(ins, params)
    held = saved_rows(n, groups) * o + block * (c + k * f) + k * c * f + f * o
    return held / max(math.prod(ins[0].shape), 1)


_grouped_ffn = primitive(
    "grouped_ffn",
    _ffn_rule,
    _ffn_np,
    _ffn_jax,
    cost_rule=_ffn_cost,
    matmul=True,
    combines_inputs=True,
    # its backward pass reads its inputs and saves its sorted rows and products (`_hidden_saves`)
    backward_reads="inputs",
    backward_saves=lambda ins, params: _hidden_saves(ins, params),
    # and beside them, the rows' cotangent, a block's slices and hidden layer, a group's weights
    backward_working=lambda ins, params: _backward_working(ins, params),
    # and in its forward, its sorted output and products as made (`_forward_working`)
    forward_working=lambda ins, params: _forward_working(ins, params),
    # the products' gradients: each product's input's and its weight's, twice the forward
    backward_flops=2.0,
)


def grouped_ffn(
    x: Tensor,
    wi: Tensor,
    wo: Tensor,
    group: Tensor,
    wg: Tensor | None = None,
    *,
    activation: str = "relu",
    dim: str = "experts",
) -> Tensor:
    """The expert FFN `grouped_matmul(act(grouped_matmul(x, wi, group)) [*
    grouped_matmul(x, wg, group)], wo, group)` as one op: wi (and the gate's wg, of wi's
    dims) contract x's dims they share, their other dims besides `dim` (the hidden
    layer) are contracted by wo, whose other dims follow the groups' dims in the
    result. `activation`: relu, gelu (the tanh approximation), gelu_exact or silu.
    Lowered with `dim` split over a mesh axis where the rows are too, each row goes to
    its group's device and back once for the whole FFN."""
    ws = (x, wi, wo, group) + (() if wg is None else (wg,))
    dims = tuple(t.dims for t in ws)
    return bind(_grouped_ffn, *ws, dim=dim, dims=dims, activation=activation)


def _grouped_ffn_example(a, b, d, k):
    """The property strategies' grouped_ffn (Primitive.example): 2 groups of weights
    over d (and b's own dims) into a hidden dim of 3, back to d's size as `out`; rows by
    a's argmax mod 3 (group 2: zero rows); the activation and whether gated by k."""
    b = b if d in b.dims else a
    summed = [x for x in b.dims if x in a.dims and x != d]
    v = b.sum(summed) if summed else b
    scale = Tensor._make(np.array([[1.0, 0.5, -1.0], [-0.5, 2.0, 0.25]], np.float32),
                         ("group", "hidden"))  # fmt: skip
    wi = v * scale
    wo = wi.rename(**{d: "out"})
    wg = wi * 0.5 if k % 2 else None
    act = tuple(ACTIVATIONS)[k % len(ACTIVATIONS)]
    return grouped_ffn(a, wi, wo, a.argmax(d) % 3, wg, activation=act, dim="group")


_grouped_ffn.example = _grouped_ffn_example
