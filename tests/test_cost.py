"""The cost report against what XLA compiles: the same collectives (kind, bytes, group
size) in the HLO, and flops within 10% of cost_analysis()."""

import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, lower
from lowering.collectives import relayout_traffic
from lowering.cost import expected_hlo, traffic
from lowering.hlo import collectives
from lowering.layout import Layout

R = np.random.default_rng(0)
X = nm.tensor(R.normal(size=(64, 128)).astype(np.float32), "batch d_model")
W1 = nm.tensor(R.normal(size=(128, 512)).astype(np.float32), "d_model d_ff")
W2 = nm.tensor(R.normal(size=(512, 128)).astype(np.float32), "d_ff d_model")
IDS = nm.tensor(R.integers(0, 512, size=(64, 8)).astype(np.int32), "batch seq")
MESH = Mesh({"rows": 2, "cols": 4})


def mlp(x, w1, w2):
    return nm.einsum(nm.relu(nm.einsum(x, w1)), w2, out="batch d_model")


def attention_like(x, w1, w2):
    logits = nm.einsum(x, w1)
    return nm.einsum(nm.softmax(logits, "d_ff"), w2, out="batch d_model")


def embed(x, w1, w2):
    return nm.gather(w2, "d_ff", IDS).sum("seq") + nm.shift(x, "batch", 1)


CASES = [
    (mlp, "batch:rows;d_ff:cols"),
    (mlp, "batch:rows,cols"),
    (mlp, "d_ff:cols;d_model:cols"),
    (mlp, "batch:rows;d_model:rows"),
    (mlp, "batch:rows;d_model:cols"),
    (mlp, "d_ff:rows,cols"),
    (attention_like, "batch:rows;d_ff:cols"),
    (embed, "d_ff:cols;batch:rows"),
]


@pytest.mark.parametrize("fn, layout", CASES, ids=[f"{f.__name__}-{lay}" for f, lay in CASES])
def test_report_matches_compiled_hlo(fn, layout):
    lowered = lower(fn, MESH, layout)
    compiled = lowered.compile(X, W1, W2)
    plan = lowered.plan(X, W1, W2)
    assert sorted(collectives(compiled.as_text())) == sorted(expected_hlo(plan, MESH.sizes))
    if fn is not embed:  # data movement only: XLA counts its selects and compares as flops
        report = lowered.report(X, W1, W2, show=False)
        xla_flops = compiled.cost_analysis()["flops"]
        assert abs(report.flops - xla_flops) <= 0.1 * xla_flops


