"""`scan`: a loop over one dim whose body is traced once, so that a program's size (and
its compile time) does not grow with the number of iterations, e.g. of layers."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from namedmesh.avals import fmt_aval
from namedmesh.checks import integer, require_dims
from namedmesh.errors import ArgumentError, ParameterError, ShapeError
from namedmesh.primitive import Aval, Cost, bind, primitive
from namedmesh.tensor import Tensor
from namedmesh.trace import evaluate, tensor_leaves, trace_nested
from namedmesh.uneven import Masked, padded_scan, uneven_stages

# What a scan's backward pass keeps of each iteration: every residual jax saves ("none"),
# only the carry, recomputing the rest ("full"), or the carry and matmul outputs ("dots").
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
}


def checkpointed(step: Callable, remat: str, prevent_cse: bool = False) -> Callable:
    """`step` (a scan body over jax arrays) under the rematerialisation policy `remat`.
    Without `prevent_cse` (the default): a scan's body is only ever called inside
    lax.scan, which already keeps XLA from merging the recomputation with the forward
    pass, so jax.checkpoint's optimization barriers would only hinder XLA's fusion of
    the recomputed forward into the backward pass (jax.checkpoint's documentation)."""
    if remat == "none":
        return step
    return jax.checkpoint(step, policy=REMAT_POLICIES[remat], prevent_cse=prevent_cse)


# unroll="auto" unrolls a scan whose iterations together trace to at most this many jax
# equations (the body's, counted into its sub-programs, times the length), and keeps a
# loop above it: on XLA:CPU an unrolled layer stack's training step ran 0.87-0.94 of the
# loop's time at every size measured, and its compile grew about 0.5 s of CPU per 100
# equations up to 3,264 (a loop's stays flat), far steeper past this budget (the fused
# kernel's 8k-token stack, 42,524 equations: 518 s against 40 s looped; docs/benchmarks.md,
# "The layer loop: unrolled where it measures faster", benchmarks/layer_loop.py).
UNROLL_BUDGET = 8192


def equations(jaxpr) -> int:
    """The equations of a (closed) jaxpr, each sub-program's (a cond's branches, a
    loop's body, a custom_vjp's forward, a pjit's) counted into it: a proxy for what
    XLA compiles."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    n = 0
    for eqn in inner.eqns:
        n += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    n += equations(sub)
    return n


def unrolls(step: Callable, carry, xs, length: int, unroll, remat: str = "none") -> bool:
    """Whether `scan`'s lax.scan of `step` over `xs` unrolls: `unroll` itself when a
    bool; for "auto", when no remat is asked for (unrolled, XLA merges the recomputation
    with the forward pass and the memory remat saves is lost) and the unrolled program
    stays within UNROLL_BUDGET equations (compile time grows with it)."""
    if unroll != "auto":
        return unroll
    if remat != "none" or length <= 1:  # XLA drops a loop of one trip itself
        return False
    # the first slices, typed as the loop's (in a shard_map, varying as they vary)
    body = jax.make_jaxpr(step)(list(carry), [x[0] for x in xs])
    return length * equations(body) <= UNROLL_BUDGET


def loop(step: Callable, carry, xs, length: int, remat: str, unroll):
    """jax.lax.scan of `step` (c, x) -> (c, y) under the remat policy `remat`, unrolled
    or not as `unrolls` decides: `scan`'s jax implementation, eager and lowered."""
    whole = unrolls(step, carry, xs, length, unroll, remat)
    return jax.lax.scan(checkpointed(step, remat), carry, xs, length=length, unroll=whole)


def _slices(xs, axes, i, take):
    return [take(x, i, ax) for x, ax in zip(xs, axes, strict=True)]


def _scan_rule(
    *args, body, n_carry, n_x, x_axes, dim, length, trees, remat="none", unroll=False, skip=False
):
    carry = [Aval(a.dims, tuple(a.shape), np.dtype(a.dtype)) for a in args[:n_carry]]
    ys = [Aval((dim,) + v.dims, (length,) + v.shape, v.dtype) for v in body.outputs[n_carry:]]
    return tuple(carry) + tuple(ys)


def _scan_numpy(
    *arrays,
    body,
    n_carry,
    n_x,
    x_axes,
    dim,
    length,
    trees,
    remat="none",
    unroll=False,
    skip=False,
):  # (skip: a Masked body's pads run, the identity by its `where`; only the lowering skips)
    carry, xs = list(arrays[:n_carry]), arrays[n_carry : n_carry + n_x]
    rest = list(arrays[n_carry + n_x :])
    ys = []
    for i in range(length):
        x = _slices(xs, x_axes, i, lambda a, i, ax: np.take(a, i, axis=ax))
        outs = evaluate(body, carry + x + rest, "numpy")
        carry, y = list(outs[:n_carry]), outs[n_carry:]
        ys.append(y)
    y_avals = [v.aval for v in body.outputs[n_carry:]]
    stacked = [
        np.stack([y[k] for y in ys]) if ys else np.zeros((0,) + a.shape, a.dtype)
        for k, a in enumerate(y_avals)
    ]
    return (*carry, *stacked)


def _scan_jax(
    *arrays,
    body,
    n_carry,
    n_x,
    x_axes,
    dim,
    length,
    trees,
    remat="none",
    unroll=False,
    skip=False,
):
    carry, xs = list(arrays[:n_carry]), arrays[n_carry : n_carry + n_x]
    rest = list(arrays[n_carry + n_x :])
    xs = [jnp.moveaxis(x, ax, 0) for x, ax in zip(xs, x_axes, strict=True)]

    def step(c, x):
        outs = evaluate(body, [*c, *x, *rest], "jax")
        return list(outs[:n_carry]), list(outs[n_carry:])

    carry, ys = loop(step, carry, xs, length, remat, unroll)
    return (*carry, *ys)


def _scan_cost(in_avals, out_avals, params) -> Cost:
    body, flops, nbytes = params["body"], 0.0, 0.0
    for e in body.eqns:
        c = e.primitive.cost_rule([v.aval for v in e.inputs], [v.aval for v in e.outputs], e.params)
        flops, nbytes = flops + c.flops, nbytes + c.bytes
    return Cost(flops * params["length"], nbytes * params["length"])


# A scan's backward pass reads its inputs (the shared values and the scanned slices,
# from which it recomputes under remat); what it keeps of each iteration follows its
# body and remat policy (lowering/memory.py looks into the body).
_scan = primitive(
    "scan",
    _scan_rule,
    _scan_numpy,
    _scan_jax,
    cost_rule=_scan_cost,
    multiple_results=True,
    backward_reads="inputs",
    loop=True,
)


def scan(
    f: Callable,
    init,
    xs,
    dim: str,
    length: int | None = None,
    remat: str = "none",
    unroll: bool | str = False,
):
    """`carry, y = f(carry, x)` for each index of `dim`, in order, where `x` is `xs`
    (a pytree of Tensors that all have `dim`) at that index. Returns the last carry and
    the `y`s stacked along a new first dim `dim`. `f` must return a carry with the
    dims, sizes and dtypes of `init`; it may use other tensors too (weights shared by
    all iterations). `length` is needed only when `xs` has no tensors.

    `remat` is what the backward pass keeps of each iteration (`REMAT_POLICIES`): "none"
    keeps every residual (memory grows with the body's activations times the length);
    "full" keeps only the carry and recomputes the body in the backward pass; "dots"
    keeps the matmul (einsum) outputs too. Values and gradients do not change.

    `unroll=True` runs the iterations one after another in the compiled program instead
    of as one loop: the program grows with `length` and takes longer to compile, and XLA
    can fuse across iterations and schedule them together (on XLA:CPU a 4-layer GPT's
    training step ran 10-20% faster unrolled, benchmarks/long_seq.py). `unroll="auto"`
    unrolls where that measured faster at a compile time like the loop's: when `remat` is
    "none" and the iterations together trace to at most `UNROLL_BUDGET` jax equations
    (`unrolls`)."""
    if remat not in REMAT_POLICIES:
        raise ParameterError(
            f"scan over {dim!r}: remat must be one of {sorted(REMAT_POLICIES)}, got {remat!r}"
        )
    if unroll != "auto" and not isinstance(unroll, bool | np.bool_):
        raise ArgumentError(
            f"scan over {dim!r}: unroll must be True, False or 'auto', got {unroll!r}"
        )
    unroll = unroll if unroll == "auto" else bool(unroll)
    carry, carry_tree = tensor_leaves(init, "scan's init")
    x_leaves, x_tree = tensor_leaves(xs, "scan's xs")
    sizes = {x.size_of(dim) if dim in x.dims else None for x in x_leaves}
    for x in x_leaves:
        require_dims("scan", [dim], x.dims, "a tensor of xs")
    if length is not None:
        sizes.add(integer(f"scan over {dim!r}", "length", length, 0))
    if len(sizes) != 1:
        raise ShapeError(
            f"scan over {dim!r}: sizes disagree or are unknown: xs have {sorted(sizes - {None})}"
            + ("" if length is None else f", length={length}")
            + ("" if x_leaves or length is not None else " (pass length= when xs is empty)")
        )
    (n,) = sizes
    if x_leaves and (stages := uneven_stages(dim, n)):  # uneven pipeline stages: padded
        return padded_scan(scan, f, init, xs, dim, n, stages, remat=remat, unroll=unroll)
    x_axes = tuple(x.dims.index(dim) for x in x_leaves)
    slice_of = lambda x, ax: Tensor._make(
        jax.ShapeDtypeStruct(x.shape[:ax] + x.shape[ax + 1 :], x.dtype),
        x.dims[:ax] + x.dims[ax + 1 :],
    )
    example_carry = [Tensor._make(jax.ShapeDtypeStruct(c.shape, c.dtype), c.dims) for c in carry]
    example_x = [slice_of(x, ax) for x, ax in zip(x_leaves, x_axes, strict=True)]
    y_tree = []

    def body(c, x):
        new_carry, y = f(
            jax.tree_util.tree_unflatten(carry_tree, c), jax.tree_util.tree_unflatten(x_tree, x)
        )
        new, tree = tensor_leaves(new_carry, "the carry f returns")
        if tree != carry_tree or [t.aval for t in new] != [t.aval for t in carry]:
            got = ", ".join(fmt_aval(t.aval) for t in new)
            want = ", ".join(fmt_aval(t.aval) for t in carry)
            raise ShapeError(f"scan over {dim!r}: f returned the carry ({got}); init is ({want})")
        ys, tree = tensor_leaves(y, "the ys f returns")
        y_tree.append(tree)
        return new + ys

    graph, captured = trace_nested(body, example_carry, example_x)
    outs = bind(
        _scan,
        *carry,
        *x_leaves,
        *(Tensor._make(v, v.dims) for v in captured),
        body=graph,
        n_carry=len(carry),
        n_x=len(x_leaves),
        x_axes=x_axes,
        dim=dim,
        length=n,
        trees=(carry_tree, y_tree[0]),
        remat=remat,
        unroll=unroll,
        skip=isinstance(f, Masked),  # uneven stages' pads: skipped where lowered (uneven.py)
    )
    final = jax.tree_util.tree_unflatten(carry_tree, list(outs[: len(carry)]))
    return final, jax.tree_util.tree_unflatten(y_tree[0], list(outs[len(carry) :]))


def _scan_example(a, b, d, k):
    """The property strategies' scan (Primitive.example): a loop over d whose body
    contracts with b (used by every step)."""
    extra = [x for x in b.dims if x not in a.dims or x == d]

    def body(c, x):
        mixed = (x * b).sum(extra) if extra else x * b
        c = (c + x) * 0.5 + 0.1 * mixed
        return c, c * 0.5

    return scan(body, a.sum(d) * 0.1, a, d)[1]


_scan.example = _scan_example
