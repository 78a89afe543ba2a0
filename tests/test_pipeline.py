"""Pipeline parallelism as a layout (lowering/pipeline.py): the LM whose `layers` a rule
splits over a `stage` axis trains as on one device (loss and gradients against the
un-lowered model run by jax), alone and beside data and Megatron axes; the compiled
step's collective-permutes carry the bytes the plan predicts, no all-gather of the
layer stack remains, and each device holds 1/S of the stack. The pipeline is planned
without jax and runs from its plan (lowering/emit.py). One compile per layout."""

import functools
import shutil

import jax
import numpy as np
import pytest

import namedmesh as nm
from lowering import Layout, Mesh, lower
from lowering.hlo import collectives
from lowering.pipeline import default_microbatches, plan_pipeline
from models import catalog, transformer
from namedmesh.errors import LayoutError, PipelineError

CFG = catalog.get("tiny").replace(
    layers=8, d_model=16, heads=2, d_kv=8, d_ff=32, vocab=32, length=4, batch=8
)
SHAPES = transformer.lm_shapes(CFG)
PARAMS = transformer.init(SHAPES, 0)
R = np.random.default_rng(0)
TOKENS = R.integers(0, CFG.vocab, size=(CFG.batch, CFG.length + 1)).astype(np.int32)
BATCH = {
    "inputs": nm.tensor(TOKENS[:, :-1], ("batch", "length")),
    "targets": nm.tensor(TOKENS[:, 1:], ("batch", "length")),
    "weights": nm.tensor(np.ones((CFG.batch, CFG.length), np.float32), ("batch", "length")),
}
STACK_BYTES = sum(t.nbytes for t in jax.tree_util.tree_leaves(PARAMS["layers"]))
MEGATRON = "layers:stage;batch:data;heads:model;d_ff:model"
CASES = {  # name: (mesh, layout, microbatches, batch per device)
    "stage=2,M=4": ({"stage": 2}, "layers:stage;microbatches=4", 4, 8),
    "stage=2,data=2,model=2": ({"stage": 2, "data": 2, "model": 2}, MEGATRON, 4, 4),  # M default
    "stage=4,data=2": ({"stage": 4, "data": 2}, "layers:stage;batch:data;microbatches=4", 4, 4),
    "stage=8": ({"stage": 8}, "layers:stage;microbatches=8", 8, 8),  # one layer per stage
    # the circular schedule: 2 rounds of 2 layers per stage (its all_to_all: below)
    "stage=2,circular": ({"stage": 2}, "layers:stage;schedule=circular;microbatches=4", 4, 8),
}


def loss(params, batch):
    return transformer.lm_loss(params, batch, CFG)


@functools.cache
def one_device():
    """The oracle: the model's loss and gradients as jax computes them, unlowered."""
    value, grads = jax.jit(jax.value_and_grad(lambda p: loss(p, BATCH).data))(PARAMS)
    return float(value), grads


@functools.cache
def compiled(case: str):
    """(lowered, compiled training step, its loss and gradients) under `case`."""
    mesh, layout, _, _ = CASES[case]
    lowered = lower(loss, Mesh(mesh), layout, check=True)  # emitted, checked against its plan
    step = jax.jit(jax.value_and_grad(lambda p: lowered(p, BATCH).data))
    exe = step.lower(PARAMS).compile()
    value, grads = exe(PARAMS)
    return lowered, exe, float(value), grads


@pytest.mark.parametrize("layout", list(CASES))
def test_loss_and_gradients_equal_one_device(layout):
    want_loss, want_grads = one_device()
    _, _, got_loss, got_grads = compiled(layout)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    got, want = jax.tree_util.tree_leaves(got_grads), jax.tree_util.tree_leaves(want_grads)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", list(CASES))