def test_megatron_mlp_has_one_all_reduce_of_the_output():
    lowered = lower(mlp, MESH, "batch:rows;d_ff:cols")
    found = collectives(lowered.compile(X, W1, W2).as_text())
    assert found == [("all-reduce", 64 // 2 * 128 * 4, 4)]
    report = lowered.report(X, W1, W2, show=False)
    ((key, (count, sent)),) = report.collectives.items()
    assert key == ("psum", ("cols",)) and count == 1
    assert sent == 2 * 3 / 4 * (32 * 128 * 4)  # ring all-reduce: 2 (n-1)/n S


def test_ring_traffic_formulas():
    sizes = {"a": 4, "b": 2}
    assert traffic("psum", ("a",), 1000, sizes) == 2 * 3 / 4 * 1000
    assert traffic("psum_scatter", ("a", "b"), 800, sizes) == 7 / 8 * 800
    assert traffic("all_gather", ("b",), 500, sizes) == 500
    assert traffic("all_to_all", ("a",), 400, sizes) == 300


def test_report_prints_flops_bytes_and_memory(capsys):
    lower(mlp, MESH, "batch:rows;d_ff:cols").report(X, W1, W2)
    out = capsys.readouterr().out
    assert "per-device flops" in out and "psum" in out and "peak memory" in out


def _grad_collectives(layout):
    import jax

    lowered = lower(mlp, MESH, layout)
    loss = lambda w1, w2: (lowered(X, w1, w2).data ** 2).sum()
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(W1, W2).compile().as_text()
    return collectives(text)


def test_megatron_backward_adds_only_the_data_parallel_gradient_sync():
    """psum transposes to a free broadcast: besides the forward all-reduce over cols,
    the only collective is the all-reduce of the weight gradients over rows."""
    found = _grad_collectives("batch:rows;d_ff:cols")
    kinds = {k for k, _, _ in found}
    assert kinds == {"all-reduce"}
    over_cols = [b for k, b, n in found if n == 4]
    over_rows = [b for k, b, n in found if n == 2]
    assert over_cols == [32 * 128 * 4]
    assert sum(over_rows) == 2 * (128 * 512 // 4) * 4  # w1 and w2 shards, once each


def test_fsdp_backward_reduce_scatters_what_the_forward_gathered():
    """all_gather transposes to psum_scatter: no all-reduce of full weight gradients."""
    found = _grad_collectives("batch:rows;d_model:rows")
    assert sorted(k for k, _, _ in found) == [
        "all-gather",
        "all-gather",
        "reduce-scatter",
        "reduce-scatter",
    ]
    assert all(n == 2 for _, _, n in found)


def _training_hlo(lowered, argnums, *args):
    """Collective bytes sent per device by value_and_grad of the lowered loss, read from
    its compiled HLO (the loss is returned, so nothing of the forward is dead)."""
    import jax

    from benchmarks.collectives import hlo_traffic

    step = jax.jit(jax.value_and_grad(lambda *a: lowered(*a).data, argnums=argnums))
    return hlo_traffic(step.lower(*args).compile().as_text())


@pytest.mark.parametrize("fn, layout", CASES, ids=[f"{f.__name__}-{lay}" for f, lay in CASES])
@pytest.mark.parametrize("wrt", [(1, 2), (0, 1, 2)], ids=["weights", "all"])
def test_training_report_equals_the_compiled_training_step(fn, layout, wrt):
    """Forward plus jax's transposes, as the report predicts them, are what XLA runs:
    gradient syncs from casts to varying, reduce-scatters from gathers, none for x
    when it is not differentiated."""
    lowered = lower(lambda *a: (fn(*a) ** 2).sum(), MESH, layout)  # a nonlinear loss
    rep = lowered.report(X, W1, W2, wrt=wrt, show=False)
    assert rep.bytes + rep.backward_bytes == pytest.approx(_training_hlo(lowered, wrt, X, W1, W2))


def test_training_report_of_data_parallel_is_the_gradient_all_reduce():
    rep = lower(mlp, MESH, "batch:rows,cols").report(X, W1, W2, wrt=(1, 2), show=False)
    ((key, (count, sent)),) = rep.backward.items()
    assert key == ("psum", ("rows", "cols")) and count == 2
    assert sent == pytest.approx(2 * 7 / 8 * (W1.data.nbytes + W2.data.nbytes))
    # per device (batch 64/8): w1's gradient; relu's; w2's and h's gradients
    matmul = 2 * 8 * 128 * 512
    assert rep.backward_flops == pytest.approx(matmul + 8 * 512 + 2 * matmul)


def test_report_wrt_names_a_missing_argument():
    with pytest.raises(nm.NamedMeshError, match="no argument"):
        lower(mlp, MESH, "batch:rows").report(X, W1, W2, wrt=3, show=False)
    with pytest.raises(nm.NamedMeshError, match=r"report\(wrt=...\): argument positions are ints"):
        lower(mlp, MESH, "batch:rows").report(X, W1, W2, wrt=("w1",), show=False)
    with pytest.raises(nm.NamedMeshError, match="argument positions are ints"):
        lower(mlp, MESH, "batch:rows").report(X, W1, W2, wrt=True, show=False)


@pytest.mark.parametrize(
    "src, dst",
    [
        ("batch:rows", "d_model:rows"),  # all_to_all
        ("batch:rows,cols", "d_model:cols"),  # gather rows, move cols
        ("batch:cols;d_model:rows", "batch:rows;d_model:cols"),
        ("d_model:rows,cols", "batch:cols;d_model:rows"),
        ("", "batch:rows;d_model:cols"),  # slices only: free
    ],
)
def test_relayout_traffic_is_what_the_relayout_sends(src, dst):
    """`relayout_traffic` costs the moves `relayout` runs: equal to the report's bytes of a
    lowered `nm.constrain` between the two layouts, and to the HLO's collectives."""
    f = lower(lambda x: nm.constrain(x, dst), MESH, src)
    (step,) = [s for s in f.plan(X) if s.name == "constrain"]
    sent = sum(traffic(c.kind, c.axes, c.nbytes, MESH.sizes) for c in step.collectives)
    lay_src = Layout(src).of(X.dims, X.shape, MESH)
    lay_dst = Layout(dst, strict=True).of(X.dims, X.shape, MESH)
    local = X.data.nbytes
    for axes in lay_src:
        for a in axes:
            local //= MESH.sizes[a]
    assert relayout_traffic(lay_src, lay_dst, local, MESH.sizes) == pytest.approx(sent)
    assert (sent == 0) == (src == "")
    np.testing.assert_array_equal(np.asarray(f(X).data), X.data)
    hlo = collectives(f.compile(X).as_text())
    assert sorted(hlo) == sorted(expected_hlo(f.plan(X), MESH.sizes))


REDUCING = {  # every op that reduces or scans along a dim, with a rule of its own there
    "sum": lambda x: nm.sum(x, "s"),
    "mean": lambda x: nm.mean(x, "s"),
    "prod": lambda x: nm.prod(x, "s"),
    "max": lambda x: nm.max(x, "s"),
    "logsumexp": lambda x: nm.logsumexp(x, "s"),
    "var": lambda x: nm.var(x, "s"),
    "std": lambda x: nm.std(x, "s", ddof=1),
    "softmax": lambda x: nm.softmax(x, "s"),
    "log_softmax": lambda x: nm.log_softmax(x, "s"),
    "cumsum": lambda x: nm.cumsum(x, "s"),
    "argmax": lambda x: nm.argmax(x, "s"),
    "top_k": lambda x: nm.top_k(x, "s", 4)[0],
}


@pytest.mark.parametrize("layout", ["s:m0", "s:m0,m1", "p:m0;s:m1"])
@pytest.mark.parametrize("op", sorted(REDUCING))
def test_an_op_along_a_split_dim_costs_its_work_on_every_device(op, layout):
    """No op's work goes uncosted along a split dim, whatever arithmetic its rule does
    itself: the devices' flops add up to at least the op's flops on one device (var and
    std once costed only their two local sums, half the work)."""
    x = nm.abstract({"p": 4, "q": 2, "s": 8})
    mesh = Mesh({"m0": 2, "m1": 2}, devices="abstract")
    split = lower(REDUCING[op], mesh, layout).report(x, show=False).flops
    whole = lower(REDUCING[op], mesh, "").report(x, show=False).flops
    assert whole > 0 and split * 4 >= whole, (split, whole)


def test_no_backward_is_charged_where_only_a_comparison_reads_the_gradients_path():
    """A loss that reads the weights' products only through a comparison has a zero
    gradient, which jax leaves out (a symbolic zero): XLA runs no backward collective,
    and the report charges none (it charged the Megatron MLP's gradient psums)."""

    def gated(x, w1, w2):
        h = nm.einsum(nm.einsum(x, w1, out="batch d_ff"), w2, out="batch d_model")
        return nm.astype(nm.greater(h, x), np.float32).sum() + (x**2).sum()

    lowered = lower(gated, MESH, "batch:rows;d_ff:cols")
    rep = lowered.report(X, W1, W2, wrt=(1, 2), show=False)
    assert rep.backward_bytes == 0 and rep.backward_flops == 0
    training = _training_hlo(lowered, (1, 2), X, W1, W2)
    assert rep.bytes + rep.backward_bytes == pytest.approx(training)
