"""The planner: a Plan made in plain Python, without jax, and the emitter that runs it,
its check mode (`Lowered.check`: every value the emitted program makes held to the
plan's Local, its shape, dtype and varying mesh axes) the oracle, beside NumPy's
values. The compiled HLO's collectives against the plan's are property 3 of
property_tests/test_lowering_props.py."""

import math

import jax
import jax.extend.core
import numpy as np
import pytest

import namedmesh as nm
from lowering import Layout, Mesh, PlanMismatch, caches, lower
from lowering.lower import argument_inputs, graph_report
from models import catalog, transformer
from models.training import objectives

MESH = Mesh({"rows": 2, "cols": 4})
ABSTRACT = Mesh({"rows": 2, "cols": 4}, devices="abstract")


def assert_checked(fn, layout, *args):
    """The program emitted from the Planner's plan, traced on the 2x4 mesh with the check
    on (PlanMismatch at the first value that is not the plan's); the plan is the one
    the abstract mesh, which has no devices, gets."""
    plan = lower(fn, MESH, layout).check(*args)
    assert lower(fn, ABSTRACT, layout).plan(*args).format(casts=True) == plan.format(casts=True)


def lm(name: str, **kw):
    cfg = catalog.get(name, **kw)
    params = transformer.abstract(transformer.lm_shapes(cfg))
    batch = objectives.abstract_batch("lm", cfg.batch, cfg.length)
    return (lambda p, b: transformer.lm_loss(p, b, cfg)), (params, batch)


@pytest.mark.parametrize(
    "layout",
    [
        "batch:rows;heads:cols;d_ff:cols;vocab:cols",  # Megatron beside data parallelism
        "batch:rows,cols",
        "batch:rows;d_model:cols",  # FSDP-style
        "batch:cols;length:rows",  # sequence split: attention gathers the keys
        "vocab:rows,cols;length:cols",  # vocab-parallel embedding lookup (gather + psum)
    ],
)
def test_zoo_lm_training_plan_checks_against_the_emitted_program(layout):
    loss, inputs = lm("tiny")
    assert_checked(loss, layout, *inputs)


def mlp(x, w1, w2):
    return (nm.einsum(nm.relu(nm.einsum(x, w1, out="batch d_ff")), w2, out="batch d") ** 2).mean()


def mlp_inputs():
    rng = np.random.default_rng(0)
    f = lambda dims, *shape: nm.tensor(rng.normal(size=shape).astype(np.float32), dims)
    return f("batch d", 16, 8), f("d d_ff", 8, 32), f("d_ff d", 32, 8)


@pytest.mark.parametrize("layout", ["batch:rows;d_ff:cols", "d:cols;d_ff:cols", "batch:rows,cols"])
def test_mlp_plan_checks_against_the_emitted_program_and_runs_it(layout):
    args = mlp_inputs()
    assert_checked(mlp, layout, *args)
    got = lower(mlp, MESH, layout)(*args)
    np.testing.assert_allclose(got.data, mlp(*args).data, rtol=1e-5)


def test_the_check_names_the_instruction_that_differs_from_the_plan():
    """The emitter's check mode holds each value it makes to its Local: a plan whose psum
    result is said to vary still, or whose local op's result has another dtype, fails
    naming the step and instruction, before anything compiles."""
    args = mlp_inputs()
    lowered = lower(mlp, MESH, "batch:rows;d_ff:cols")
    plan = lowered.check(*args)  # the plan as made passes
    step = next(s for s in plan.program if any(i.op == "psum" for i in s.ops))
    k, psum = next((k, i) for k, i in enumerate(step.ops) if i.op == "psum")
    psum.outs[0].vma = frozenset(MESH.sizes)
    with pytest.raises(PlanMismatch, match=rf"step 'einsum', instruction {k} \(psum\), value 0: "
                       r"jax made float32\[8, 8\] varying over \['rows'\]"):  # fmt: skip
        lowered.check(*args)
    psum.outs[0].vma = frozenset({"rows"})
    lowered.check(*args)
    relu = next(s for s in plan.program if s.name == "relu")
    relu.ops[-1].outs[0].dtype = np.dtype(np.float16)
    with pytest.raises(PlanMismatch, match=r"step 'relu', .*\(local relu\).*the plan says float16"):
        lowered.check(*args)


def ops(x, i):
    """The structural, reduction and lookup rules the planner ports, in one program."""
    y = nm.softmax(x, "v") + nm.log_softmax(x, "v")
    outs = [nm.logsumexp(x, "v"), x.max("v"), x.min("b"), x.mean("v"), (x > 0).any("v")]
    outs += [nm.one_hot(i, "v", 8).astype(np.float32) * y, nm.gather(x, "v", i)]
    r = nm.reshape(y, {"v_hi": 2, "v_lo": 4}, from_="v")
    outs += [nm.concat([x, y], "v"), nm.slice(x, "v", 1, 5).sum("v"), nm.pad(x, {"v": (1, 7)})]
    outs += [nm.stack([x, y], "s"), nm.expand_dims(x, {"e": 2}), nm.transpose(r, "v_lo b v_hi")]
    outs += [nm.arange("v", 8) + x, nm.where(x > 0, x, nm.zeros({"v": 8}))]
    return outs


