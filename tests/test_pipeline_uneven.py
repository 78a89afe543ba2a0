"""Uneven pipeline stages (issue 37): a `layers:stage` layout whose S stages do not divide
the L layers pads the stack (namedmesh/uneven.py) and runs as on one device: a scan's
per-layer results (ys) and final carry against NumPy, fewer layers than stages too; a
stack padded ahead (a PaddedStack) held 1/S per device with no stage all-reduce of its
gradients; DeepSeek-V3's shape in small (a dense stack shorter than the stages, then MoE
layers in 2 microbatches) against the model run by jax unlowered, microbatch by
microbatch. (The trainer on uneven stages, padded, against one device and across a
checkpoint: test_pipeline_checkpoint.py; the CLI's pipeline flags: test_pipeline.py.)"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, lower
from lowering.distributed import place
from lowering.hlo import collectives
from lowering.stages import StagedChoice, assign_stages
from models import transformer, zoo
from namedmesh.chain import chain_deal
from namedmesh.uneven import PaddedStack, pad_like, pad_stacks, unpad_stacks
from tests.test_pipeline import BATCH, CFG


def grads_of(loss, params, batch):
    value, grads = jax.jit(jax.value_and_grad(lambda p: loss(p, batch).data))(params)
    return float(value), jax.tree_util.tree_leaves(grads)


def assert_same(got, want, rtol=1e-5):
    assert len(got[1]) == len(want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=rtol)
    for g, w in zip(got[1], want[1], strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.abs(w).max())


def _layers_program(w, x):
    """A scan over 'layers' with per-layer results: (final carry, ys)."""

    def body(c, wl):
        c = nm.tanh(c * wl) + c
        return c, (c * c).sum("d")

    return nm.scan(body, x, w, "layers")


def _numpy_layers(w, x):
    ys = []
    for wl in w:
        x = np.tanh(x * wl) + x
        ys.append((x * x).sum(-1))
    return x, np.stack(ys)


@pytest.mark.parametrize("layers", [7, 3])  # 3 on 4 stages: the last stage all pads
def test_per_layer_results_and_carry_equal_numpy(layers):
    r = np.random.default_rng(3)
    w, x = r.normal(size=(layers, 3)), r.normal(size=(8, 3))
    wt, xt = (
        nm.tensor(w.astype(np.float32), ("layers", "d")),
        nm.tensor(x.astype(np.float32), ("batch", "d")),
    )
    lowered = lower(_layers_program, Mesh({"stage": 4}), "layers:stage;microbatches=2")
    carry, ys = lowered(wt, xt)
    want_carry, want_ys = _numpy_layers(w, x)
    assert ys.dims == ("layers", "batch") and ys.shape == (layers, 8)
    np.testing.assert_allclose(np.asarray(carry.data), want_carry, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ys.data), want_ys, rtol=1e-5, atol=1e-5)


def _layers_loss(params, batch):
    carry, ys = _layers_program(params["w"], batch)
    return (carry * carry).sum() + ys.sum()


def _cast_loss(params, batch):
    """`_layers_loss` with the stack cast first, as a model casts its parameters to its
    compute dtype: the scan reads a conversion of the stack, not the stack."""
    return _layers_loss({"w": nm.astype(params["w"], jnp.bfloat16)}, batch)


def branch_ops(hlo: str, opcode: str) -> tuple[int, int]:
    """(inside, outside): the `opcode` instructions of the compiled `hlo` in computations
    that a conditional's branch runs (itself, or what it calls), and the others."""
    comps, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%(\S+) .*\{$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            comps[name] = []
        elif name:
            comps[name].append(line)
    calls = lambda text: re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", text)
    todo = [b.strip().lstrip("%") for group in re.findall(r"branch_computations=\{([^}]*)\}", hlo)
            for b in group.split(",")]  # fmt: skip
    branch: set = set()
    while todo:
        c = todo.pop()
        if c not in branch:
            branch.add(c)
            todo += [d for line in comps.get(c, ()) for d in calls(line)]
    count = lambda names: sum(f" {opcode}(" in line for n in names for line in comps[n])
    return count(branch & comps.keys()), count(comps.keys() - branch)


def test_7_layers_padded_on_4_stages_beside_data_stay_on_their_stages():
    """A PaddedStack (pad_stacks) splits over the stages: each device holds its stage's
    2 of the 8 padded layers (the L-long stack would be whole on each), no all-reduce of
    the stack's gradient over `stage` remains in the compiled step (only over `data`),
    also where the program casts the stack before its scan, and the gradients' 7 real
    layers are those of one device, the pad's exactly zero. The pad is skipped, not
    computed: XLA's compiled step runs the layer's tanh only in a conditional's branch,
    and has conditionals in the backward pass too (the stage loop's transpose)."""
    r = np.random.default_rng(4)
    d = 64  # the stack (7 x 64 floats) outweighs the carry (2 rows a device)
    params = {"w": nm.tensor(r.normal(size=(7, d)).astype(np.float32), ("layers", "d"))}
    x = nm.tensor(r.normal(size=(4, d)).astype(np.float32), ("batch", "d"))
    mesh = Mesh({"stage": 4, "data": 2})
    lowered = lower(_cast_loss, mesh, "layers:stage;batch:data;microbatches=2", check=True)
    padded = place(pad_stacks(params, lowered.stage_sizes), mesh, lowered.layout)
    step = jax.jit(jax.value_and_grad(lambda p: lowered(p, x).data)).lower(padded).compile()
    layer = d * 4
    assert step.memory_analysis().argument_size_in_bytes == 2 * layer  # (x is a constant)
    stage_reduces = [n for kind, n, group in collectives(step.as_text())
                     if kind == "all-reduce" and group == 4]  # fmt: skip
    assert sum(stage_reduces) < 3 * layer  # the carry's and ys' psums alone, no stack
    assert branch_ops(step.as_text(), "tanh") == (1, 0)  # the layer's tanh: only if real
    conds = [line for line in step.as_text().splitlines() if " conditional(" in line]
    assert any("transpose(" in line for line in conds) and len(conds) >= 2
    value, grads = step(padded)
    assert isinstance(grads["w"], PaddedStack) and grads["w"].tensor.shape == (8, d)
    real = grads["w"].positions()[1]
    assert not np.asarray(grads["w"].tensor.data)[~real].any()  # the pad's: exactly zero
    got = (float(value), jax.tree_util.tree_leaves(unpad_stacks(grads)))
    assert_same(got, grads_of(_cast_loss, params, x), rtol=2e-2)  # bfloat16 gradients


def test_a_dense_stack_then_moe_microbatches_run_as_one_pipeline():
    """DeepSeek-V3's shape in small: 1 dense layer, then a stack of 3 MoE layers, on 2
    stages with 2 microbatches, the parameters padded by the chain (pad_stacks' `chain`):
    ONE pipeline (nm.scan_chain) whose stage 0 runs the dense layer then MoE layer 0 and
    stage 1 MoE layers 1-2, the planner's deal, so one bubble (M + S - 1 ticks). Each
    stage device holds only its slots of each stack (1 dense, 2 MoE: not the 3 MoE of
    the whole stack) and no stack's gradient is all-reduced over `stage`. Loss and
    gradients: the unlowered model run microbatch by microbatch, averaged (each
    microbatch routes on its own)."""
    from test_pipeline_compositions import _by_microbatch

    cfg = CFG.replace(layers=4, batch=4, scan_layers=True)  # loops: they compile faster
    cfg = zoo.get("moe").configure(cfg).replace(dense_layers=1)
    params = transformer.init(transformer.lm_shapes(cfg), 0)
    batch = {k: nm.tensor(np.asarray(v.data)[:4], v.dims) for k, v in BATCH.items()}
    loss = functools.partial(transformer.lm_loss, cfg=cfg)
    mesh = Mesh({"stage": 2})
    lowered = lower(loss, mesh, "layers:stage;microbatches=2")
    padded = place(pad_stacks(params, lowered.stage_sizes, chain=transformer.CHAIN), mesh,
                   lowered.layout)  # fmt: skip
    lengths, slots = {"dense": 1, "layers": 3}, {"dense": 1, "layers": 2}
    # slots: the most layers of each stack the planner deals a stage (stage 0: 1+1, 1: 0+2)
    assert [max(c) for c in zip(*assign_stages([1, 3], 2), strict=True)] == [1, 2]
    step = jax.jit(jax.value_and_grad(lambda p: lowered(p, batch).data)).lower(padded).compile()
    held = {k: sum(np.asarray(t.data).nbytes for t in _leaves(v)) for k, v in params.items()}
    layer = {k: held[k] // n for k, n in lengths.items()}
    want = sum(held.values()) + sum(layer[k] * (slots[k] - n) for k, n in lengths.items())
    assert step.memory_analysis().argument_size_in_bytes == want  # (the batch is a constant)
    stage_reduces = [n for kind, n, group in collectives(step.as_text())
                     if kind == "all-reduce" and group == 2]  # fmt: skip
    assert sum(stage_reduces) < layer["dense"]  # the carry's and the loss's psums, no stack
    value, grads = step(padded)
    want_value, want_grads = _by_microbatch(loss, params, batch, 2)
    got = (float(value), jax.tree_util.tree_leaves(unpad_stacks(grads)))
    assert_same(got, (float(want_value), jax.tree_util.tree_leaves(want_grads)))
    (plan,) = lowered.report(padded, batch, show=False).pipelines  # one pipeline
    assert (plan.stages, plan.microbatches, plan.ticks) == (2, 2, 3)
    assert list(plan.deal.counts) == assign_stages([1, 3], 2)  # stage 0: 1+1, stage 1: 0+2
    # named as `namedmesh plan` names the stacks (transformer.stack_names); pads skipped
    assert "stage 0: layers 0-1 (1 dense + 1 MoE) + 1 pad" in str(plan)
    assert (
        "pads skipped (a cond per slot, no layer work): 33.3% of the layer slots; the "
        "stages of fewer layers idle 0.0% of the layer time" in str(plan)
    )


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, nm.Tensor))


