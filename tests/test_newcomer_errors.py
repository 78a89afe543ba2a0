"""The mistakes of a first hour with namedmesh, each as a user met it (issue 16): a typo
in a layout, NumPy habits (positions for names, np.exp on a Tensor, jax.numpy on a
traced value), a typo'd broadcast dim. Each must be a typed error (or warning) that
names the op, the dims and the closest name, never a silent wrong answer."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import namedmesh as nm
from lowering import Layout, Mesh, lower

R = np.random.default_rng(0)
X = nm.tensor(R.normal(size=(4, 3)).astype(np.float32), "batch d")
W = nm.tensor(R.normal(size=(3, 5)).astype(np.float32), "d classes")


def mlp(x, w):
    return nm.relu(nm.einsum(x, w, out="batch classes"))


# --- 1. layouts naming dims the program lacks ------------------------------------------
def test_a_layout_rule_with_a_typo_is_a_layout_error_with_did_you_mean():
    with pytest.raises(nm.LayoutError) as err:
        lower(mlp, Mesh({"rows": 2}), "bacth:rows").plan(X, W)
    msg = str(err.value)
    assert "'bacth'" in msg and "did you mean 'batch'?" in msg
    assert "['batch', 'classes', 'd']" in msg  # the program's dims


def test_a_shared_layout_may_name_dims_a_program_lacks():
    layout = Layout("batch:rows;heads:rows", shared=True)
    out = lower(mlp, Mesh({"rows": 2}), layout)(X, W)
    np.testing.assert_allclose(np.asarray(out), np.maximum(X.data @ W.data, 0), rtol=1e-5)
    with pytest.raises(nm.LayoutError, match="'heads'"):
        lower(mlp, Mesh({"rows": 2}), Layout("batch:rows;heads:rows")).plan(X, W)


def test_an_empty_layout_prints_as_replicated():
    assert str(Layout()) == "(replicated)" and str(Layout("")) == "(replicated)"
    assert repr(Layout()) == "Layout('')"
    assert str(Layout("batch:rows")) == "batch:rows"


def test_a_parameter_is_named_by_its_path_in_a_layout_error():
    params = {"layers": {"attn": {"q": nm.ones({"d": 3, "heads": 3})}}}
    f = lambda p, x: nm.einsum(p["layers"]["attn"]["q"], x, out="batch heads")
    with pytest.raises(nm.LayoutError, match="input 0:layers/attn/q"):
        lower(f, Mesh({"rows": 2}), "heads:rows").plan(params, X)


def test_a_numpy_array_given_to_a_lowered_function_is_a_typed_error():
    match = r"ndarray as argument \[1\] \(shape \(3, 5\)\).*nm.tensor"
    with pytest.raises(nm.ArgumentError, match=match):
        lower(mlp, Mesh({"rows": 2}), "batch:rows")(X, W.data)


# --- 2. positions where names are expected; near-miss names -----------------------------
@pytest.mark.parametrize(
    "call, op, name",
    [
        (lambda: X.sum(1), "sum", "'d'"),
        (lambda: nm.softmax(X, -1), "softmax", "'d'"),
        (lambda: nm.argmax(X, 0), "argmax", "'batch'"),
        (lambda: X.transpose(1, 0), "transpose", "'d'"),
        (lambda: np.sum(X, axis=0), "np.sum", "'batch'"),
    ],
)
def test_a_position_for_a_name_names_the_op_and_the_dim_there(call, op, name):
    with pytest.raises(nm.ShapeError) as err:
        call()
    msg = str(err.value)
    assert msg.startswith(op) and "by name, not by position" in msg and name in msg


def test_nm_tensor_with_a_number_for_dims_is_a_shape_error():
    with pytest.raises(nm.ShapeError, match=r"nm.tensor\(data, dims\).*got 2"):
        nm.tensor(np.zeros(3), 2)


@pytest.mark.parametrize(
    "call, wrong, right",
    [
        (lambda: X.sum("batchs"), "batchs", "batch"),
        (lambda: nm.softmax(X, "dd"), "dd", "d"),
        (lambda: X.rename(bacth="b"), "bacth", "batch"),
        (lambda: nm.pad(X, {"bach": 1}), "bach", "batch"),
        (lambda: nm.einsum(X, W, out="batch clases"), "clases", "classes"),
        (lambda: nm.dot(X, W, over="dd"), "dd", "d"),
        (lambda: X.size_of("batc"), "batc", "batch"),
    ],
)
def test_an_unknown_dim_gets_the_closest_name(call, wrong, right):
    with pytest.raises(nm.ShapeError) as err:
        call()
    assert repr(wrong) in str(err.value) and f"did you mean {right!r}?" in str(err.value)


def test_a_size_mismatch_names_both_operands_in_every_op():
    y = nm.tensor(np.zeros((4, 2)), "batch d")
    for call, op in [(lambda: X + y, "add"), (lambda: nm.einsum(X, y), "einsum")]:
        with pytest.raises(nm.ShapeError, match=rf"{op}: dim 'd' has size 3 .* but 2"):
            call()


def test_a_typo_in_a_broadcast_dim_warns_with_did_you_mean():
    """xarray broadcasts by name, so `labels` with a typo'd dim becomes an outer product.
    namedmesh keeps the semantics (an outer broadcast is legitimate) and warns where a
    new dim is a near-miss of a dim of the other operand."""
    logits = nm.tensor(np.zeros((4, 5), np.float32), "batch classes")
    labels = nm.tensor(np.zeros(5, np.float32), "class")
    with pytest.warns(nm.DimNameWarning, match="'class'.*did you mean 'classes'"):
        out = logits * labels
    assert out.dims == ("batch", "classes", "class")  # as xarray: an outer product
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        X * nm.tensor(np.zeros(5, np.float32), "classes")  # a real outer product: silent


# --- 3. NumPy functions keep their dims -------------------------------------------------
def test_numpy_ufuncs_and_functions_keep_dims_as_xarray_does():
    xr = pytest.importorskip("xarray")
    xa = X.to_xarray()
    cases = [
        (np.exp(X), np.exp(xa)),
        (np.maximum(X, 0), np.maximum(xa, 0)),
        (np.sum(X), xa.sum()),
        (np.sum(X, axis="d"), xa.sum("d")),
        (np.mean(X, "batch"), xa.mean("batch")),
        (np.where(X > 0, X, 0), xr.where(xa > 0, xa, 0)),
        (np.abs(X) + np.float32(1), abs(xa) + 1),
    ]
    for got, want in cases:
        assert isinstance(got, nm.Tensor) and got.dims == want.dims
        np.testing.assert_allclose(np.asarray(got), want.values, rtol=1e-6)
    assert np.asarray(X).shape == (4, 3) and np.allclose(X, X.data)


def test_numpy_ufuncs_trace_and_lower():
    f = lambda x: np.exp(np.maximum(x, 0)).sum("d")
    graph = nm.trace(f, X)
    assert [e.primitive.name for e in graph.eqns][:2] == ["maximum", "exp"]
    out = lower(f, Mesh({"rows": 2}), "batch:rows")(X)
    np.testing.assert_allclose(np.asarray(out), np.exp(np.maximum(X.data, 0)).sum(1), rtol=1e-5)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: np.add.reduce(X), r"np.add.reduce.*t.sum\('d'\)"),
        (lambda: np.concatenate([X, X]), r"np.concatenate.*nm.concat"),
        (lambda: np.linalg.norm(X), r"np.linalg.*norm.*nm.sqrt"),
        (lambda: np.exp(X, out=np.zeros((4, 3))), r"np.exp.*nm.exp takes no \['out'\]"),
        (lambda: np.matmul(X, W), r"nm.einsum"),
        (lambda: np.ones((4, 3)) + X, r"add: .*ndarray of shape \(4, 3\).*nm.tensor"),
    ],
)
def test_numpy_without_a_named_equivalent_is_a_typed_error(call, match):
    with pytest.raises(nm.ArgumentError, match=match):
        call()


# --- 4. jax.numpy on a traced value; gradients of a 0-d loss ---------------------------
def test_jax_numpy_on_traced_data_points_to_primitives():
    def f(x):
        return nm.Tensor(jnp.exp(x.data), x.dims)

    with pytest.raises(nm.TracedValueError, match=r"nm.exp\(t\).*primitive.*nm.bind"):
        lower(f, Mesh({"rows": 2}), "batch:rows").plan(X)


def test_nm_grad_of_a_loss_returning_a_0d_tensor():
    loss = lambda w, x: nm.square(nm.einsum(x, w)).sum()
    g = nm.grad(loss)(W, X)
    assert isinstance(g, nm.Tensor) and g.dims == W.dims
    want = 2 * X.data.T @ (X.data @ W.data)
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-4)
    value, g2 = nm.value_and_grad(loss)(W, X)
    assert value.dims == () and np.isclose(float(value), ((X.data @ W.data) ** 2).sum())
    np.testing.assert_allclose(np.asarray(g2), want, rtol=1e-4)
    lowered = lower(loss, Mesh({"rows": 2}), "batch:rows")
    np.testing.assert_allclose(np.asarray(nm.grad(lowered)(W, X)), want, rtol=1e-4)


def test_nm_grad_of_a_loss_with_dims_left_names_them():
    with pytest.raises(nm.ShapeError, match=r"dims \('batch',\).*loss.mean\('batch'\)"):
        nm.grad(lambda w: nm.einsum(X, w).sum("classes"))(W)
    with pytest.raises(TypeError):  # jax.grad itself, for comparison, says nothing of dims
        jax.grad(lambda w: nm.einsum(X, w).sum("classes"))(W)


# --- further first-hour mistakes ---------------------------------------------------------
def test_a_layout_string_with_spaces_and_a_trailing_semicolon_is_read_as_meant():
    assert Layout(" batch : rows ; d_ff:cols ; ") == Layout("batch:rows;d_ff:cols")
    with pytest.raises(nm.LayoutError, match="malformed rule 'batch rows'"):
        Layout("batch rows")


def test_a_mesh_axis_of_size_0_is_a_mesh_error():
    with pytest.raises(nm.MeshError, match="rows"):
        Mesh({"rows": 0})


def test_an_unknown_mesh_axis_in_a_layout_names_the_mesh():
    with pytest.raises(
        nm.LayoutError, match=r"axis 'row', which Mesh\(rows=2\) lacks; did you mean 'rows'"
    ):
        lower(mlp, Mesh({"rows": 2}), "batch:row").plan(X, W)


def test_a_constraint_with_a_typo_gets_the_closest_name():
    f = lambda x: nm.constrain(x, "bacth:rows") * 2
    with pytest.raises(nm.LayoutError, match="did you mean 'batch'"):
        lower(f, Mesh({"rows": 2}), "batch:rows").plan(X)


def test_a_report_flags_compute_repeated_over_a_mesh_axis():
    """Megatron's MLP splits every einsum over both axes; splitting only d_ff leaves
    every einsum repeated by the rows' devices, which the verdict names with its factor."""
    w2 = nm.tensor(R.normal(size=(5, 3)).astype(np.float32), "classes d")
    f = lambda x, w, w2: nm.einsum(nm.relu(nm.einsum(x, w)), w2, out="batch d")
    mesh = Mesh({"rows": 2, "cols": 5}, devices="abstract")  # planned, not run
    x8 = nm.tensor(R.normal(size=(8, 3)).astype(np.float32), "batch d")
    megatron = lower(f, mesh, "batch:rows;classes:cols").report(x8, W, w2, show=False)
    d_ff_only = lower(f, mesh, "classes:cols").report(x8, W, w2, show=False)
    assert str(megatron).endswith("verdict: no compute is repeated across the mesh")
    assert d_ff_only.flops == 2 * megatron.flops  # the repeat, measured independently
    (line,) = [v for v in d_ff_only.verdicts() if "repeated x2 over mesh axis rows" in v]
    assert "einsum x2" in line and f"{megatron.flops:,.0f} of the {d_ff_only.flops:,.0f}" in line
