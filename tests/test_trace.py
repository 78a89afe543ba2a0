import jax
import numpy as np
import pytest

import namedmesh as nm
from namedmesh import NamedMeshError

rng = np.random.default_rng(0)
X = nm.tensor(rng.normal(size=(4, 8)).astype(np.float32), "batch d_model")
W = nm.tensor(rng.normal(size=(8, 16)).astype(np.float32), "d_model d_ff")


def mlp(params, x):
    h = nm.relu(nm.einsum(x, params["w1"]))
    return nm.log_softmax(nm.einsum(h, params["w2"]) * 0.5, "d_model")


PARAMS = {"w1": W, "w2": nm.tensor(rng.normal(size=(16, 8)).astype(np.float32), "d_ff d_model")}


def numpy_mlp(params, x):
    h = np.maximum(x @ params["w1"].data, 0)
    z = h @ params["w2"].data * 0.5
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_graph_records_equations_in_order():
    g = nm.trace(mlp, PARAMS, X)
    names = [e.primitive.name for e in g.eqns]
    assert names == ["einsum", "relu", "einsum", "multiply", "log_softmax"]
    assert [v.dims for v in g.inputs] == [
        ("d_model", "d_ff"),
        ("d_ff", "d_model"),
        ("batch", "d_model"),
    ]
    assert g.outputs[0].dims == ("batch", "d_model") and g.outputs[0].shape == (4, 8)
    assert len(g.consts) == 1  # the scalar 0.5


def test_graph_prints_dims_sizes_and_params():
    text = str(nm.trace(mlp, PARAMS, X))
    assert text.startswith("graph(a: f32[d_model=8, d_ff=16]")
    assert "einsum(" in text and "out=(batch,d_ff)" in text and "log_softmax(" in text
    assert "return" in text and "const 0.5" in text


def test_reference_equals_eager_and_numpy():
    g = nm.trace(mlp, PARAMS, X)
    ref = nm.reference(g)(PARAMS, X)
    eager = mlp(PARAMS, X)
    np.testing.assert_allclose(ref.data, eager.data, rtol=1e-6)
    np.testing.assert_allclose(ref.data, numpy_mlp(PARAMS, X.data), rtol=1e-5, atol=1e-6)
    assert isinstance(ref.data, np.ndarray)


def test_reference_takes_arrays_in_place_of_tensors():
    g = nm.trace(mlp, PARAMS, X)
    raw = {k: v.data for k, v in PARAMS.items()}
    np.testing.assert_allclose(
        nm.reference(g)(raw, X.data).data, numpy_mlp(PARAMS, X.data), atol=1e-6, rtol=1e-5
    )


def test_interpret_runs_jax_and_is_differentiable():
    g = nm.trace(mlp, PARAMS, X)
    out = nm.interpret(g)(PARAMS, X)
    assert isinstance(out.data, jax.Array)
    np.testing.assert_allclose(out.data, numpy_mlp(PARAMS, X.data), rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda p: nm.interpret(g)(p, X).sum().data)(PARAMS)
    eager_grad = jax.grad(lambda p: mlp(p, X).sum().data)(PARAMS)
    np.testing.assert_allclose(grad["w1"].data, eager_grad["w1"].data, rtol=1e-5, atol=1e-6)


def test_trace_reads_no_values():
    def peek(x):
        return nm.tensor(np.asarray(x) + 1, x.dims)

    with pytest.raises(NamedMeshError, match="cannot read the values of a traced tensor"):
        nm.trace(peek, X)


def test_multiple_outputs_and_pytree_results():
    g = nm.trace(lambda x: {"top": nm.top_k(x, "d_model", 3), "m": x.max("d_model")}, X)
    assert [e.primitive.name for e in g.eqns] == ["top_k", "max"]
    out = nm.reference(g)(X)
    vals, idx = out["top"]
    np.testing.assert_allclose(vals.data[:, 0], X.data.max(1))
    np.testing.assert_allclose(out["m"].data, X.data.max(1))
    assert idx.dtype == np.int32


def test_random_and_creation_inside_a_trace_are_equations():
    g = nm.trace(lambda x: x + nm.random.normal(0, x.sizes) + nm.ones(x.sizes), X)
    assert [e.primitive.name for e in g.eqns] == ["random", "add", "full", "add"]
    want = X.data + nm.random.normal(0, X.sizes).data + 1
    np.testing.assert_allclose(nm.reference(g)(X).data, want, rtol=1e-6)


def test_rewrapping_a_traced_value_under_new_names_is_a_rename():
    g = nm.trace(lambda x: nm.tensor(x.data, "rows cols"), X)
    assert [e.primitive.name for e in g.eqns] == ["rename"]
    assert nm.reference(g)(X).dims == ("rows", "cols")


def test_tensor_leaking_from_a_trace_is_an_error():
    leaked = []
    nm.trace(lambda x: leaked.append(x) or x, X)
    with pytest.raises(NamedMeshError, match="finished nm.trace"):
        leaked[0] + 1


def test_wrong_inputs_to_reference():
    g = nm.trace(lambda x: x * 2, X)
    with pytest.raises(NamedMeshError, match="dims"):
        nm.reference(g)(nm.tensor(X.data, "a b"))
    with pytest.raises(NamedMeshError, match="shape"):
        nm.reference(g)(np.zeros((3, 3)))
    with pytest.raises(NamedMeshError, match="arguments"):
        nm.reference(g)(X, X)


def test_non_tensor_inputs_and_results_are_refused():
    with pytest.raises(NamedMeshError, match="trace inputs must be Tensors"):
        nm.trace(lambda x: x, np.zeros(3))
    with pytest.raises(NamedMeshError, match="results must be Tensors"):
        nm.trace(lambda x: 3.0, X)


def test_cost_rules_give_flops_and_bytes():
    g = nm.trace(lambda x, w: nm.einsum(x, w), X, W)
    (e,) = g.eqns
    cost = e.primitive.cost_rule([v.aval for v in e.inputs], [v.aval for v in e.outputs], e.params)
    assert cost.flops == 2 * 4 * 8 * 16
    assert cost.bytes == 4 * (4 * 8 + 8 * 16 + 4 * 16)


def test_tracing_is_per_thread():
    """Issue 38 class 5: while one thread is inside nm.trace, another thread's eager op
    returns numbers (not a Var recorded into the first thread's graph), and a second
    thread tracing at once records its own graph; a barrier holds both traces open
    together."""
    import threading

    barrier = threading.Barrier(3, timeout=30)
    results = {}

    def traced(which):
        def fn(x):
            y = nm.exp(x) if which == "a" else nm.relu(x)
            barrier.wait()  # both traces open, and the eager thread runs now
            barrier.wait()  # ... until it is done
            return y * 2.0

        results[which] = nm.trace(fn, X)

    def eager():
        barrier.wait()
        results["eager"] = nm.exp(X) + 1.0
        barrier.wait()

    threads = [threading.Thread(target=t, args=a) for t, a in
               ((traced, ("a",)), (traced, ("b",)), (eager, ()))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    np.testing.assert_allclose(results["eager"].data, np.exp(X.data) + 1.0, rtol=1e-6)
    oracles = {"a": ("exp", np.exp(X.data)), "b": ("relu", np.maximum(X.data, 0))}
    for which, (first, oracle) in oracles.items():
        g = results[which]
        assert [e.primitive.name for e in g.eqns] == [first, "multiply"], g
        np.testing.assert_allclose(nm.reference(g)(X).data, 2 * oracle, rtol=1e-6)