@pytest.mark.parametrize("layers,stages", [(5, 2), (7, 4), (61, 16), (9, 3), (10, 4)])
def test_the_deal_is_the_planners(layers, stages):
    """The runtime's stages hold the layers the planner deals them (lowering/stages.py),
    one stack and a chain of stacks (nm.scan_chain: DeepSeek-V3's 3 dense + 58 MoE)."""
    for stacks in ([layers], [3, layers + 55], [1, layers], [layers, 2, 1]):
        assert chain_deal(stacks, stages) == assign_stages(stacks, stages)


@pytest.mark.parametrize("stacks,stages", [([3, 58], 16), ([1, 3], 2), ([7, 2, 1], 4)])
def test_a_chain_is_padded_as_the_planner_deals_it(stacks, stages):
    """pad_stacks' `chain`: stack i is S blocks of K_i layers (K_i the most the planner
    deals a stage), block s its dealt layers in order then pads (flagged not real);
    unpad_stacks and pad_like (a checkpoint's L-long view and back) are inverses."""
    deal_ = assign_stages(stacks, stages)
    keys = [f"s{i}" for i in range(len(stacks))]
    first = np.cumsum([0, *stacks])
    layer = lambda a, n: jnp.tile(jnp.arange(a, a + n, dtype=jnp.float32)[:, None], (1, 2))
    tree = {k: nm.tensor(layer(a, n), ("layers", "d"))  # layer j holds j
            for k, a, n in zip(keys, first[:-1], stacks, strict=True)}  # fmt: skip
    held = pad_stacks({"other": tree["s0"], "chain": tree}, {"layers": stages}, chain=keys)
    assert isinstance(held["other"], PaddedStack) == bool(stacks[0] % stages)  # not chained
    at = 0  # the next layer the planner deals, the stacks in order
    blocks = {k: np.asarray(held["chain"][k].tensor.data)[:, 0] for k in keys}
    for s, counts in enumerate(deal_):
        for k, n, i in zip(keys, counts, range(len(keys)), strict=True):
            slots = max(c[i] for c in deal_)
            block = blocks[k].reshape(stages, slots)[s]
            assert list(block[:n]) == list(range(at, at + n))
            real = held["chain"][k].positions()[1].reshape(stages, slots)[s]
            assert list(real) == [j < n for j in range(slots)]
            at += n
    back = unpad_stacks(held)["chain"]
    assert all(np.array_equal(back[k].data, tree[k].data) for k in keys)
    again = pad_like(back, held["chain"])
    assert all(np.array_equal(again[k].tensor.data, held["chain"][k].tensor.data) for k in keys)


