"""nm.scan: a loop over a dim, eager and traced (against a NumPy loop) and lowered
(against the reference, and against the same program unrolled in Python)."""

import jax
import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, lower
from lowering.cost import expected_hlo
from lowering.hlo import collectives

R = np.random.default_rng(0)
L, B, D, E = 4, 4, 4, 8


def t(shape, dims):
    return nm.tensor(R.normal(size=shape).astype(np.float32), dims)


X = t((B, D), ("batch", "d"))
W1 = t((L, D, E), ("layers", "d", "e"))
W2 = t((L, E, D), ("layers", "e", "d"))
SCALE = t((D,), ("d",))


def layer(h, w1, w2, scale):
    y = nm.tanh(nm.einsum(h, w1, out=("batch", "e")))
    return h + nm.einsum(y, w2, out=("batch", "d")) * scale


def scanned(x, w1, w2, scale):
    def f(h, ws):
        h = layer(h, *ws, scale)  # `scale` is captured: the same in every iteration
        return h, nm.sum(h, "d")

    return nm.scan(f, x, (w1, w2), "layers")


def unrolled(x, w1, w2, scale):
    return unrolled_lists(x, _layers(w1), _layers(w2), scale)


def _layers(w):
    return [nm.slice(w, "layers", i, i + 1).sum("layers") for i in range(L)]


def unrolled_lists(x, w1s, w2s, scale):
    h, ys = x, []
    for w1, w2 in zip(w1s, w2s, strict=True):
        h = layer(h, w1, w2, scale)
        ys.append(nm.sum(h, "d"))
    return h, nm.stack(ys, "layers")


def numpy_loop(x, w1, w2, scale):
    h, ys = x, []
    for i in range(L):
        h = h + (np.tanh(h @ w1[i]) @ w2[i]) * scale
        ys.append(h.sum(-1))
    return h, np.stack(ys)


ARGS = (X, W1, W2, SCALE)
WANT = numpy_loop(*(a.data for a in ARGS))


def test_eager_scan_equals_a_numpy_loop():
    h, ys = scanned(*ARGS)
    assert h.dims == ("batch", "d") and ys.dims == ("layers", "batch")
    np.testing.assert_allclose(h.data, WANT[0], rtol=1e-5)
    np.testing.assert_allclose(ys.data, WANT[1], rtol=1e-5)


