"""nm.scan's rematerialisation policy: the same values and gradients as without it
(against a plain jax.numpy loop), a smaller compiled backward pass, and the LM's
gradients unchanged by `remat` under a layout."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, lower
from namedmesh import control
from namedmesh.control import checkpointed

R = np.random.default_rng(5)
L, B, D, E = 6, 8, 16, 64


def t(shape, dims):
    return nm.tensor((R.normal(size=shape) * 0.1).astype(np.float32), dims)


X, W1, W2 = t((B, D), "batch d"), t((L, D, E), "layers d e"), t((L, E, D), "layers e d")


def program(remat, unroll=False):
    def f(x, w1, w2):
        def body(h, ws):
            y = nm.tanh(nm.einsum(h, ws[0], out="batch e"))
            return h + nm.einsum(y, ws[1], out="batch d"), None

        h, _ = nm.scan(body, x, (w1, w2), "layers", remat=remat, unroll=unroll)
        return (h * h).sum()

    return f


def jnp_loss(x, w1, w2):
    """The same loop in plain jax.numpy: the oracle of values and gradients."""
    h = x
    for i in range(L):
        h = h + jnp.tanh(h @ w1[i]) @ w2[i]
    return (h * h).sum()


ARGS = (X, W1, W2)
WANT_VALUE, WANT_GRADS = jax.value_and_grad(jnp_loss, argnums=(0, 1, 2))(
    *(jnp.asarray(a.data) for a in ARGS)
)


def _grads(fn):
    """value and gradients of fn's 0-d result wrt its three Tensor arguments."""
    g = jax.value_and_grad(lambda *a: fn(*a).data, argnums=(0, 1, 2))
    value, grads = jax.jit(g)(*ARGS)
    return value, [x.data for x in grads]


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
@pytest.mark.parametrize("layout", [None, "batch:rows;e:cols"])
def test_remat_keeps_values_and_gradients(remat, layout):
    fn = program(remat) if layout is None else lower(program(remat), MESH, layout)
    value, grads = _grads(fn)
    np.testing.assert_allclose(value, WANT_VALUE, rtol=1e-5)
    for g, w in zip(grads, WANT_GRADS, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


MESH = Mesh({"rows": 2, "cols": 2})


@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.parametrize("layout", [None, "batch:rows;e:cols"])
def test_unrolled_scan_keeps_values_and_gradients_without_a_loop(remat, layout):
    """unroll=True, and "auto" on this small stack without remat: the same values and
    gradients as the jax.numpy loop, and the compiled program (jit or the lowering's)
    has no while loop left."""
    f = program(remat, unroll="auto" if remat == "none" else True)
    fn = f if layout is None else lower(f, MESH, layout)
    value, grads = _grads(fn)
    np.testing.assert_allclose(value, WANT_VALUE, rtol=1e-5)
    for g, w in zip(grads, WANT_GRADS, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    g = jax.jit(jax.grad(lambda *a: fn(*a).data, argnums=(1, 2)))
    assert " while(" not in g.lower(*ARGS).compile().as_text()
    assert _looped_has_a_while(remat)  # the check can fail


@functools.cache
def _looped_has_a_while(remat) -> bool:
    """Whether the looped program's compiled gradient has a while loop (one compile per
    remat, shared by the layouts: the looped program is not lowered)."""
    looped = jax.jit(jax.grad(lambda *a: program(remat)(*a).data, argnums=(1, 2)))
    return " while(" in looped.lower(*ARGS).compile().as_text()


def test_unroll_must_be_a_bool_or_auto():
    with pytest.raises(
        nm.ArgumentError, match="scan over 'layers': unroll must be True, False or 'auto', got 2"
    ):
        program("none", unroll=2)(*ARGS)


def _while(f, *args) -> bool:
    return " while(" in jax.jit(f).lower(*args).compile().as_text()


def test_auto_keeps_the_loop_past_the_budget_or_under_remat():
    """unroll="auto": a 6-layer stack without remat unrolls (the test above); under
    remat, or past UNROLL_BUDGET equations (a one-equation body over more layers than
    that), it stays one loop."""
    assert _while(jax.grad(lambda *a: program("full", unroll="auto")(*a).data), *ARGS)
    n = control.UNROLL_BUDGET + 1
    deep = nm.tensor(np.full((n, 2), 1.0, np.float32), "layers d")
    scanned = lambda w: nm.scan(lambda h, w: (h * w, None), w.sum("layers"), w, "layers",
                                unroll="auto")[0]  # fmt: skip
    assert _while(lambda w: scanned(w).data, deep)
    # the carry starts as n ones summed and is multiplied by 1 n times
    np.testing.assert_array_equal(scanned(deep).data, np.full(2, float(n)))


def test_full_remat_compiles_a_smaller_backward_pass():
    """Without remat the backward pass reads each layer's (batch, e) activations, saved
    by the forward pass; with full remat only the carry is saved per layer."""

    def temp(remat):
        f = jax.jit(jax.grad(lambda *a: program(remat)(*a).data, argnums=(1, 2)))
        return f.lower(*ARGS).compile().memory_analysis().temp_size_in_bytes

    none, full = temp("none"), temp("full")
    saved = L * B * E * 4  # one float32 (batch, e) per layer at least
    assert full <= none - saved


def test_unknown_remat_policy_is_a_parameter_error():
    with pytest.raises(nm.ParameterError, match="'sometimes'"):
        program("sometimes")(*ARGS)


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_training_peak_estimate_follows_the_policy(remat):
    """By hand, from what each primitive's backward pass reads: the inputs and their
    gradients; per layer the body keeps h (the first einsum's other operand), y =
    tanh(a) (its output, and the second einsum's operand) and tanh's one saved
    intermediate, (batch, e), and without remat each layer's two weight slices (the
    einsums' other operands: jax saves them as residuals, stacked anew, in a loop
    without remat; XLA's buffers hold each weight stack twice); without remat every
    layer's, with full remat the carry h per layer, with dots the carry and the matmul
    output a per layer (y is recomputed from it; b, added to the carry, nothing reads
    backward: jax.ad_checkpoint.print_saved_residuals of the body under dots_saveable
    lists h, the weights and a only). Outside the scan, h * h keeps h, but the backward
    pass reads it, and frees it, before it reaches the scan, where it peaks. The working
    set there: the loop's own cotangents (the carry's, in and out; the stacked weights'
    are the gradients, counted once) beside one iteration's, at least one weight
    slice's cotangent and at most every value of a layer and its cotangent."""
    rep = lower(program(remat), Mesh({"one": 1}), "").report(*ARGS, wrt=(0, 1, 2), show=False)
    f = 4  # float32
    inputs = (B * D + 2 * L * D * E) * f
    step = (B * D + 2 * B * E + 2 * D * E) * f
    carry, dots = B * D * f, B * E * f
    body = {"none": L * step, "full": L * carry, "dots": L * (carry + dots)}
    parts = rep.memory_parts
    assert (parts["inputs"], parts["gradients"], parts["saved"]) == (inputs, inputs, body[remat])
    own = 2 * B * D * f
    layer = 2 * (B * D + 2 * B * E + 2 * D * E) * f
    assert own + D * E * f <= parts["working"] <= own + layer
    assert rep.peak_memory == sum(parts.values())


def test_the_checkpointed_body_has_no_cse_barriers():
    """Inside lax.scan the recomputation needs no optimization barriers (they only
    slow the backward pass down): the remat equation says prevent_cse=False."""
    f = checkpointed(lambda c, x: (c * x, None), "full")
    jaxpr = jax.make_jaxpr(lambda c, xs: jax.lax.scan(f, c, xs))(1.0, jnp.ones(3))
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    (remat,) = [e for e in scan.params["jaxpr"].eqns if "prevent_cse" in e.params]
    assert remat.params["prevent_cse"] is False