RUNS = "runs as a layers:stage layout (lowering.pipeline)"


@pytest.mark.parametrize(
    "stacks,stages,moe,said,pads",
    [  # pads: (the share of slots that are pads, skipped; the stages' idle share, the
        # plan's), counted by hand
        ([61], 16, False, f"{RUNS}, 4 layer slots a stage", (3 / 64, 3 / 64)),
        ([16], 4, False, RUNS, (0, 0)),
        # DeepSeek-V3: stage 0 runs 3 dense + 1 MoE, every stage 3 dense + 4 MoE slots
        ([3, 58], 16, True, f"{RUNS}, one pipeline over the 2 stacks", (1 - 61 / 112, 3 / 64)),
        ([16], 4, True, f"{RUNS}, each microbatch", (0, 0)),
    ],
)
def test_the_planner_says_what_the_runtime_runs(stacks, stages, moe, said, pads):
    deal_ = assign_stages(stacks, stages)
    uneven = any(n % stages for n in stacks)
    choice = StagedChoice(None, None, deal_, [], 0.0, None, 0.0, 0.0, uneven, moe)
    assert choice.runtime.startswith(said)
    assert choice.runtime.endswith("averaged)") == moe
    got = (choice.runtime_deal.pad_share, choice.planned_deal.pad_share)
    np.testing.assert_allclose(got, pads, atol=1e-12)
    np.testing.assert_allclose(choice.runtime_deal.idle_share, pads[1], atol=1e-12)
    said = (
        f"the pads skipped (no layer work: {pads[0]:.1%} of the slots; the stages idle "
        f"{pads[1]:.1%} of the layer time, as the plan charges)"
    )
    assert (said in choice.runtime) == bool(pads[0])
    if stacks == [3, 58]:
        assert choice.stages_text(["dense", "MoE"]) == (
            "stage 0: layers 0-3 (3 dense + 1 MoE); stages 1-12: layers 4-51, 4 layers each "
            "(4 MoE); stages 13-15: layers 52-60, 3 layers each (3 MoE) + 1 pad each"
        )