def test_traced_scan_runs_by_reference_and_by_jax():
    g = nm.trace(scanned, *ARGS)
    assert [e.primitive.name for e in g.eqns] == ["scan"]  # the body is one equation
    for run in (nm.reference(g), nm.interpret(g)):
        h, ys = run(*ARGS)
        np.testing.assert_allclose(np.asarray(h.data), WANT[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(ys.data), WANT[1], rtol=1e-5, atol=1e-5)


def test_scan_takes_pytrees_and_a_scanned_dim_anywhere():
    def f(c, x):
        a, b = c["a"], c["b"]
        return {"a": a + x["u"], "b": b * 2.0}, (a, x["v"] + b)

    u = t((3, 2), ("p", "k"))  # "k" scanned, last
    v = t((2, 3), ("k", "p"))
    c, (ys_a, ys_v) = nm.scan(
        f, {"a": nm.zeros({"p": 3}), "b": nm.ones({"p": 3})}, {"u": u, "v": v}, "k"
    )
    np.testing.assert_allclose(c["a"].data, u.data.sum(1), rtol=1e-6)
    np.testing.assert_allclose(c["b"].data, np.full(3, 4.0))
    assert ys_a.dims == ("k", "p") and ys_v.dims == ("k", "p")
    np.testing.assert_allclose(ys_a.data, np.stack([np.zeros(3), u.data[:, 0]]), rtol=1e-6)
    np.testing.assert_allclose(ys_v.data, v.data + np.array([[1.0], [2.0]]), rtol=1e-6)


def test_scan_without_xs_needs_a_length():
    c, ys = nm.scan(lambda c, _: (c * 2.0, c), nm.ones({"a": 2}), (), "step", length=3)
    np.testing.assert_allclose(c.data, [8.0, 8.0])
    assert ys.dims == ("step", "a") and ys.data[:, 0].tolist() == [1.0, 2.0, 4.0]
    with pytest.raises(nm.ShapeError, match="pass length="):
        nm.scan(lambda c, _: (c, c), nm.ones({"a": 2}), (), "step")


def test_scan_errors_name_the_dim_and_tensors():
    with pytest.raises(nm.ShapeError, match=r"'layers'.*\('batch', 'd'\)"):
        nm.scan(lambda c, x: (c, x), X, X, "layers")
    with pytest.raises(nm.ShapeError, match=r"sizes disagree.*\[3, 4\]"):
        nm.scan(lambda c, x: (c, x), X, (W1, t((3, 2), ("layers", "q"))), "layers")
    with pytest.raises(nm.ShapeError, match=r"f returned the carry \(f32\[batch=4, e=8\]\)"):
        nm.scan(lambda c, w: (nm.einsum(c, w, out=("batch", "e")), None), X, W1, "layers")


def test_gradients_through_eager_scan_equal_the_unrolled_gradients():
    def loss(fn):
        return lambda w1: (fn(X, nm.tensor(w1, W1.dims), W2, SCALE)[0].data ** 2).sum()

    w1 = jax.numpy.asarray(W1.data)
    np.testing.assert_allclose(
        jax.grad(loss(scanned))(w1), jax.grad(loss(unrolled))(w1), rtol=1e-4, atol=1e-5
    )


MESH = Mesh({"rows": 2, "cols": 2})
LAYOUTS = [
    "",
    "batch:rows;e:cols",
    "batch:rows,cols",
    "d:rows",
    "e:rows,cols",
    "layers:rows;batch:cols",
    "d:cols;e:rows",
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lowered_scan_equals_the_numpy_loop_and_its_gradients(layout):
    lowered = lower(scanned, MESH, layout)
    h, ys = lowered(*ARGS)
    np.testing.assert_allclose(np.asarray(h.data), WANT[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ys.data), WANT[1], rtol=1e-4, atol=1e-5)

    def loss(fn):
        def f(w1, x):
            h, ys = fn(nm.tensor(x, X.dims), nm.tensor(w1, W1.dims), W2, SCALE)
            return (h.data**2).sum() + ys.data.sum()

        return f

    args = (jax.numpy.asarray(W1.data), jax.numpy.asarray(X.data))
    got = jax.grad(loss(lowered), argnums=(0, 1))(*args)
    want = jax.grad(loss(scanned), argnums=(0, 1))(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["batch:rows;e:cols", "d:rows", "e:rows,cols"])
def test_scan_report_equals_the_report_of_the_unrolled_loop(layout):
    """The plan holds the body once; the report counts it `length` times."""
    # x differentiated too: a scan transposes every iteration alike, so the first
    # iteration's carry has a gradient as the unrolled first layer's h then has
    a = lower(scanned, MESH, layout).report(*ARGS, wrt=(0, 1, 2), show=False)
    per_layer = (X, _layers(W1), _layers(W2), SCALE)
    b = lower(unrolled_lists, MESH, layout).report(*per_layer, wrt=(0, 1, 2), show=False)
    assert a.collectives == b.collectives
    assert a.flops == b.flops
    # the backward pass too: the carry's casts and the body's transposes, length times
    assert a.backward == b.backward
    assert a.backward_flops == b.backward_flops


@pytest.mark.parametrize("layout", ["batch:rows;e:cols", "e:rows,cols", "d:cols;e:rows"])
def test_lowered_scan_hlo_holds_the_body_once(layout):
    lowered = lower(scanned, MESH, layout)
    hlo = lowered.compile(*ARGS).as_text()
    assert sorted(collectives(hlo)) == sorted(expected_hlo(lowered.plan(*ARGS), MESH.sizes))
    assert "while" in hlo
    text = str(lowered.plan(*ARGS))
    assert text.count("einsum:") == 2 and "(x4)" in text


def test_program_size_does_not_grow_with_the_scanned_length():
    def hlo_ops(n):
        w1 = nm.tensor(np.zeros((n, D, E), np.float32), W1.dims)
        w2 = nm.tensor(np.zeros((n, E, D), np.float32), W2.dims)
        hlo = lower(scanned, MESH, "batch:rows;e:cols").compile(X, w1, w2, SCALE).as_text()
        return hlo.count(" dot(")

    assert hlo_ops(2) == hlo_ops(16) > 0


def test_a_carry_that_becomes_varying_in_the_body_is_retyped():
    """The body gathers what the carry starts without: the loop must type it varying."""

    def prog(x, w):
        def f(c, w):
            y = nm.constrain(nm.tanh(nm.einsum(c, w, out=("batch", "e"))), "batch:rows")
            return nm.rename(y, {"e": "d"}) * 2.0, None

        return nm.scan(f, x, w, "layers")[0]

    w = t((L, D, D), ("layers", "d", "e"))
    want = nm.reference(nm.trace(prog, X, w))(X, w)
    for layout in ["", "e:cols", "d:rows"]:
        got = lower(prog, MESH, layout)(X, w)
        np.testing.assert_allclose(np.asarray(got.data), want.data, rtol=1e-4, atol=1e-5)
