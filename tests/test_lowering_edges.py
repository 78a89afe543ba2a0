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


@pytest.fixture(scope="module")
def cube():
    return Mesh({"a": 2, "b": 2, "c": 2})


def constrained_stack(h, w):
    """Two layers whose body pins the batch to mesh axis c."""

    def body(c, wl):
        y = nm.rename(nm.tanh(nm.einsum(c, wl, out="batch e")), e="d")
        return nm.constrain(y, "batch:c"), nm.sum(y, "d")

    return nm.scan(body, h, w, "layers")[0]


@pytest.fixture(scope="module")
def stack_inputs():
    r = np.random.default_rng(1)
    h = nm.tensor(r.normal(size=(8, 4)).astype(np.float32), "batch d")
    return h, nm.tensor((0.5 * r.normal(size=(2, 4, 4))).astype(np.float32), "layers d e")


def test_a_constraint_in_a_pipelined_body_keeps_each_microbatch_divisible(cube, stack_inputs):
    """The default microbatches (8, of 1 example) left the body's constraint batch:c
    a microbatch of 1 to split 2 ways: a ShapeError about a size-0 shard; now 4."""
    want = constrained_stack(*stack_inputs).data
    got = lower(constrained_stack, cube, "layers:a")(*stack_inputs)
    np.testing.assert_allclose(np.asarray(got.data), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(nm.PipelineError, match=r"microbatches=8 .*'batch' 1 long.*2 ways"):
        lower(constrained_stack, cube, "layers:a;microbatches=8")(*stack_inputs)


def test_a_constraint_on_the_stage_axis_in_a_pipelined_body_is_refused(cube, stack_inputs):
    """A collective over the stages' axis inside a stage mixed the microbatches the
    stages ran at one tick (a silent wrong answer; with uneven stages, whose pads skip
    the body, a deadlock XLA aborted after 40 s)."""
    with pytest.raises(nm.PipelineError, match=r"'batch' on mesh axis 'c', which the pipeline"):
        lower(constrained_stack, cube, "layers:c;batch:a")(*stack_inputs)


def noisy_stack(h, w):
    """Two layers, each adding the same normal draw over the batch (made from no input:
    hoisted before the loop and captured)."""

    def body(c, wl):
        y = nm.rename(nm.tanh(nm.einsum(c, wl, out="batch e")), e="d")
        return y + 0.1 * nm.random.normal(nm.random.key(3), y.sizes), nm.sum(y, "d")

    return nm.scan(body, h, w, "layers")[0]


def test_a_draw_over_the_batch_in_a_pipelined_body_meets_its_own_examples(cube, stack_inputs):
    """The hoisted draw was whole on every device and cut into microbatches from the whole
    batch, while the carry was cut from the device's half (batch:a): a silent wrong
    answer (0.34 off); now the draw is split as the carry first."""
    want = noisy_stack(*stack_inputs).data
    got = lower(noisy_stack, cube, "layers:c;batch:a")(*stack_inputs)
    np.testing.assert_allclose(np.asarray(got.data), want, rtol=1e-5, atol=1e-6)