def test_the_joint_search_weighs_an_uneven_stage_split():
    """3 layers on 2 stages: the search's divisibility never proposes `layers:stage`, the
    joint search adds it (padded: 2 stages x 2 slots), costed with its pad: at least the
    compute of 4 real layers split evenly over the stages."""
    from lowering.joint import Settings, joint_search
    from lowering.rates import parse
    from lowering.search import cost_layout

    r = np.random.default_rng(5)
    x = nm.tensor(r.normal(size=(8, 16)).astype(np.float32), ("batch", "d"))
    stack = lambda n: {"w": nm.tensor(r.normal(size=(n, 16)).astype(np.float32), ("layers", "d"))}
    mesh = Mesh({"stage": 2, "data": 2}, devices="abstract")
    rates = parse("h100")
    joint = joint_search(lambda s: (_layers_loss, (stack(3), x)), [mesh], rates, [Settings()],
                         memory_limit=2**30)  # fmt: skip
    (piped,) = [c for c in joint.choices if ("layers", ("stage",)) in c.layout.rules]
    (plan,) = piped.candidate.pipelines
    assert (plan.stages, plan.length) == (2, 4) and plan.deal.pads(1) == 1
    even = cost_layout(_layers_loss, mesh, stack(4), x, layout=piped.layout, grad_argnums=(0,),
                       rates=rates)  # fmt: skip
    # the pad costs a layer (the masking's selects a little more at this tiny width)
    assert even.compute <= piped.candidate.compute <= 1.25 * even.compute


