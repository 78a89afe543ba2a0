"""Issue 26, classes 1 and 4, against one device (jax, unlowered): a pipeline's bubble
ticks (a stage with no microbatch, computing on zeros) must not make the gradients of a
body singular at zero NaN; a pipelined model with blockwise or ring attention takes
microbatches > 1 (the online softmax's initial statistics, made from no input, are loop
constants cut into microbatches as captured inputs are)."""

import jax
import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, lower
from models.layers.blockwise import Options, blockwise_attend, ring_attend
from models.layers.common import attend

R = np.random.default_rng(0)
H = nm.tensor(R.normal(size=(4, 3)).astype(np.float32), "batch d")
W = nm.tensor(R.normal(size=(4, 3, 3)).astype(np.float32), "layers d e")
SCALE = nm.tensor(np.abs(R.normal(size=(4,))).astype(np.float32) + 1, "batch")


def unit(c, w):  # singular at zero: d(y/|y|)/dy is infinite at y = 0
    y = nm.rename(nm.einsum(c, w, out="batch e"), e="d")
    return y / nm.sqrt(nm.sum(y * y, "d")), None


def logs(c, w):  # log|y| at zero is -inf, its derivative infinite; a captured input too
    y = nm.rename(nm.einsum(c, w, out="batch e"), e="d") * SCALE
    return nm.tanh(nm.log(nm.abs(y))), None


def stack_loss(body):
    return lambda h, w: nm.sum(nm.scan(body, h, w, "layers")[0] ** 3)


def gradients(fn):
    return jax.jit(jax.grad(lambda a, b: fn(nm.tensor(a, "batch d"),
                                            nm.tensor(b, "layers d e")).data, (0, 1)))  # fmt: skip


@pytest.mark.parametrize(
    "layout", ["layers:stage;microbatches=2", "layers:stage;schedule=circular;microbatches=2"]
)
@pytest.mark.parametrize("body", [unit, logs])
def test_bubble_ticks_leave_the_gradients_of_a_singular_body_one_devices(body, layout):
    want = gradients(stack_loss(body))(H.data, W.data)
    lowered = lower(stack_loss(body), Mesh({"stage": 2}), layout, check=True)
    got = gradients(lowered)(H.data, W.data)
    for g, w in zip(got, want, strict=True):
        assert np.isfinite(np.asarray(w)).all()
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


X = nm.tensor(R.normal(size=(4, 8, 4)).astype(np.float32), "batch length d_kv")
WA = nm.tensor(R.normal(size=(2, 4, 4)).astype(np.float32) / 2, "layers d_kv e")
CAUSAL = lambda queries, slots: nm.where(queries >= slots, 0.0, np.float32(-1e9))
KERNELS = {  # each attention kernel, with a causal bias by position
    "full": lambda q, k, v: attend(
        q, k, v, bias=CAUSAL(nm.arange("length", 8), nm.arange("memory", 8))
    ),  # fmt: skip
    "blockwise": lambda q, k, v: blockwise_attend(q, k, v, Options(bias_fn=CAUSAL, block=2)),
    "ring": lambda q, k, v: ring_attend(q, k, v, Options(bias_fn=CAUSAL), ring=2),
}


def attention_loss(kernel):
    def layer(h, w):
        kv = nm.rename(nm.einsum(h, w, out="batch length e"), e="d_kv", length="memory")
        return h + KERNELS[kernel](h, kv, kv), None

    return lambda x, w: nm.sum(nm.scan(layer, x, w, "layers")[0] ** 2)


@pytest.mark.parametrize(
    "kernel, layout",
    [
        ("full", "layers:stage;microbatches=4"),
        ("blockwise", "layers:stage;microbatches=4"),
        ("ring", "layers:stage;ring:ring;microbatches=2"),
    ],
)
def test_pipelined_attention_kernels_take_microbatches(kernel, layout):
    """The online softmax's initial statistics (nm.full over batch, made from no input)
    were flagged as not per-example: microbatches > 1 was a PipelineError."""
    loss = attention_loss(kernel)
    grads = lambda f: jax.jit(jax.value_and_grad(
        lambda a, b: f(nm.tensor(a, X.dims), nm.tensor(b, WA.dims)).data, (0, 1)))  # fmt: skip
    want, want_g = grads(loss)(X.data, WA.data)
    lowered = lower(loss, Mesh({"stage": 2, "ring": 2}), layout)
    got, got_g = grads(lowered)(X.data, WA.data)
    (plan,) = lowered.report(X, WA, show=False).pipelines
    assert plan.microbatches == int(layout[-1])
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for g, w in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