@pytest.mark.parametrize("layout", ["v:cols", "b:rows;v:cols", "v:rows,cols", "b:cols"])
def test_each_rule_is_emitted_as_planned_and_runs_correctly(layout):
    rng = np.random.default_rng(1)
    x = nm.tensor(rng.normal(size=(4, 8)).astype(np.float32), "b v")
    i = nm.tensor(rng.integers(-8, 8, size=(4,)).astype(np.int32), "b")
    assert_checked(ops, layout, x, i)
    got = lower(ops, MESH, layout)(x, i)
    for g, w in zip(got, ops(x, i), strict=True):
        np.testing.assert_allclose(g.data, w.data, rtol=1e-5, atol=1e-6)


def more_ops(x, key):
    """The rules with their own arithmetic and halos: top_k, argmax, shift, cumsum,
    var/std, random draws and dropout."""
    values, indices = nm.top_k(x, "v", 2)
    outs = [values.sum("v"), indices.astype(np.float32).sum("v"), nm.argmax(x, "v")]
    outs += [nm.shift(x, "v", 1), nm.shift(x, "v", -2, wrap=True), nm.cumsum(x, "v")]
    outs += [nm.var(x, "v"), nm.std(x, "b", ddof=1), nm.random.normal(key, x.sizes)]
    return outs + [nm.dropout(x, 0.5, nm.random.fold_in(key, 1))]


@pytest.mark.parametrize("layout", ["v:cols", "b:rows;v:cols", "v:rows,cols"])
def test_rules_with_their_own_arithmetic_are_emitted_as_planned(layout):
    rng = np.random.default_rng(2)
    x = nm.tensor(rng.normal(size=(4, 8)).astype(np.float32), "b v")
    key = nm.random.key(3)
    assert_checked(more_ops, layout, x, key)
    got = lower(more_ops, MESH, layout)(x, key)
    for g, w in zip(got, more_ops(x, key), strict=True):
        np.testing.assert_allclose(g.data, w.data, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "layout", ["batch:rows;heads:cols;d_ff:cols;vocab:cols", "layers:rows;batch:cols"]
)
def test_planning_calls_no_jax(monkeypatch, layout):
    """The planner and the cost report of its plan bind no jax primitive: every jax op
    (jax.numpy, jax.lax, shard_map) goes through Primitive.bind, patched here to raise.
    A pipelined scan (the second layout) too. The layers are a loop as asked
    (scan_layers=True): a stack left to "auto" is the one exception, whose memory
    estimate counts the layer body's jax equations once per program, as nm.scan decides
    whether to unroll it (lowering.memory._unrolled)."""
    loss, inputs = lm("tiny", scan_layers=True)
    graph = nm.trace(loss, *inputs)
    wrt = argument_inputs(graph, inputs, 0)

    def no_jax(self, *args, **params):
        raise AssertionError(f"the planner called jax: {self}")

    monkeypatch.setattr(jax.extend.core.Primitive, "bind", no_jax)
    with pytest.raises(AssertionError, match="called jax"):
        jax.numpy.zeros(3) + 1  # the patch bites
    rep = lower(loss, ABSTRACT, layout).report(*inputs, wrt=0, show=False)  # traced too
    assert rep.flops > 0 and rep.backward and rep.collectives
    assert graph_report(graph, ABSTRACT, Layout(layout), wrt) == rep  # as a search costs


def conv_pool(x, k):
    """Halo exchanges along a split spatial dim: a SAME conv and an overlapping max pool."""
    y = nm.conv(x, k, {"w": "kw"}, padding="SAME")
    return [y.sum("w"), nm.pool(x, {"w": 3}, stride=1, padding="SAME")]


@pytest.mark.parametrize("layout", ["w:cols", "b:rows;w:cols"])
def test_conv_and_pool_are_emitted_as_planned_and_run_correctly(layout):
    """conv's and pool's halos (ppermute of the neighbours' edges) are planned without
    jax, emitted as planned, and the emitted program equals the reference."""
    rng = np.random.default_rng(4)
    x = nm.tensor(rng.normal(size=(2, 16, 3)).astype(np.float32), "b w c")
    k = nm.tensor(rng.normal(size=(3, 3, 4)).astype(np.float32), "kw c o")
    assert_checked(conv_pool, layout, x, k)
    plan = lower(conv_pool, ABSTRACT, layout).plan(x, k)
    assert [c.kind for s in plan for c in s.collectives][:2] == ["ppermute"] * 2
    for g, w in zip(lower(conv_pool, MESH, layout)(x, k), conv_pool(x, k), strict=True):
        np.testing.assert_allclose(g.data, w.data, rtol=1e-5, atol=1e-5)


