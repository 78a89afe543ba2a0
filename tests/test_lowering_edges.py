"""Lowered programs at the edges the property strategies do not draw: dims of size 0,
constants gathered along a split dim, and gradients of reductions over nothing. Each
case is held to NumPy (values) or to jax.grad of the program on one device (gradients),
and run in the emitter's check mode, which holds every value jax makes to the plan's
shape, dtype and varying axes."""

import jax
import numpy as np
import pytest

import namedmesh as nm
from lowering import Layout, Mesh, lower


@pytest.fixture(scope="module")
def line():
    return Mesh({"x": 8})


@pytest.fixture(scope="module")
def grid():
    return Mesh({"rows": 2, "cols": 4})


@pytest.fixture(scope="module")
def x():
    return nm.tensor(np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32), "b v")


def run(fn, mesh, layout, *xs):
    return lower(fn, mesh, Layout(layout, shared=True), check=True)(*xs)


def empty_then_whole(x):
    """cumsum and softmax of x's first 0 columns, joined to x along the split dim."""
    none = nm.slice(x, "v", 0, 0)
    return nm.concat([nm.cumsum(none, "v"), nm.softmax(none, "v"), x], "v")


def test_a_dim_of_size_0_is_not_split(x, line, grid):
    """A size-0 dim divides by any mesh axis, but was split, and the relayout that joined
    it to x gathered it: XLA's verifier refused an all_gather over a dim of size 0."""
    for mesh, layout in ((line, "v:x"), (grid, "v:cols,rows")):
        got = run(empty_then_whole, mesh, layout, x)
        np.testing.assert_array_equal(np.asarray(got.data), x.data)
    zero = nm.tensor(np.zeros((8, 0), np.float32), "b v")
    got = run(lambda z: nm.sum(nm.cumsum(z, "v"), "v"), grid, "b:rows;v:cols", zero)
    np.testing.assert_array_equal(np.asarray(got.data), np.zeros(8, np.float32))


def test_gradient_of_a_product_over_nothing(x, line):
    """prod over a dim of size 0 is 1 whatever x: its gradient is 0. Inside shard_map
    jax typed that gradient invariant and the psum of the loss's transpose refused it."""
    loss = lambda x: nm.sum(nm.prod(nm.slice(x, "v", 0, 0), "v"))
    lowered = lower(loss, line, "b:x")
    assert float(lowered(x).data) == 8.0
    got = jax.grad(lambda x: lowered(x).data)(x)
    np.testing.assert_array_equal(np.asarray(got.data), np.zeros((8, 8), np.float32))


def constants_moved(x):
    """Constants over the split dim v (made alike on every device: typed invariant)
    all-gathered (concat), moved by an all_to_all (constrain) and reduce-scattered (an
    einsum summing v into b, which the rules split on the same axis)."""
    c = nm.full({"b": 8, "v": 8}, 2.0)
    joined = nm.concat([x, nm.zeros({"b": 8, "v": 8})], "v")
    return [joined, x + nm.constrain(c, "b:x"), nm.einsum(c, c, out="b")]


def test_constants_moved_along_a_split_dim(x, line):
    """Each collective gives a value jax types varying over its axes, which the plan said
    was not, and cast again: a raw 'Unsupported pcast' error."""
    joined, moved, summed = run(constants_moved, line, "v:x;b:x", x)
    np.testing.assert_array_equal(np.asarray(joined.data), np.concatenate([x.data, 0 * x.data], 1))
    np.testing.assert_array_equal(np.asarray(moved.data), x.data + 2)
    np.testing.assert_array_equal(np.asarray(summed.data), np.full(8, 32, np.float32))


def test_top_k_along_a_split_dim_beside_a_dim_of_size_0(grid):
    """The candidates merged with an explicit length: reshape(-1) cannot solve for it
    where another dim has size 0 (a raw ZeroDivisionError)."""
    z = nm.tensor(np.zeros((8, 0), np.float32), "b v")
    values, indices = run(lambda z: nm.top_k(z, "b", 2, "k"), grid, "b:cols", z)
    assert values.dims == indices.dims == ("k", "v")
    assert values.shape == indices.shape == (2, 0)


def test_a_gradient_inside_a_lowered_function_is_a_typed_error_that_says_what_to_do(x, line):
    """nm.grad inside lower met traced arguments; jax's TypeError about a Var became a
    TracedValueError that pointed to jax.numpy and to adding a primitive."""
    loss = lambda x: nm.sum(x * x)
    for make in (nm.grad, nm.value_and_grad):
        with pytest.raises(nm.TracedValueError, match=r"(?s)traced.*jax\.grad\(lambda"):
            lower(make(loss), line, "b:x")(x)
    np.testing.assert_allclose(np.asarray(nm.grad(loss)(x).data), 2 * x.data, rtol=1e-6)
