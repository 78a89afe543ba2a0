"""Random programs of language ops: traced-then-reference equals eager, and the jax
implementations agree with the NumPy ones (two independent implementations)."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import namedmesh as nm

DIMS = ("p", "q", "r", "s")

UNARY = ("tanh", "sin", "abs", "negative", "sigmoid", "relu", "square")
BINARY = ("add", "subtract", "multiply", "maximum")


@st.composite
def programs(draw):
    """A list of steps; each step reads tensors from the pool by index and appends one."""
    sizes = {d: draw(st.integers(1, 4)) for d in DIMS}
    n_inputs = draw(st.integers(1, 3))
    inputs = [
        tuple(draw(st.permutations(DIMS))[: draw(st.integers(0, 3))]) for _ in range(n_inputs)
    ]
    steps = [
        draw(
            st.tuples(
                st.sampled_from(
                    [
                        "unary",
                        "binary",
                        "einsum",
                        "reduce",
                        "softmax",
                        "transpose",
                        "concat",
                        "slice",
                        "pad",
                        "shift",
                        "cumsum",
                        "top_k",
                        "where",
                    ]
                ),
                st.integers(0, 10**6),
                st.integers(0, 10**6),
                st.integers(0, 10**6),
            )
        )
        for _ in range(draw(st.integers(1, 6)))
    ]
    return sizes, inputs, steps, draw(st.integers(0, 2**31 - 1))


def run_program(steps, *xs):
    pool = list(xs)
    for kind, i, j, k in steps:
        a, b = pool[i % len(pool)], pool[j % len(pool)]
        if any(a.sizes[x] != b.sizes[x] for x in set(a.dims) & set(b.dims)):
            b = a  # slice/pad/concat changed a size: combine a with itself instead
        dims = a.dims
        d = dims[k % len(dims)] if dims else None
        if kind == "unary":
            out = getattr(nm, UNARY[k % len(UNARY)])(a)
        elif kind == "binary":
            out = getattr(nm, BINARY[k % len(BINARY)])(a, b)
        elif kind == "einsum":
            union = list(dict.fromkeys(a.dims + b.dims))
            keep = [u for n, u in enumerate(union) if (k >> n) & 1]
            out = (
                nm.einsum(a, b, out=keep) if set(a.dims) != set(b.dims) or keep else nm.einsum(a, b)
            )
        elif kind == "reduce" and dims:
            red = [x for n, x in enumerate(dims) if (k >> n) & 1] or [d]
            out = getattr(nm, ("sum", "mean", "max", "min", "logsumexp")[i % 5])(a, red)
        elif kind == "softmax" and dims:
            out = nm.softmax(a, d)
        elif kind == "transpose" and len(dims) > 1:
            out = nm.transpose(a, *dims[::-1])
        elif kind == "concat" and dims:
            out = nm.concat([a, a * 0.5], d)
        elif kind == "slice" and dims:
            out = nm.slice(a, d, 0, max(1, a.size_of(d) - 1))
        elif kind == "pad" and dims:
            out = nm.pad(a, {d: (k % 2, 1)}, value=0.25)
        elif kind == "shift" and dims:
            out = nm.shift(a, d, (k % 5) - 2, wrap=bool(i % 2))
        elif kind == "cumsum" and dims:
            out = nm.cumsum(a, d, reverse=bool(i % 2))
        elif kind == "top_k" and dims:
            out = nm.top_k(a, d, 1)[0]
        elif kind == "where":
            out = nm.where(a > 0, a, b)
        else:
            out = -a
        pool.append(out)
    return pool[-1]


@given(programs())
def test_traced_reference_equals_eager_and_jax(case):
    sizes, inputs, steps, seed = case
    r = np.random.default_rng(seed)
    xs = [
        nm.tensor(r.normal(size=[sizes[d] for d in dims]).astype(np.float32), dims)
        for dims in inputs
    ]
    fn = lambda *xs: run_program(steps, *xs)
    eager = fn(*xs)
    graph = nm.trace(fn, *xs)
    ref = nm.reference(graph)(*xs)
    assert ref.dims == eager.dims and ref.dtype == eager.dtype
    np.testing.assert_allclose(ref.data, eager.data, rtol=1e-6, atol=1e-6)
    jax_out = nm.interpret(graph)(*xs)
    assert jax_out.dims == eager.dims
    np.testing.assert_allclose(np.asarray(jax_out.data), eager.data, rtol=2e-4, atol=2e-4)