PIPELINES = {  # the tiny LM of 8 layers; name: (remat, layout)
    "gpipe, M default": ("none", "layers:rows;batch:cols"),
    "gpipe, M=1, remat full": ("full", "layers:rows;microbatches=1"),
    "gpipe, 2 stage axes, remat dots": ("dots", "layers:rows,cols;microbatches=2"),
    "gpipe, stage axes out of mesh order": ("none", "layers:cols,rows;batch:rows"),
    "circular": ("dots", "layers:rows;batch:cols;schedule=circular;microbatches=2"),
    "circular, Megatron": ("none", "layers:rows;heads:cols;d_ff:cols;schedule=circular;repeats=4"),
}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_a_pipelined_scan_is_emitted_as_planned(name):
    """A layout that splits a scan's scanned dim makes it a pipeline (lowering/pipeline.py),
    planned without jax like every other op, and emitted as planned (its pipeline tick
    and the stage's loop)."""
    remat, layout = PIPELINES[name]
    loss, inputs = lm("tiny", layers=8, remat=remat)
    assert_checked(loss, layout, *inputs)
    (pipe,) = [s.pipeline for s in lower(loss, ABSTRACT, layout).plan(*inputs) if s.pipeline]
    assert pipe.stages == math.prod(ABSTRACT.sizes[a] for a in dict(Layout(layout).rules)["layers"])


def test_a_pipelined_scan_with_ys_is_emitted_as_planned_and_runs_from_the_plan():
    """Per-layer results (ys) stay on their stage; the program emitted from the plan, its
    check on, equals a NumPy loop."""
    from test_scan import ARGS, WANT, scanned

    h, ys = lower(scanned, MESH, "layers:rows;batch:cols", check=True)(*ARGS)
    np.testing.assert_allclose(np.asarray(h.data), WANT[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ys.data), WANT[1], rtol=1e-4, atol=1e-5)


def test_a_search_costs_each_candidate_as_it_costs_it_alone():
    """The caches that candidates leave each other (lowering/caches.py) change no figure:
    layouts costed one after another by `graph_report`, as auto_layout costs them, give
    the reports they give each from cold caches, and those of the full plans."""
    loss, inputs = lm("tiny")
    graph = nm.trace(loss, *inputs)
    wrt = argument_inputs(graph, inputs, 0)
    layouts = [
        "batch:rows;heads:cols;d_ff:cols;vocab:cols",
        "batch:rows,cols",
        "batch:rows;d_model:cols",
        "batch:cols;length:rows",
        "heads:rows;d_ff:rows",
    ]
    caches.clear()
    warm = [graph_report(graph, ABSTRACT, Layout(lay), wrt) for lay in layouts]
    for lay, got in zip(layouts, warm, strict=True):
        caches.clear()
        assert got == graph_report(graph, ABSTRACT, Layout(lay), wrt)
        full = lower(loss, ABSTRACT, lay).report(*inputs, wrt=0, show=False)
        assert got == full and str(got) == str(full)


def test_the_context_is_run_by_one_protocol_of_hooks():
    """RuleContext's operations are written on `Hooks` alone: it declares none of them
    (no stubs to drift from the implementations), the Planner implements the six that
    run ops and record the step, and the Interpreter all eight."""
    import inspect

    from lowering.interpret import Interpreter
    from lowering.plan import Hooks, Planner, RuleContext

    hooks = {n for n, v in vars(Hooks).items() if inspect.isfunction(v) and n[0] != "_"}
    records = {"run_local", "note_local", "log"}  # the step's local ops and collectives
    assert hooks == {"vma", "run_op", "run_loop", "plan_layouts", "run_graph", *records}
    assert not hooks & set(vars(RuleContext))
    assert {n for n in hooks if n in vars(Planner)} == {"vma", "run_op", "run_loop", *records}
    ctx = Interpreter(Mesh({"a": 2}), Layout(""), {})
    assert isinstance(ctx, Hooks) and not isinstance(object(), Hooks)
    for name in hooks:  # each implementation takes the protocol's parameters
        want = list(inspect.signature(getattr(Hooks, name)).parameters)
        assert list(inspect.signature(getattr(Interpreter, name)).parameters) == want, name


@pytest.mark.parametrize(
    ("op", "layout", "local"),
    [  # (global [a: 4, b: 8]; m splits a dim in 2): the result's local shape, by hand
        (lambda t: nm.softmax(t, "b"), "b:m", (4, 4)),  # rule's own arithmetic: x's shard
        (lambda t: nm.var(t, "b"), "b:m", (4,)),  # reduced over b
        (lambda t: nm.cumsum(t, "a"), "a:m", (2, 8)),  # the shards' totals added
    ],
)
def test_a_rules_own_arithmetic_takes_the_shape_rules_result(op, layout, local):
    """A rule's last `ctx.call`, given no shape, makes the equation's result as the
    primitive's shape rule makes it from the local shards (not restated by the rule)."""
    x = nm.tensor(np.arange(32.0, dtype=np.float32).reshape(4, 8), "a b")
    lowered = lower(op, Mesh({"m": 2}), layout, check=True)
    calls = [i for step in lowered.plan(x) for i in step.ops if callable(i.op)]
    assert calls and tuple(calls[-1].outs[0].shape) == local
    assert calls[-1].outs[0].dtype == np.float32
    np.testing.assert_allclose(np.asarray(lowered(x).data), op(x).data, rtol=1e-5)  # eager