def test_hlo_permutes_carry_the_planned_bytes_and_no_stack_is_gathered(layout):
    _, _, m, per_device = CASES[layout]
    lowered, exe, _, _ = compiled(layout)
    hlo = collectives(exe.as_text())
    # one microbatch of the activations (batch, length, d_model) in float32, counted by
    # hand; the forward loop sends it to the next stage, the backward one to the last
    microbatch = per_device // m * CFG.length * CFG.d_model * 4
    (plan,) = lowered.report(PARAMS, BATCH, show=False).pipelines
    assert plan.microbatches == m and plan.microbatch_bytes == microbatch
    permutes = [b for kind, b, _ in hlo if kind == "collective-permute"]
    assert permutes == [microbatch, microbatch]
    # nothing as large as one layer's share of a stacked parameter is gathered
    layer = min(t.nbytes // CFG.layers for t in jax.tree_util.tree_leaves(PARAMS["layers"]))
    gathered = [b for kind, b, _ in hlo if kind == "all-gather"]
    assert all(b < layer for b in gathered), gathered


def test_each_device_holds_its_stage_of_the_stack():
    layout, stages = "stage=2,M=4", 2
    _, exe, _, _ = compiled(layout)
    whole = sum(t.nbytes for t in jax.tree_util.tree_leaves(PARAMS))
    args = exe.memory_analysis().argument_size_in_bytes
    assert args == whole - STACK_BYTES + STACK_BYTES // stages
    lowered = compiled(layout)[0]
    (plan,) = lowered.report(PARAMS, BATCH, show=False).pipelines
    assert plan.parameter_bytes == STACK_BYTES // stages


def test_the_plan_states_the_gpipe_schedule():
    """Bubble (S-1)/(M+S-1) and the bytes of M+S-1 ticks, in plain Python."""
    p = plan_pipeline(axes=("stage",), stages=4, length=8, dim="batch", local_size=16,
                      mixing=None, requested=None, carry_bytes=1600, stack_bytes=800)  # fmt: skip
    assert (p.microbatches, p.ticks, p.layers_per_stage) == (16, 19, 2)
    assert p.bubble == pytest.approx(3 / 19)
    assert p.forward_bytes == 19 * 100 + 2 * 3 / 4 * 1600
    assert p.minimum_bytes == 1600 and p.parameter_bytes == 200
    assert default_microbatches(2, 6) == 6 and default_microbatches(2, 12) == 6
    assert default_microbatches(3, 7) == 7 and default_microbatches(1, 7) == 1
    assert "bubble 15.8%" in str(p)


def test_microbatches_are_set_in_the_layout():
    layout = Layout("layers:stage;batch:data;microbatches=8")
    assert layout.options == {"microbatches": 8}
    assert str(layout) == "layers:stage;batch:data;microbatches=8"
    assert Layout("layers:stage", options={"microbatches": 8}) == layout.__class__(
        "layers:stage;microbatches=8"
    )
    for bad in ("layers:stage;microbatches=0", "layers:stage;micro=2", "a:b;microbatch_dim=1"):
        with pytest.raises(LayoutError, match="option"):
            Layout(bad)
    with pytest.raises(LayoutError, match="did you mean 'microbatches'"):
        Layout("layers:stage;microbatch=4")


def _layer(h, w):
    return nm.einsum(h, w, out=("batch", "e")).rename(e="d")


def _scan(x, w):
    return nm.scan(lambda h, w: (nm.tanh(_layer(h, w)), None), x, w, "layers")


X = nm.tensor(np.ones((4, 3), np.float32), ("batch", "d"))
W = nm.tensor(np.ones((6, 3, 3), np.float32), ("layers", "d", "e"))


def test_errors_name_the_scan_and_the_rule():
    # (6 layers on 4 stages, and 3, run padded: test_pipeline_uneven.py)
    mesh = Mesh({"stage": 2})
    with pytest.raises(PipelineError, match="local size 4 .* not divisible by microbatches=3"):
        lower(_scan, mesh, "layers:stage;microbatches=3").plan(X, W)
    with pytest.raises(PipelineError, match="'tokens', which a carry tensor lacks"):
        lower(_scan, mesh, "layers:stage;microbatches=2;microbatch_dim=tokens").plan(X, W)

    def mixing(x, w):  # a softmax along the batch: microbatches would change it
        return nm.scan(lambda h, w: (nm.softmax(_layer(h, w), "batch"), None), x, w, "layers")

    with pytest.raises(PipelineError, match="softmax .* acts along it"):
        lower(mixing, mesh, "layers:stage;microbatches=2").plan(X, W)
    # by default such a body runs with one microbatch, and equals the loop
    got, want = lower(mixing, mesh, "layers:stage")(X, W)[0], mixing(X, W)[0]
    np.testing.assert_allclose(np.asarray(got.data), np.asarray(want.data), rtol=1e-5)


def test_the_cli_trains_a_pipeline_and_its_checkpoint_resumes_without_one(tmp_path, capsys):
    """`--mesh stage=4,data=2 --layout "layers:stage;batch:data"` trains; its step-2
    checkpoint resumed data-parallel logs the pipelined run's later losses. In process:
    main() as `python -m` runs it (test_train_cli runs the command line)."""
    from test_train_cli import SMALL, losses

    from models.cli.train import main

    tiny = [*SMALL, "--set", "layers=4", "--steps", "4", "--save-every", "2", "--eval-every", "4"]
    out = tmp_path / "run"
    assert main([*tiny, "--mesh", "stage=4,data=2", "--layout", "layers:stage;batch:data",
                 "--out", str(out)]) == 0  # fmt: skip
    stdout = capsys.readouterr().out
    assert "pipeline (gpipe) over stage: 4 stages" in stdout and "bubble" in stdout
    shutil.copytree(out, tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
    assert main([*tiny, "--mesh", "data=2", "--layout", "batch:data", "--resume",
                 "--out", str(tmp_path / "resumed")]) == 0  # fmt: skip
    assert "resumed from step 2" in capsys.readouterr().out
    want, got = losses(out), losses(tmp_path / "resumed")
    assert list(got) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-4)


def test_the_plan_lists_the_compiled_collectives_ys_included():
    """The plan/HLO contract on a pipelined scan whose body also returns per-layer ys
    (which stay on their stage), beside a data axis."""
    from test_scan import ARGS, MESH, WANT, scanned

    from lowering.cost import expected_hlo

    lowered = lower(scanned, MESH, "layers:rows;batch:cols")
    hlo = lowered.compile(*ARGS).as_text()
    assert sorted(collectives(hlo)) == sorted(expected_hlo(lowered.plan(*ARGS), MESH.sizes))
    assert "ppermute over rows" in str(lowered.plan(*ARGS))
    h, ys = lowered(*ARGS)
    np.testing.assert_allclose(np.asarray(ys.data), WANT[1], rtol=1e-4, atol=1e-5)
    assert ys.data.sharding.spec[0] == "rows"  # each stage's layers' ys stay on it


def _stack_loss(x, w):
    def layer(h, w):
        return h + nm.tanh(nm.einsum(h, w, out="batch d_out")).rename(d_out="d_model"), None

    return (nm.scan(layer, x, w, "layers")[0] ** 2).mean()


def test_auto_layout_picks_a_stage_split_where_data_parallelism_does_not_fit():
    """A pipelined candidate's training memory is its plan's: each device keeps its L/S
    layers' activations for M+S-1 ticks of one microbatch (PipelinePlan.
    activation_share), not the whole stack's. d_model = 30 leaves batch and layers as
    the splits of a 4-device axis; under a limit that data parallelism exceeds, a stage
    split is chosen, and its estimate is near the compiled step's memory."""
    from lowering.search import auto_layout

    x = nm.tensor(R.normal(size=(64, 30)).astype(np.float32), "batch d_model")
    w = nm.tensor(R.normal(size=(8, 30, 30)).astype(np.float32), "layers d_model d_out")
    mesh = Mesh({"x": 4})
    # data parallelism's step: 113,284 bytes since the step's peak is the larger of its
    # backward pass and its update (lowering/train_step.py), the stage split's 107,524
    limit = 110_000
    layout, table = auto_layout(_stack_loss, mesh, x, w, grad_argnums=1, rates="tpu_v3",
                                memory_limit=limit)  # fmt: skip
    assert "layers" in dict(layout.rules), table
    data = next(c for c in table if str(c.layout) == "batch:x")
    assert data.note == "over the memory limit" and data.memory > limit
    lowered = lower(_stack_loss, mesh, "layers:x")
    estimate = lowered.report(x, w, wrt=1, show=False).peak_memory
    step = jax.jit(jax.grad(lambda w: lowered(x, w).data)).lower(w).compile()
    m = step.memory_analysis()
    compiled = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    assert abs(estimate - compiled) <= 0.2 * compiled, (estimate, compiled)


def test_the_circular_schedule_equals_one_device_with_a_smaller_bubble():
    """`schedule=circular`: each stage holds R chunks of layers (chunk r of stage s is the
    stack's r*S + s), a microbatch passes the stages R times; bubble (S-1)/(R*M+S-1)
    against GPipe's (S-1)/(M+S-1). Values and gradients against jax on one device, the
    plan's collectives against the compiled HLO (the deal's all_to_all included)."""
    from lowering.cost import expected_hlo

    x = nm.tensor(R.normal(size=(16, 8)).astype(np.float32), "batch d_model")
    w = nm.tensor((0.3 * R.normal(size=(8, 8, 8))).astype(np.float32), "layers d_model d_out")
    mesh = Mesh({"stage": 2, "data": 2})
    lowered = lower(_stack_loss, mesh, "layers:stage;batch:data;schedule=circular;microbatches=4")
    got = jax.jit(jax.value_and_grad(lambda x, w: lowered(x, w).data, (0, 1)))(x, w)
    want = jax.jit(jax.value_and_grad(lambda x, w: _stack_loss(x, w).data, (0, 1)))(x, w)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for g, v in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(np.asarray(g.data), np.asarray(v.data), rtol=1e-5, atol=1e-6)
    (plan,) = lowered.report(x, w, wrt=1, show=False).pipelines
    assert (plan.schedule, plan.repeats, plan.layers_per_tick, plan.ticks) == ("circular", 2, 2, 9)
    assert plan.bubble == pytest.approx(1 / 9)  # GPipe's with these M and S: 1/5
    hlo = lowered.compile(x, w).as_text()
    assert sorted(collectives(hlo)) == sorted(expected_hlo(lowered.plan(x, w), mesh.sizes))
    assert "all-to-all" in hlo
    with pytest.raises(PipelineError, match="at least 2 microbatches"):
        lower(_stack_loss, mesh, "layers:stage;schedule=circular;microbatches=1").plan(x, w)
    with pytest.raises(PipelineError, match="repeats=3 must be a multiple"):
        lower(_stack_loss, mesh, "layers:stage;schedule=circular;repeats=3").plan(x, w)
    with pytest.raises(PipelineError, match="schedule='zigzag' is not gpipe or circular"):
        lower(_stack_loss, mesh, "layers:stage;schedule=zigzag").plan(x, w)

    def with_ys(x, w):
        layer = lambda h, w: (h + nm.einsum(h, w, out="batch d_out").rename(d_out="d_model"), h)
        return nm.scan(layer, x, w, "layers")[1]

    with pytest.raises(PipelineError, match="keeps no per-iteration results"):
        lower(with_ys, mesh, "layers:stage;schedule=circular").plan(x, w)
