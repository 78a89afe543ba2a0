"""The memory of a whole training step (lowering/train_step.py) against XLA's compiled
trainer step and against the parameter count; remat's recompute flops against a layer's
flops counted by hand."""

import jax
import pytest

from lowering import Mesh, lower
from lowering.train_step import Training, step_memory
from models import catalog, transformer
from models.layers.common import count
from models.training import objectives
from namedmesh.errors import ParameterError


def _report(cfg, sizes, rules):
    params = transformer.abstract(transformer.lm_shapes(cfg))
    batch = objectives.abstract_batch("lm", cfg.batch, cfg.length)
    loss = lambda p, b: transformer.lm_loss(p, b, cfg)
    return lower(loss, Mesh(sizes, devices="abstract"), rules).report(params, batch, wrt=0,
                                                                       show=False)  # fmt: skip


@pytest.mark.parametrize("remat, grad_accum, scan_layers", [("none", 2, "auto"), ("dots", 1, True)])
def test_the_step_estimate_is_within_15_percent_of_xla_compiled_trainer_step(
    remat, grad_accum, scan_layers
):
    """Megatron, accumulated with the layer stack unrolled (scan_layers "auto"'s pick
    without remat), and under remat dots in a loop (its backward peaks inside the
    loop's: the loss head's saved values are freed by then, and a recomputed
    iteration's values are not all live at once: 1.29x before lowering.memory._peak);
    the estimate models each as it runs (lowering/memory.py). More rows:
    benchmarks.step_memory's table; the loop without remat, tests/test_memory_estimate.py."""
    from benchmarks.step_memory import MEGATRON, measure

    est, xla = measure(MEGATRON, remat, grad_accum, "tiny", scan_layers=scan_layers)
    assert 0.85 <= est / xla <= 1.15, (est, xla)


def test_adamw_moments_are_two_per_parameter_and_zero1_splits_them_over_data():
    cfg = catalog.get("tiny")
    rep = _report(cfg, {"data": 8}, "batch:data")  # parameters replicated
    n = count(transformer.lm_shapes(cfg))  # float32 parameters
    plain = step_memory(rep, {"data": 8}, ("data",), Training("adamw"))
    assert plain.parameters == plain.gradients == 4 * n
    assert plain.optimizer == 2 * 4 * n
    zero = step_memory(rep, {"data": 8}, ("data",), Training("adamw", zero1=True))
    assert zero.optimizer == 2 * 4 * n // 8
    half = step_memory(rep, {"data": 8}, ("data",), Training("adamw", moment_dtype="bfloat16"))
    assert half.optimizer == 2 * 2 * n
    accum = step_memory(rep, {"data": 8}, ("data",), Training("adamw", grad_accum=4))
    assert accum.gradients == 2 * 4 * n  # the running sum beside one microbatch's
    assert step_memory(rep, {"data": 8}, (), Training("sgd")).optimizer == 0


def test_remat_recompute_flops_are_a_layers_forward_flops():
    cfg = catalog.get("tiny")  # d_model 64, 4 heads of 16, d_ff 256, 2 layers, 16 x 64 tokens
    reps = {r: _report(cfg.replace(remat=r), {"one": 1}, "") for r in ("none", "dots", "full")}
    one = _report(cfg.replace(layers=1), {"one": 1}, "")
    layer = reps["none"].flops - one.flops  # one layer's forward flops
    assert reps["none"].recompute_flops == 0
    assert reps["full"].recompute_flops == pytest.approx(2 * layer)
    tokens, d, hd, f, t = 16 * 64, 64, 4 * 16, 256, 64
    matmuls = 2 * tokens * (4 * d * hd + 2 * d * f) + 2 * 2 * tokens * t * hd
    assert reps["dots"].recompute_flops == pytest.approx(2 * (layer - matmuls))


def test_a_bad_training_setting_is_a_parameter_error():
    with pytest.raises(ParameterError, match="optimizer 'adamax'"):
        Training("adamax")
    with pytest.raises(ParameterError, match="grad_accum"):
        Training(grad_accum=0)


def test_auto_layout_holds_the_whole_step_to_the_memory_limit():
    """With `training=`, a candidate's memory is its step's total (optimizer state too),
    and no layout over the limit by that measure is chosen, though its gradient alone fits."""
    import math

    from lowering import auto_layout

    cfg = catalog.get("tiny")
    params = transformer.abstract(transformer.lm_shapes(cfg))
    batch = objectives.abstract_batch("lm", cfg.batch, cfg.length)
    loss = lambda p, b: transformer.lm_loss(p, b, cfg)
    mesh = Mesh({"data": 8}, devices="abstract")
    run = lambda limit, training: auto_layout(loss, mesh, params, batch, grad_argnums=(0,),
                                              rates="h100,flops=1e9", memory_limit=limit,
                                              training=training)  # fmt: skip
    free, table = run(math.inf, Training())
    best = table[0]
    assert best.memory == best.step.total > _report(cfg, {"data": 8}, free).peak_memory
    limit = (best.memory + _report(cfg, {"data": 8}, free).peak_memory) / 2
    _, without = run(limit, None)  # the gradient's memory alone: the free choice fits
    assert str(without[0].layout) == str(free)
    _, held = run(limit, Training())
    assert held[0].memory <= limit and str(held[0].layout) != str(free)


def test_adafactor_state_is_its_factored_moments_as_optax_keeps_them():
    """optax.adafactor's own state (its float leaves: row and column sums where the two
    largest dims are >= 128, else the full moment, and their placeholders) against the
    estimate, on one device and with a factored dim split 2 ways."""
    import jax.numpy as jnp
    import optax

    import namedmesh as nm

    shapes = {"w": {"a": 256, "b": 512}, "narrow": {"a": 256, "c": 64}, "v": {"b": 512},
              "t": {"c": 64, "a": 256, "d": 192}}  # fmt: skip
    loss = lambda p: sum(nm.sum(x) for x in p.values())
    params = {k: nm.abstract(s) for k, s in shapes.items()}
    state = optax.adafactor(1e-3).init({k: jnp.zeros(tuple(s.values())) for k, s in shapes.items()})
    floats = [x for x in jax.tree_util.tree_leaves(state) if x.dtype == jnp.float32]
    whole = sum(x.size * 4 for x in floats)
    rep = lower(loss, Mesh({"one": 1}, devices="abstract"), "").report(params, wrt=0, show=False)
    assert step_memory(rep, {"one": 1}, (), Training("adafactor")).optimizer == whole
    assert whole < 2 * 4 * sum(x.size for x in jax.tree_util.tree_leaves(params))  # < AdamW's
    # `a` split 2 ways: the leaves that keep `a` (256 of it) are halved on each device
    two = lower(loss, Mesh({"data": 2}, devices="abstract"), "a:data")
    rep = two.report(params, wrt=0, show=False)
    halved = sum(x.size * 4 // (2 if 256 in x.shape else 1) for x in floats)
    assert step_memory(rep, {"data": 2}, (), Training("adafactor")).optimizer == halved
