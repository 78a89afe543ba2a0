"""lowering.lower: SPMD programs on 8 simulated CPU devices against the NumPy reference.

Every lowered result is checked for values (against `nm.reference` of the traced program,
or plain NumPy), dims, dtype, and the sharding of its data (the layout's partition_spec).
"""

import functools
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import namedmesh as nm
from lowering.hlo import collectives
from lowering.layout import Layout, partition_spec
from lowering.lower import lower
from lowering.mesh import Mesh

RTOL = ATOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6

MESHES = {
    "1": {"x": 1},
    "2": {"x": 2},
    "4": {"x": 4},
    "2x2": {"rows": 2, "cols": 2},
    "2x4": {"rows": 2, "cols": 4},
    "4x2": {"rows": 4, "cols": 2},
    "8": {"x": 8},
    "2x2x2": {"a": 2, "b": 2, "c": 2},
}


@functools.cache
def mesh_of(name: str) -> Mesh:
    return Mesh(MESHES[name])


def _is_tensor(x) -> bool:
    return isinstance(x, nm.Tensor)


def leaves(tree) -> list:
    return jax.tree_util.tree_leaves(tree, is_leaf=_is_tensor)


def _trim(spec) -> P:
    """A PartitionSpec without trailing Nones (jax drops them from output shardings)."""
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)


def assert_sharded_as_layout(t: nm.Tensor, mesh: Mesh, rules) -> None:
    """`t.data` is a jax.Array on `mesh` laid out by `rules` for a tensor of its dims."""
    lay = rules if isinstance(rules, Layout) else Layout(rules)
    spec = partition_spec(lay.of(t.dims, t.shape, mesh))
    sharding = t.data.sharding
    assert isinstance(t.data, jax.Array)
    assert isinstance(sharding, NamedSharding)
    assert sharding.mesh.axis_names == mesh.jax_mesh.axis_names
    if all(n > 1 for n in mesh.sizes.values()):  # jax drops size-1 axes from specs
        assert _trim(sharding.spec) == _trim(spec), (t.dims, sharding.spec, spec)
    assert sharding.is_equivalent_to(NamedSharding(mesh.jax_mesh, spec), t.ndim)


def check(fn, mesh: Mesh, rules, *xs, rtol=RTOL, atol=ATOL, expected=None):
    """Lower `fn` and compare every result with the NumPy reference of its graph."""
    if expected is None:
        expected = nm.reference(nm.trace(fn, *xs))(*xs)
    got = lower(fn, mesh, rules)(*xs)
    assert jax.tree_util.tree_structure(got, is_leaf=_is_tensor) == (
        jax.tree_util.tree_structure(expected, is_leaf=_is_tensor)
    )
    for g, r in zip(leaves(got), leaves(expected), strict=True):
        assert isinstance(g, nm.Tensor)
        assert g.dims == r.dims
        assert g.shape == r.shape
        assert g.dtype == r.dtype
        np.testing.assert_allclose(np.asarray(g.data), np.asarray(r.data), rtol=rtol, atol=atol)
        assert_sharded_as_layout(g, mesh, rules)
    return got


def collectives_in_hlo(text: str) -> list[str]:
    ops = r"all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute"
    return [m.group(1) for m in re.finditer(rf"\b({ops})(?:-start)?\(", text)]


rng = np.random.default_rng(0)


def normal(dims: str, *shape, scale=1.0) -> nm.Tensor:
    return nm.tensor((scale * rng.normal(size=shape)).astype(np.float32), dims)


# --- the 2-layer MLP -------------------------------------------------------------------

B, D_MODEL, D_FF = 8, 16, 32
X = normal("batch d_model", B, D_MODEL)
PARAMS = {
    "w1": normal("d_model d_ff", D_MODEL, D_FF, scale=D_MODEL**-0.5),
    "w2": normal("d_ff d_model", D_FF, D_MODEL, scale=D_FF**-0.5),
}
TARGET = normal("batch d_model", B, D_MODEL)


def mlp(params, x):
    return nm.einsum(nm.relu(nm.einsum(x, params["w1"])), params["w2"])


def mlp_loss(params, x):
    return nm.mean((mlp(params, x) - TARGET) ** 2)


def numpy_mlp(params, x):
    h = np.maximum(x.data @ params["w1"].data, 0)
    return h @ params["w2"].data


MLP_LAYOUTS = [
    # 2x4 and 4x2: data parallel, Megatron, 2D, multi-axis, FSDP-like, replicated
    *[
        (m, r)
        for m in ("2x4", "4x2")
        for r in (
            "batch:rows,cols",
            "batch:rows;d_ff:cols",
            "batch:rows;d_model:cols",
            "d_ff:rows,cols",
            "batch:rows;d_model:rows",
            "",
        )
    ],
    ("2x4", "d_ff:cols;d_model:cols"),  # reduce-scatter in the second einsum
    ("2x4", "d_ff:cols,rows;batch:rows"),  # in h, d_ff takes rows before batch can
    ("1", "batch:x;d_ff:x"),
    ("2", "batch:x"),
    ("2", "d_ff:x"),
    ("4", "d_model:x"),
    ("4", "batch:x;d_model:x"),
    ("2x2", "batch:rows;d_ff:cols"),
    ("2x2", "batch:rows;d_model:cols"),
    ("8", "batch:x"),
    ("8", "d_ff:x"),
    ("8", "d_model:x"),
    ("8", "batch:x;d_model:x"),
    ("8", ""),
    ("2x2x2", "batch:a,b,c"),
    ("2x2x2", "batch:a;d_ff:b,c"),
    ("2x2x2", "batch:a;d_model:b;d_ff:c"),
    ("2x2x2", "d_ff:a,b,c"),
    ("2x2x2", "batch:a,b;d_model:a,b"),
    ("2x2x2", "batch:c,a;d_model:b"),
    ("2x2x2", ""),
]
MLP_IDS = [f"{m}-{r or 'replicated'}" for m, r in MLP_LAYOUTS]