def _nested(feeds_carry: bool):
    """A scan over 'layers' whose body scans 'sub', each sub-iteration's result a mean
    over the batch (a MoE layer's balancing loss, as in a scan_chain stage)."""

    def program(x, w):
        def outer(h, wl):
            inner = lambda c, ws: (nm.tanh(c * ws), (c * c).mean("batch"))
            h, ys = nm.scan(inner, h, wl, "sub")
            return (h + ys.sum(), None) if feeds_carry else (h, ys.sum())

        return nm.scan(outer, x, w, "layers")

    return program


def test_a_nested_result_made_along_the_batch_is_averaged_not_fed_to_the_carry():
    """Microbatches may run a body whose inner scan makes a result along the batch only
    where the pipeline averages it as its own result; fed to the carry, it mixes them."""
    x = nm.tensor(np.ones((4, 3), np.float32), ("batch", "d"))
    w = nm.tensor(np.ones((2, 2, 3), np.float32), ("layers", "sub", "d"))
    mesh, layout = Mesh({"stage": 2}), "layers:stage;microbatches=2"
    (plan,) = lower(_nested(False), mesh, layout).report(x, w, show=False).pipelines
    assert (plan.microbatches, plan.averaged) == (2, 1)
    with pytest.raises(nm.PipelineError, match="reads a result made along it"):
        lower(_nested(True), mesh, layout).plan(x, w)


def test_auto_layout_with_uneven_stages_picks_the_padded_split_where_nothing_else_fits():
    """`train --layout auto`'s choice (lowering.joint.with_uneven_stages): 7 layers on a
    4-stage axis, which the search's divisibility never splits; under a limit that data
    parallelism exceeds (read from the search's own estimates, so the test follows
    the memory model; 16 rows, so that the weights, which the split deals out, are most of
    data parallelism's memory: at 64 rows the padded split's full-batch activations
    outweigh them under the step-memory model of 2026-12-06, 107,562 bytes against data
    parallelism's 100,324), the
    search finds nothing and the uneven `layers:stage` split,
    costed padded as the trainer runs it, is chosen (such a split trains as one device:
    test_7_layers_padded_on_4_stages_beside_data_stay_on_their_stages); with no limit,
    the search's choice stays. Planning only: nothing compiles."""
    from lowering.joint import with_uneven_stages
    from lowering.search import auto_layout
    from tests.test_pipeline import _stack_loss

    r = np.random.default_rng(6)
    x = nm.tensor(r.normal(size=(16, 30)).astype(np.float32), "batch d_model")
    w = {"w": nm.tensor(r.normal(size=(7, 30, 30)).astype(np.float32), "layers d_model d_out")}
    loss = lambda p, b: _stack_loss(b, p["w"])  # noqa: E731 (parameters first, as a model's)
    mesh = Mesh({"stage": 4})
    search = lambda **limit: auto_layout(loss, mesh, w, x, grad_argnums=0, rates="tpu_v3", **limit)  # noqa: E731
    with pytest.raises(nm.LayoutError) as nothing:  # the searched layouts' least memory
        search(memory_limit=1)
    limit = min(c.memory for c in nothing.value.search) - 1  # just under data parallelism's
    with pytest.raises(nm.LayoutError) as refused:
        search(memory_limit=limit)
    layout, best = with_uneven_stages(loss, mesh, (w, x), refused.value)
    assert str(layout) == "layers:stage" and best.memory <= limit < refused.value.search[0].memory
    (plan,) = best.pipelines
    assert (plan.stages, plan.length, plan.deal.pads(3)) == (4, 8, 1)  # 2, 2, 2, 1 layers
    found = search()
    assert with_uneven_stages(loss, mesh, (w, x), found)[0] is found[0]  # data parallel wins