@pytest.mark.parametrize(("mesh_name", "rules"), MLP_LAYOUTS, ids=MLP_IDS)
def test_mlp_forward(mesh_name, rules):
    mesh = mesh_of(mesh_name)
    y = check(mlp, mesh, rules, PARAMS, X)
    # result dims never change with the layout
    assert y.dims == ("batch", "d_model") and y.shape == (B, D_MODEL)
    np.testing.assert_allclose(np.asarray(y.data), numpy_mlp(PARAMS, X), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(("mesh_name", "rules"), MLP_LAYOUTS, ids=MLP_IDS)
def test_mlp_grad_equals_eager_grad(mesh_name, rules):
    f = lower(mlp_loss, mesh_of(mesh_name), rules)
    grad = jax.grad(lambda p, x: f(p, x).data, argnums=(0, 1))(PARAMS, X)
    eager = jax.grad(lambda p, x: mlp_loss(p, x).data, argnums=(0, 1))(PARAMS, X)
    got, want = leaves(grad), leaves(eager)
    assert len(got) == len(want) == 3
    for g, e in zip(got, want, strict=True):
        assert g.dims == e.dims
        np.testing.assert_allclose(
            np.asarray(g.data), np.asarray(e.data), rtol=GRAD_RTOL, atol=GRAD_ATOL
        )
    value = float(f(PARAMS, X))
    assert value == pytest.approx(float(mlp_loss(PARAMS, X)), rel=1e-5)


def test_lowered_function_under_jit_and_value_and_grad():
    f = lower(mlp_loss, mesh_of("2x4"), "batch:rows;d_ff:cols")
    value, grad = jax.jit(jax.value_and_grad(lambda p: f(p, X).data))(PARAMS)
    e_value, e_grad = jax.value_and_grad(lambda p: mlp_loss(p, X).data)(PARAMS)
    assert float(value) == pytest.approx(float(e_value), rel=1e-5)
    for k in PARAMS:
        np.testing.assert_allclose(
            np.asarray(grad[k].data), np.asarray(e_grad[k].data), rtol=GRAD_RTOL, atol=GRAD_ATOL
        )


def test_result_dims_and_values_do_not_depend_on_the_layout():
    def fn(params, x):
        y = mlp(params, x)
        return {"y": y, "t": nm.transpose(y, "d_model batch"), "s": nm.sum(y, "batch")}

    mesh = mesh_of("2x4")
    results = [lower(fn, mesh, r)(PARAMS, X) for _, r in MLP_LAYOUTS[:6]]
    for res in results:
        assert set(res) == {"y", "t", "s"}
        assert res["y"].dims == ("batch", "d_model")
        assert res["t"].dims == ("d_model", "batch")
        assert res["s"].dims == ("d_model",)
        for k in res:
            np.testing.assert_allclose(
                np.asarray(res[k].data), np.asarray(results[0][k].data), rtol=RTOL, atol=ATOL
            )


def test_inputs_may_be_sharded_jax_arrays():
    mesh = mesh_of("2x4")
    f = lower(mlp, mesh, "batch:rows;d_ff:cols")
    y = f(PARAMS, X)
    z = f(PARAMS, y)  # y's data is a sharded jax.Array
    np.testing.assert_allclose(
        np.asarray(z.data), numpy_mlp(PARAMS, nm.tensor(np.asarray(y.data), y.dims)), rtol=1e-4
    )


def test_local_shapes():
    mesh = mesh_of("2x4")
    f = lower(mlp, mesh, "batch:rows;d_ff:cols")
    assert f.local_shapes(PARAMS, X) == [(16, 8), (8, 16), (4, 16)]  # w1, w2, x


# --- plans and compiled HLO -----------------------------------------------------------------


def _eqn_lines(plan_text: str) -> list[tuple[str, list[str]]]:
    """[(equation line, [its collective lines])] of a printed plan (local-op lines and
    free casts to varying skipped)."""
    out: list[tuple[str, list[str]]] = []
    for line in plan_text.splitlines():
        if line.startswith(("    local ", "    pvary ")):
            continue
        if line.startswith(" "):
            out[-1][1].append(line.strip())
        else:
            out.append((line, []))
    return out


def test_plan_of_megatron_shows_layouts_and_one_psum():
    f = lower(mlp, mesh_of("2x4"), "batch:rows;d_ff:cols")
    plan = f.plan(PARAMS, X)
    text = str(plan)
    eqns = _eqn_lines(text)
    assert [line.split(":")[0] for line, _ in eqns] == ["einsum", "relu", "einsum"]
    (e1, c1), (r, cr), (e2, c2) = eqns
    assert e1 == "einsum: [batch:rows, d_model] [d_model, d_ff:cols] -> [batch:rows, d_ff:cols]"
    assert r == "relu: [batch:rows, d_ff:cols] -> [batch:rows, d_ff:cols]"
    assert e2 == "einsum: [batch:rows, d_ff:cols] [d_ff:cols, d_model] -> [batch:rows, d_model]"
    assert c1 == [] and cr == []
    assert len(c2) == 1 and c2[0].startswith("psum over cols:")
    assert len(plan) == 3
    # the local ops with their per-device shapes: batch 8/2, d_ff 32/4
    assert "    local einsum(f32[4,16], f32[16,8]) -> f32[4,8]" in text.splitlines()


def test_plan_of_data_parallel_has_no_collectives():
    plan = lower(mlp, mesh_of("2x4"), "batch:rows,cols").plan(PARAMS, X)
    text = plan.format(casts=True)
    eqns = _eqn_lines(text)
    assert len(eqns) == 3 and all(c == [] for _, c in eqns)
    assert "pvary" not in str(plan) and repr(plan) == str(plan)  # casts shown on request
    # only the free casts of the two weights, whose transposes sync their gradients
    casts = [line.split(":")[0].strip() for line in text.splitlines() if "pvary" in line]
    assert casts == ["pvary over rows,cols"] * 2
    assert "[batch:rows,cols, d_model]" in eqns[0][0]


def test_plan_of_fsdp_gathers_the_weights():
    text = str(lower(mlp, mesh_of("2x4"), "batch:rows;d_model:rows").plan(PARAMS, X))
    (e1, c1), (_, cr), (e2, c2) = _eqn_lines(text)
    assert "[d_model:rows, d_ff]" in e1 and "[d_ff, d_model:rows]" in e2
    assert [c.split(":")[0] for c in c1] == ["all_gather over rows"]
    assert [c.split(":")[0] for c in c2] == ["all_gather over rows"]
    assert cr == []
    assert "psum" not in text


def test_plan_of_reduce_scatter_layout():
    text = str(lower(mlp, mesh_of("2x4"), "d_ff:cols;d_model:cols").plan(PARAMS, X))
    _, _, (e2, c2) = _eqn_lines(text)
    assert e2.endswith("-> [batch, d_model:cols]")
    assert [c.split(":")[0] for c in c2] == ["psum_scatter over cols"]


def test_hlo_of_megatron_forward_has_exactly_one_all_reduce():
    hlo = lower(mlp, mesh_of("2x4"), "batch:rows;d_ff:cols").compile(PARAMS, X).as_text()
    assert collectives_in_hlo(hlo) == ["all-reduce"]


def test_hlo_of_data_parallel_forward_has_no_collectives():
    hlo = lower(mlp, mesh_of("2x4"), "batch:rows,cols").compile(PARAMS, X).as_text()
    assert collectives_in_hlo(hlo) == []


def test_summed_dim_split_on_the_axis_the_output_wants_is_a_reduce_scatter():
    """h[batch, d_ff] w2[d_ff, d_model] under "d_ff:cols;d_model:cols": d_ff is summed and
    split on cols, the output [batch, d_model] wants d_model on cols: psum_scatter."""
    h = normal("batch d_ff", B, D_FF)
    w2 = PARAMS["w2"]
    fn = lambda h, w2: nm.einsum(h, w2)
    mesh = mesh_of("2x4")
    rules = "d_ff:cols;d_model:cols"
    y = check(fn, mesh, rules, h, w2)
    assert y.data.sharding.spec == P(None, "cols")
    hlo = lower(fn, mesh, rules).compile(h, w2).as_text()
    assert collectives_in_hlo(hlo) == ["reduce-scatter"]
    # the whole MLP under these rules: all-gather of x, reduce-scatter, and no all-reduce
    hlo = lower(mlp, mesh, rules).compile(PARAMS, X).as_text()
    found = collectives_in_hlo(hlo)
    assert "reduce-scatter" in found and "all-reduce" not in found


def test_hlo_of_fsdp_backward_reduce_scatters_the_weight_gradients():
    """The weights' all_gather transposes to a reduce-scatter, not an all-reduce + slice."""
    f = lower(mlp_loss, mesh_of("2x4"), "batch:rows;d_model:rows")
    grad = jax.jit(jax.grad(lambda p: f(p, X).data))
    found = collectives_in_hlo(grad.lower(PARAMS).compile().as_text())
    assert found.count("reduce-scatter") == 2
    assert "all-reduce" not in found


def test_compiled_object_runs():
    f = lower(mlp, mesh_of("2x4"), "batch:rows;d_ff:cols")
    compiled = f.compile(PARAMS, X)
    out = compiled(*[t.data for t in leaves([PARAMS, X])])
    np.testing.assert_allclose(np.asarray(out[0]), numpy_mlp(PARAMS, X), rtol=RTOL, atol=ATOL)


# --- elementwise -----------------------------------------------------------------------------

A = normal("batch d", 8, 16)
VEC_D = normal("d", 16)
VEC_B = normal("batch", 8)
A_T = normal("d batch", 16, 8)
W_DE = normal("d e", 16, 8, scale=0.25)

TWO_AXES = ["batch:rows;d:cols", "d:rows,cols", "batch:cols;d:rows", "batch:rows,cols", ""]

ELEMENTWISE = {
    "bcast": (lambda a, v, u: a * v + u, (A, VEC_D, VEC_B)),
    "bcast_new_order": (lambda v, a: v * a - 1.0, (VEC_D, A)),
    "outer": (lambda v, u: v * u, (VEC_D, VEC_B)),
    "transposed_operand": (lambda a, t: a - 2.0 * t, (A, A_T)),
    "where": (lambda a, u: nm.where(a > 0, a, u), (A, VEC_B)),
    "unary_chain": (lambda a: nm.tanh(nm.gelu(a)) + nm.exp(-nm.square(a)), (A,)),
    "after_einsum": (
        lambda a, w, v: nm.sigmoid(nm.einsum(a, w)) * nm.einsum(v, w),
        (A, W_DE, VEC_D),
    ),
    "compare": (lambda a, t: (a > t) | (a < -1.0), (A, A_T)),
    "maximum_int": (lambda a: nm.maximum(nm.astype(a * 4, np.int32), 0), (A,)),
}


@pytest.mark.parametrize("rules", TWO_AXES)
@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_broadcasting(name, rules):
    fn, xs = ELEMENTWISE[name]
    check(fn, mesh_of("2x4"), rules, *xs)


# --- reductions ------------------------------------------------------------------------------

REDUCTIONS = {
    "sum": nm.sum,
    "mean": nm.mean,
    "max": nm.max,
    "min": nm.min,
    "logsumexp": nm.logsumexp,
}


@pytest.mark.parametrize("rules", ["batch:rows;d:cols", "d:rows,cols", "batch:cols;d:rows"])
@pytest.mark.parametrize("dims", ["d", "batch", "batch d", None])
@pytest.mark.parametrize("op", list(REDUCTIONS))
def test_reduction_over_split_dims(op, dims, rules):
    red = REDUCTIONS[op]
    y = check(lambda a: red(a, dims), mesh_of("2x4"), rules, A)
    kept = () if dims is None else tuple(d for d in A.dims if d not in dims.split())
    assert y.dims == kept


@pytest.mark.parametrize("rules", ["batch:rows;d:cols", "d:rows,cols"])
def test_reductions_of_ints_and_bools(rules):
    ai = nm.tensor(
        np.random.default_rng(1).integers(-5, 5, size=(8, 16)).astype(np.int32), "batch d"
    )
    fn = lambda a: (
        nm.sum(a, "d"),
        nm.max(a, "d"),
        nm.mean(a),
        nm.sum(a > 0, "d"),
        nm.any(a > 3, "d"),
        nm.all(a > -5, "batch"),
    )
    check(fn, mesh_of("2x4"), rules, ai)


def test_logsumexp_with_minus_infinity():
    a = nm.tensor(np.where(A.data > 0, A.data, -np.inf).astype(np.float32), "batch d")
    check(lambda a: nm.logsumexp(a, "d"), mesh_of("2x4"), "batch:rows;d:cols", a)


@pytest.mark.parametrize("rules", ["batch:rows;d:cols", "d:rows,cols"])
def test_grad_of_reductions_and_softmax_over_split_dims(rules):
    loss = lambda a: (
        nm.sum(nm.logsumexp(a, "d"))
        + nm.sum(nm.log_softmax(a, "d") * VEC_D)
        + nm.sum(nm.max(a, "d") * VEC_B)
        + nm.mean(nm.softmax(a, "batch d") * a)
    )
    f = lower(loss, mesh_of("2x4"), rules)
    g = jax.grad(lambda a: f(a).data)(A)
    e = jax.grad(lambda a: loss(a).data)(A)
    np.testing.assert_allclose(
        np.asarray(g.data), np.asarray(e.data), rtol=GRAD_RTOL, atol=GRAD_ATOL
    )


def test_grad_of_max_with_ties_across_shards_equals_eager():
    v = np.zeros((2, 16), np.float32)
    v[0, 0] = v[0, 4] = v[0, 5] = v[0, 6] = 1.0  # one tie in cols-shard 0, three in shard 1
    x = nm.tensor(v, "batch d")
    loss = lambda x: nm.sum(nm.max(x, "d"))
    f = lower(loss, mesh_of("2x4"), "d:cols")
    g = jax.grad(lambda x: f(x).data)(x)
    e = jax.grad(lambda x: loss(x).data)(x)  # 1/4 to each of the four maxima
    np.testing.assert_allclose(np.asarray(g.data), np.asarray(e.data), atol=1e-6)


# --- ops along dims --------------------------------------------------------------------------

A16 = normal("batch d", 16, 16)
ALONG_LAYOUTS = ["batch:rows;d:cols", "batch:rows,cols", "d:rows,cols", "d:cols;batch:rows"]

ALONG = {
    "softmax": lambda a, d: nm.softmax(a, d),
    "log_softmax": lambda a, d: nm.log_softmax(a, d),
    "cumsum": lambda a, d: nm.cumsum(a, d),
    "cumsum_reverse": lambda a, d: nm.cumsum(a, d, reverse=True),
    "top_k": lambda a, d: nm.top_k(a, d, 8),
    "top_k_new_dim": lambda a, d: nm.top_k(a, d, 8, new_dim="k"),
    "top_k_2": lambda a, d: nm.top_k(a, d, 2, new_dim="k"),  # per-shard candidates
    "argmax": lambda a, d: nm.argmax(a, d),
    "argmin": lambda a, d: nm.argmin(a, d),
}


@pytest.mark.parametrize("rules", ALONG_LAYOUTS)
@pytest.mark.parametrize("dim", ["d", "batch"])
@pytest.mark.parametrize("op", list(ALONG))
def test_ops_along_split_and_unsplit_dims(op, dim, rules):
    fn = lambda a: ALONG[op](a, dim)
    check(fn, mesh_of("2x4"), rules, A16, rtol=1e-5, atol=1e-5)


def test_softmax_over_two_dims():
    check(lambda a: nm.softmax(a, "batch d"), mesh_of("2x4"), "batch:rows;d:cols", A16)
    check(lambda a: nm.log_softmax(a, "batch d"), mesh_of("2x4"), "d:rows,cols", A16)


@pytest.mark.parametrize("rules", ["d:cols", "d:rows,cols", "batch:rows;d:cols"])
def test_argmax_argmin_top_k_with_ties_take_the_first(rules):
    ai = nm.tensor(
        np.random.default_rng(2).integers(0, 3, size=(8, 16)).astype(np.int32), "batch d"
    )
    fn = lambda a: (
        nm.argmax(a, "d"),
        nm.argmin(a, "d"),
        nm.top_k(a, "d", 2, new_dim="k"),
        nm.top_k(nm.astype(a, np.float32), "d", 2, new_dim="k"),
    )
    y = check(fn, mesh_of("2x4"), rules, ai)
    np.testing.assert_array_equal(np.asarray(y[0].data), np.argmax(ai.data, axis=1))
    np.testing.assert_array_equal(np.asarray(y[1].data), np.argmin(ai.data, axis=1))


# --- slice / pad / shift / concat along split dims ----------------------------------------

STRUCTURAL = {
    "slice": lambda a: nm.slice(a, "d", 4, 12),
    "slice_step": lambda a: nm.slice(a, "d", 1, None, 2),
    "slice_batch": lambda a: nm.slice(a, "batch", 8),
    "shift": lambda a: nm.shift(a, "d", 3),
    "shift_back_fill": lambda a: nm.shift(a, "d", -5, fill=7.0),
    "shift_wrap": lambda a: nm.shift(a, "d", -5, wrap=True),
    "shift_batch_wrap": lambda a: nm.shift(a, "batch", 9, wrap=True),
    "shift_one": lambda a: nm.shift(a, "d", 1),  # halo exchange with a neighbour
    "shift_minus_one_fill": lambda a: nm.shift(a, "d", -1, fill=3.0),
    "shift_two_wrap": lambda a: nm.shift(a, "d", 2, wrap=True),
    "shift_minus_two_wrap": lambda a: nm.shift(a, "d", -2, wrap=True),
    "shift_a_whole_shard": lambda a: nm.shift(a, "d", 4),
    "shift_minus_a_whole_shard_wrap": lambda a: nm.shift(a, "d", -4, wrap=True),
    "shift_zero": lambda a: nm.shift(a, "d", 0),
    "shift_past_the_end": lambda a: nm.shift(a, "d", 20),
    "cumsum_of_bools": lambda a: nm.cumsum(a > 0, "d"),
    "concat": lambda a: nm.concat([a, 2.0 * a], "d"),
    "concat_transposed": lambda a: nm.concat([a, nm.transpose(a, "d batch")], "batch"),
    "concat_three": lambda a: nm.concat([a, nm.slice(a, "d", 0, 8), -a], "d"),
    "split": lambda a: nm.split(a, "d", 2),
    "split_sizes_then_concat": lambda a: nm.concat(nm.split(a, "d", (6, 10))[::-1], "d"),
    "pad": lambda a: nm.pad(a, {"d": (2, 6)}),
    "pad_batch_value": lambda a: nm.pad(a, {"batch": 8}, value=-1.0),
}


@pytest.mark.parametrize("rules", ["batch:rows;d:cols", "d:rows,cols", "batch:cols;d:rows"])
@pytest.mark.parametrize("op", list(STRUCTURAL))
def test_structural_ops_along_split_dims(op, rules):
    check(STRUCTURAL[op], mesh_of("2x4"), rules, A16)


def test_intermediate_an_axis_does_not_divide_is_left_unsplit():
    """d splits into 6 and 10 (not divisible by 4); the concatenated output is split again."""
    fn = lambda a: nm.concat([nm.exp(nm.slice(a, "d", 0, 6)), nm.slice(a, "d", 6, None)], "d")
    y = check(fn, mesh_of("2x4"), "d:cols;batch:rows", A16)
    assert y.data.sharding.spec == P("rows", "cols")


RESHAPES = {
    "split": lambda a: nm.reshape(a, {"h": 4, "k": 4}, from_="d"),
    "split_uneven": lambda a: nm.reshape(a, {"h": 8, "k": 2}, from_="d"),
    "merge": lambda a: nm.reshape(a, {"m": 256}, from_="batch d"),
    "merge_transposed": lambda a: nm.reshape(a, {"m": 256}, from_="d batch"),
    "rename_like": lambda a: nm.reshape(a, {"e": 16}, from_="d"),
    "round_trip": lambda a: nm.reshape(
        2.0 * nm.reshape(a, {"h": 4, "k": 4}, from_="d"), {"d": 16}, from_="h k"
    ),
}


@pytest.mark.parametrize(
    "rules",
    [
        "batch:rows;d:cols",
        "d:rows,cols",
        "d:cols;h:rows",
        "h:cols;k:rows",
        "k:rows;m:rows,cols",
        "batch:cols;d:rows;e:cols",
    ],
)
@pytest.mark.parametrize("op", list(RESHAPES))
def test_reshape_under_layouts(op, rules):
    # One rule set for all the reshapes, each of which has only some of its dims.
    check(RESHAPES[op], mesh_of("2x4"), Layout(rules, shared=True), A16)


def test_reshape_and_transpose():
    fn = lambda a: nm.transpose(nm.reshape(a, {"h": 4, "k": 4}, from_="d"), "k batch h")
    check(fn, mesh_of("2x4"), "h:cols;batch:rows", A16)
    check(fn, mesh_of("2x2x2"), "k:a,b;batch:c", A16)


# --- creation, random numbers and dropout ----------------------------------------------------

RANDOM_LAYOUTS = ["", "batch:rows;d:cols", "d:rows,cols", "batch:rows,cols", "d:cols;batch:rows"]


def _random_fn(k, x):
    n = nm.random.normal(k, {"batch": 8, "d": 16})
    u = nm.random.uniform(nm.random.fold_in(k, 1), {"d": 16, "batch": 8}, -1.0, 1.0)
    dropped = nm.dropout(x, 0.25, nm.random.fold_in(k, 2))
    return n, u, dropped


@pytest.mark.parametrize("rules", RANDOM_LAYOUTS)
def test_random_and_dropout_equal_single_device_values(rules):
    key = nm.random.key(42)
    x = A
    eager = _random_fn(key, x)
    got = lower(_random_fn, mesh_of("2x4"), rules)(key, x)
    for g, e in zip(got, eager, strict=True):
        assert g.dims == e.dims and g.dtype == e.dtype
        np.testing.assert_allclose(np.asarray(g.data), e.data, rtol=1e-6, atol=1e-6)
        assert_sharded_as_layout(g, mesh_of("2x4"), rules)
    # the dropout mask is exactly the eager one, and about a quarter is dropped
    np.testing.assert_array_equal(np.asarray(got[2].data) == 0, eager[2].data == 0)
    assert 0.1 < np.mean(eager[2].data == 0) < 0.4


def test_random_values_are_layout_independent():
    key = nm.random.key(7)
    outs = [lower(_random_fn, mesh_of("2x4"), r)(key, A) for r in RANDOM_LAYOUTS]
    outs += [lower(_random_fn, mesh_of("2x2x2"), "batch:a,b;d:c")(key, A)]
    for out in outs[1:]:
        for g, r in zip(out, outs[0], strict=True):
            np.testing.assert_allclose(np.asarray(g.data), np.asarray(r.data), rtol=0, atol=1e-6)
            np.testing.assert_array_equal(np.asarray(g.data) == 0, np.asarray(r.data) == 0)


def test_random_inside_the_program_with_constant_seed():
    fn = lambda x: x + nm.random.normal(3, x.sizes)
    check(fn, mesh_of("2x4"), "batch:rows;d:cols", A, rtol=1e-6, atol=1e-6)


def test_full_and_arange_under_layouts():
    fn = lambda a: a * nm.arange("d", 16, dtype=np.float32) + nm.full({"batch": 8}, 2.0)
    for rules in ["batch:rows;d:cols", "d:rows,cols", ""]:
        check(fn, mesh_of("2x4"), rules, A)


# --- one_hot embedding lookup, N-ary einsum ---------------------------------------------------

VOCAB = 32
IDS = nm.tensor(rng.integers(0, VOCAB, size=(8, 4)).astype(np.int32), "batch seq")
EMB = normal("vocab d_model", VOCAB, 16)


def embed(ids, emb):
    return nm.einsum(nm.one_hot(ids, "vocab", VOCAB), emb)


@pytest.mark.parametrize(
    "rules",
    [
        "batch:rows;d_model:cols",
        "vocab:rows,cols",
        "vocab:cols;d_model:rows",
        "seq:cols;vocab:rows",
        "batch:rows,cols;vocab:cols",
        "",
    ],
)
def test_one_hot_embedding_lookup(rules):
    expected = nm.tensor(EMB.data[IDS.data], "batch seq d_model")
    y = check(embed, mesh_of("2x4"), rules, IDS, EMB, expected=expected)
    assert y.dims == ("batch", "seq", "d_model")


def test_grad_of_embedding_lookup_is_a_scatter_add():
    loss = lambda ids, emb: nm.sum(embed(ids, emb) * nm.arange("d_model", 16, dtype=np.float32))
    f = lower(loss, mesh_of("2x4"), "vocab:rows,cols")
    g = jax.grad(lambda emb: f(IDS, emb).data)(EMB)
    want = np.zeros((VOCAB, 16), np.float32)
    np.add.at(want, IDS.data.reshape(-1), np.arange(16, dtype=np.float32))
    np.testing.assert_allclose(np.asarray(g.data), want, rtol=GRAD_RTOL, atol=GRAD_ATOL)


IDS_ODD = nm.tensor(np.array([[0, 31, 7, 12], [-1, 5, 30, 8]], np.int32), "batch seq")
IDS_OUT_OF_RANGE = nm.tensor(np.array([[0, 31, 32, 40], [-1, -32, -33, 5]], np.int32), "batch seq")


@pytest.mark.parametrize("rules", ["vocab:cols", "vocab:rows,cols", "batch:rows;vocab:cols", ""])
def test_one_hot_with_a_split_new_dim_and_out_of_range_indices(rules):
    fn = lambda ids: nm.one_hot(ids, "vocab", VOCAB)
    y = check(fn, mesh_of("2x4"), rules, IDS_OUT_OF_RANGE)
    assert float(np.asarray(y.data).sum()) == 3  # only 0, 31 and 5 are in range
    np.testing.assert_array_equal(np.asarray(y.data).sum(-1), [[1, 1, 0, 0], [0, 0, 0, 1]])


EMB8 = normal("vocab d_model", VOCAB, 8)
EMB3 = normal("batch vocab d_model", 2, VOCAB, 8)
IDS_SB = nm.tensor(rng.integers(0, VOCAB, size=(4, 2)).astype(np.int32), "seq batch")
GATHER_LAYOUTS = [
    "vocab:cols",
    "vocab:rows,cols",
    "vocab:rows,cols;seq:cols",
    "batch:rows;d_model:cols",
    "d_model:cols;vocab:rows",
    "",
]


@pytest.mark.parametrize("rules", GATHER_LAYOUTS)
def test_gather_rows_of_a_table(rules):
    fn = lambda e, i: nm.gather(e, "vocab", i)
    y = check(fn, mesh_of("2x4"), rules, EMB8, IDS_ODD)
    np.testing.assert_array_equal(np.asarray(y.data), EMB8.data[IDS_ODD.data])


@pytest.mark.parametrize("rules", GATHER_LAYOUTS)
def test_gather_matching_a_shared_dim_pointwise(rules):
    fn = lambda e, i: nm.gather(e, "vocab", i)
    y = check(fn, mesh_of("2x4"), rules, EMB3, IDS_SB)
    assert y.dims == ("batch", "seq", "d_model")


@pytest.mark.parametrize("rules", ["", "batch:rows;d_model:cols"])
def test_gather_clamps_out_of_range_indices(rules):
    fn = lambda e, i: nm.gather(e, "vocab", i)
    check(fn, mesh_of("2x4"), rules, EMB8, IDS_OUT_OF_RANGE)


@pytest.mark.parametrize("rules", ["vocab:cols", "vocab:rows,cols"])
def test_gather_clamps_out_of_range_indices_with_a_split_table(rules):
    fn = lambda e, i: nm.gather(e, "vocab", i)
    check(fn, mesh_of("2x4"), rules, EMB8, IDS_OUT_OF_RANGE)


@pytest.mark.parametrize("rules", ["batch:rows;d:cols", "d:rows,cols", "d:cols;h:rows;vocab:rows"])
def test_grad_through_shift_cumsum_top_k_reshape_gather_one_hot(rules):
    local = np.random.default_rng(3)
    ids = nm.tensor(local.integers(0, VOCAB, size=(16,)).astype(np.int32), "batch")
    table = nm.tensor(local.normal(size=(VOCAB, 16)).astype(np.float32), "vocab d")
    weight = nm.tensor(local.normal(size=(16,)).astype(np.float32), "d")

    def loss(a, table):
        t = nm.shift(a, "d", 1) + nm.shift(a, "d", -2, wrap=True) + 0.1 * nm.cumsum(a, "d")
        top, _ = nm.top_k(a, "d", 2, new_dim="k")
        r = nm.reshape(a, {"h": 4, "k2": 4}, from_="d")
        g = nm.gather(table, "vocab", ids)
        o = nm.einsum(nm.one_hot(ids, "vocab", VOCAB), table)
        return (
            nm.sum(t * weight) + nm.sum(top) + nm.sum(nm.square(r)) + nm.sum(g * a) + nm.sum(o * o)
        )

    f = lower(loss, mesh_of("2x4"), rules)
    got = jax.grad(lambda a, e: f(a, e).data, argnums=(0, 1))(A16, table)
    want = jax.grad(lambda a, e: loss(a, e).data, argnums=(0, 1))(A16, table)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(
            np.asarray(g.data), np.asarray(e.data), rtol=GRAD_RTOL, atol=GRAD_ATOL
        )


N_I, N_J, N_K, N_L = 8, 4, 16, 8
EA, EB = normal("i j", N_I, N_J), normal("j k", N_J, N_K, scale=0.5)
EC, ED = normal("k l", N_K, N_L, scale=0.25), normal("l i", N_L, N_I)


def nary(a, b, c, d):
    return nm.einsum(a, b, c, d, out="i l")


@pytest.mark.parametrize(
    ("mesh_name", "rules"),
    [
        ("2x4", "i:rows;k:cols"),
        ("2x4", "k:rows,cols"),
        ("2x4", "l:rows;j:cols"),
        ("2x4", "i:cols;l:rows"),
        ("2x2x2", "i:a;k:b;l:c"),
        ("8", "k:x"),
    ],
)
def test_n_ary_einsum(mesh_name, rules):
    expected = nm.tensor(np.einsum("ij,jk,kl,li->il", EA.data, EB.data, EC.data, ED.data), "i l")
    check(nary, mesh_of(mesh_name), rules, EA, EB, EC, ED, expected=expected)


def test_einsum_variants():
    mesh = mesh_of("2x4")
    w = W_DE
    cases = [
        lambda a, w: nm.einsum(a, w, out="e batch"),  # output transposed
        lambda a, w: nm.einsum(a, w, out="e"),  # batch summed in one operand only
        lambda a, w: nm.einsum(a, out="d batch"),  # one operand
        lambda a, w: nm.einsum(a, out="d"),
        lambda a, w: nm.einsum(nm.sum(a, "d"), nm.sum(w, "d"), out="batch e"),  # outer
        lambda a, w: nm.dot(a, w, over="d"),
    ]
    for fn in cases:
        for rules in ["batch:rows;d:cols", "d:rows,cols;e:cols", "e:rows;batch:cols;d:rows"]:
            check(fn, mesh, rules, A, w, rtol=1e-5, atol=3e-5)


def test_a_replicated_value_used_twice_by_split_weights_is_psummed_once_in_backward():
    """x (replicated over model) meets two model-split weights: its gradient is the sum of
    both uses' cotangents, all-reduced once (a cast per use would all-reduce each)."""
    r = np.random.default_rng(0)
    x = nm.tensor(r.normal(size=(4, 8)).astype(np.float32), "batch d_model")
    wa, wb = (nm.tensor(r.normal(size=(8, 16)).astype(np.float32), "d_model d_ff") for _ in "ab")

    def loss(x, wa, wb):
        return (nm.relu(nm.einsum(x, wa)) * nm.einsum(x, wb)).sum()

    f = lower(loss, Mesh({"model": 8}), "d_ff:model")
    grad = jax.jit(jax.grad(lambda *a: f(*a).data, argnums=(0, 1, 2)))
    text = grad.lower(x, wa, wb).compile().as_text()
    reduces = [c for c in collectives(text) if c[0] == "all-reduce"]
    assert reduces == [("all-reduce", 4 * 8 * 4, 8)]
    ha, hb = np.maximum(x.data @ wa.data, 0), x.data @ wb.data
    want = ((ha > 0) * hb) @ wa.data.T + ha @ wb.data.T
    np.testing.assert_allclose(np.asarray(grad(x, wa, wb)[0].data), want, rtol=1e-4, atol=1e-4)


def _expert_ffn(x, wi, wo):
    h = nm.relu(nm.einsum(x, wi, out="batch experts d_ff"))
    return nm.einsum(h, wo, out="batch experts d_model")


def _expert_ffn_numpy(x, wi, wo):
    h = np.maximum(np.einsum("bed,edf->bef", x, wi), 0)
    return np.einsum("bef,efd->bed", h, wo)


_R = np.random.default_rng(7)
TOKENS = nm.tensor(_R.normal(size=(8, 8, 4)).astype(np.float32), "batch experts d_model")
WI = nm.tensor(_R.normal(size=(8, 4, 64)).astype(np.float32), "experts d_model d_ff")
WO = nm.tensor(_R.normal(size=(8, 64, 4)).astype(np.float32), "experts d_ff d_model")


def test_conflicting_dims_move_the_tokens_not_the_expert_weights():
    """batch and experts share one axis: rule order (batch first) would compute the FFN
    split by batch and all-gather both expert weights; the planner weighs experts first
    and moves the tokens by all_to_all in and out (GShard), the activation staying put."""
    f = lower(_expert_ffn, mesh_of("8"), "batch:x;experts:x")
    plan = f.plan(TOKENS, WI, WO)
    kinds = [(s.name, c[0]) for s in plan for c in s.collectives]
    assert kinds == [("einsum", "all_to_all"), ("outputs", "all_to_all")], str(plan)
    assert plan[0].outputs == [(("batch", "experts", "d_ff"), ((), ("x",), ()))]
    assert plan[1].inputs == plan[1].outputs == plan[0].outputs  # the relu moves nothing
    want = _expert_ffn_numpy(TOKENS.data, WI.data, WO.data)
    y = f(TOKENS, WI, WO)
    assert y.dims == TOKENS.dims
    np.testing.assert_allclose(np.asarray(y.data), want, rtol=RTOL, atol=1e-4)
    assert_sharded_as_layout(y, mesh_of("8"), "batch:x;experts:x")  # outputs: rule order
    text = f.compile(TOKENS, WI, WO).as_text()
    assert "all-gather" not in text


def test_conflicting_dims_gradients_and_rule_order_when_it_is_cheaper():
    """The gradients under the planner's layouts equal NumPy's; with tokens far bigger than
    the weights, gathering the weights is cheaper and rule order stays."""
    f = lower(
        lambda x, wi, wo: (_expert_ffn(x, wi, wo) ** 2).sum(), mesh_of("8"), "batch:x;experts:x"
    )
    gi, go = jax.grad(lambda wi, wo: f(TOKENS, wi, wo).data, argnums=(0, 1))(WI, WO)
    x, wi, wo = TOKENS.data, WI.data, WO.data
    a = np.einsum("bed,edf->bef", x, wi)
    dy = 2 * _expert_ffn_numpy(x, wi, wo)
    dh = np.einsum("bed,efd->bef", dy, wo) * (a > 0)
    np.testing.assert_allclose(
        np.asarray(go.data), np.einsum("bef,bed->efd", np.maximum(a, 0), dy), rtol=1e-4, atol=1e-3
    )
    np.testing.assert_allclose(
        np.asarray(gi.data), np.einsum("bed,bef->edf", x, dh), rtol=1e-4, atol=1e-3
    )
    big = nm.tensor(_R.normal(size=(8, 8, 512, 4)).astype(np.float32), "batch experts slot d_model")
    g = lower(
        lambda x, wi: nm.einsum(x, wi, out="batch experts slot d_ff"),
        mesh_of("8"),
        "batch:x;experts:x",
    )
    kinds = [c[0] for s in g.plan(big, WI) for c in s.collectives]
    assert kinds == ["all_gather"]
    want = np.einsum("besd,edf->besf", big.data, WI.data)
    np.testing.assert_allclose(np.asarray(g(big, WI).data), want, rtol=RTOL, atol=1e-4)


def test_conflicting_dims_inside_a_scan_keep_the_carry_layout():
    """The expert FFN as a scan body: the body computes experts-split, the carry is moved
    back to its rule-order layout at the end of each iteration."""
    x3 = nm.tensor(
        _R.normal(size=(2, 8, 8, 4)).astype(np.float32) * 0.3, "step batch experts d_model"
    )

    def loop(c, xs, wi, wo):
        return nm.scan(
            lambda c, x: (_expert_ffn(c + x, wi, wo) * 0.1, c.sum("d_model")), c, xs, "step"
        )

    f = lower(loop, mesh_of("8"), "batch:x;experts:x")
    carry, ys = f(TOKENS, x3, WI, WO)
    c, want_ys = TOKENS.data, []
    for i in range(2):
        want_ys.append(c.sum(-1))
        c = _expert_ffn_numpy(c + x3.data[i], WI.data, WO.data) * 0.1
    np.testing.assert_allclose(np.asarray(carry.data), c, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ys.data), np.stack(want_ys), rtol=1e-4, atol=1e-4)
    body = [s for s in f.plan(TOKENS, x3, WI, WO) if s.depth == 1]
    kinds = [c[0] for s in body for c in s.collectives]
    assert "all_gather" not in kinds and kinds.count("all_to_all") >= 2, kinds
