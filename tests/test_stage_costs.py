"""The pipelined step's cost (lowering/stages.py) charges each term where it falls:
the gradient sync once per step (not per tick), the embedding on the first stage and
the loss head on the last only, and the saved activations and inputs of the microbatches
in flight at a stage (1F1B: min(M, S - s)) but its parameters, gradients and optimizer
state once. Oracles: a 2-stage toy of linear layers whose bytes and seconds are worked
out by hand at round rates, and a model's parameters counted whole."""

import math

import numpy as np
import pytest

import namedmesh as nm
from lowering import Layout, Mesh, lower
from lowering.joint import Settings
from lowering.rates import parse
from lowering.stages import staged_choice
from lowering.train_step import Training, update_bytes
from models import catalog, transformer
from models.cli import plan as plan_cli

B, D, D_IN, VOCAB = 16, 16, 24, 8  # rows per step, width, the embedding's input, the head's
RATES = parse("flops=1e12,bandwidth=1e10,latency=1e-5,memory=8e9")
LATENCY, RATE, F32 = 1e-5, 1e10, 4


def toy_build(settings, counts, first, last):
    """A stage of counts[0] linear layers d_model -> d_model; the first embeds x (batch,
    d_in), the last holds a head to `vocab` and the loss sum(y * y); a stage between
    reads the previous stage's activation and the gradient sent back."""
    (n,) = counts
    b = B // settings.grad_accum
    params = {f"w{i}": nm.abstract({"d_model": D, "d_next": D}) for i in range(n)}
    inputs = {}
    if first:
        params["embed"] = nm.abstract({"d_in": D_IN, "d_model": D})
        inputs["x"] = nm.abstract({"batch": b, "d_in": D_IN})
    else:
        inputs["hidden"] = nm.abstract({"batch": b, "d_model": D})
    if last:
        params["head"] = nm.abstract({"d_model": D, "vocab": VOCAB})
    else:
        inputs["grad"] = nm.abstract({"batch": b, "d_model": D})

    def loss(p, x):
        h = nm.einsum(x["x"], p["embed"], out=("batch", "d_model")) if first else x["hidden"]
        for i in range(n):
            h = nm.einsum(h, p[f"w{i}"], out=("batch", "d_next")).rename(d_next="d_model")
        if last:
            y = nm.einsum(h, p["head"], out=("batch", "vocab"))
            return nm.sum(y * y)
        return nm.sum(h * x["grad"])

    return loss, (params, inputs)


M = 4  # microbatches: 4 rows each, 2 per device of a stage's data axis


@pytest.fixture(scope="module")
def toy():
    """5 layers on 2 stages (3 then 2), each stage data-parallel over 2 devices."""
    mesh = Mesh({"stage": 2, "data": 2}, devices="abstract")
    boundary = B // M * D * F32
    return staged_choice(toy_build, mesh, Settings(grad_accum=M), [5], RATES, Training(),
                         8e9, 1.0, boundary, False, layout=Layout("batch:data"))  # fmt: skip


def test_gradient_sync_is_charged_once_per_step_not_per_tick(toy):
    first, last = sorted(toy.costs, key=lambda c: c.positions)
    assert (first.counts, first.first, first.last) == ((3,), True, False)
    assert (last.counts, last.first, last.last) == ((2,), False, True)
    # each parameter replicated over `data` is all-reduced once: 2(n-1)/n of its bytes,
    # its bytes for n = 2; stage 0 has 4 (embed, 3 layers), stage 1 has 3 (2 layers, head)
    sync0 = 4 * LATENCY + (D_IN * D + 3 * D * D) * F32 / RATE
    sync1 = 3 * LATENCY + (2 * D * D + D * VOCAB) * F32 / RATE
    assert first.candidate.sync == pytest.approx(sync0)
    assert last.candidate.sync == pytest.approx(sync1)
    assert toy.sync_seconds == pytest.approx(max(sync0, sync1))
    # per tick: each stage's loss summed over data (a psum of one float32: 4 bytes
    # sent) is its only collective but the sync; the boundary's activation (2 rows of
    # width D per device) to the next stage and its gradient back, one ppermute each
    loss_psum = LATENCY + F32 / RATE
    for cost in (first, last):
        assert cost.candidate.comm - cost.candidate.sync == pytest.approx(loss_psum)
    send = 2 * (LATENCY + B // M // 2 * D * F32 / RATE)
    assert toy.send_seconds == pytest.approx(send)
    # the slowest tick is stage 0's (more flops): per device, b = 2 rows, the forward's
    # embedding and 3 layers' matmuls and the loss's product and sum, the backward's
    # matmuls once for the embedding (its input x takes no gradient), twice a layer
    b = B // M // 2
    forward = 2 * b * D_IN * D + 3 * 2 * b * D * D + 2 * b * D
    backward = 2 * b * D_IN * D + 2 * 3 * 2 * b * D * D + 2 * b * D
    assert toy.slowest is first
    ticks = M + 2 - 1
    assert toy.compute_seconds == pytest.approx(ticks * (forward + backward) / 1e12)
    assert toy.comm_seconds == pytest.approx(ticks * (loss_psum + send) + max(sync0, sync1))
    assert toy.step_seconds == pytest.approx(toy.compute_seconds + toy.comm_seconds)


def test_embedding_and_head_are_charged_to_the_first_and_last_stage_only(toy):
    first, last = sorted(toy.costs, key=lambda c: c.positions)
    # float32 parameters, replicated over data: the embedding and 3 layers on stage 0,
    # 2 layers and the head on stage 1, never both on one stage
    assert first.candidate.step.parameters == (D_IN * D + 3 * D * D) * F32
    assert last.candidate.step.parameters == (2 * D * D + D * VOCAB) * F32
    for cost in (first, last):
        step = cost.candidate.step
        assert step.gradients == 2 * step.parameters  # microbatch's and the running sum
        assert step.optimizer == 2 * step.parameters  # AdamW's two float32 moments


def test_in_flight_microbatches_scale_activations_and_inputs_not_state(toy):
    """Stage 0 holds min(M, S - 0) = 2 microbatches' saved activations and inputs at
    once, stage 1 min(M, 1) = 1; the one-microbatch figures are the lowering's report."""
    mesh = Mesh({"data": 2}, devices="abstract")
    settings = Settings(grad_accum=M)
    for cost, flight, inputs in [
        (min(toy.costs, key=lambda c: c.positions), 2, (D_IN + D) * B // M // 2 * F32),
        (max(toy.costs, key=lambda c: c.positions), 1, 0),
    ]:
        fn, args = toy_build(settings, cost.counts, cost.first, cost.last)
        rep = lower(fn, mesh, "batch:data").report(*args, wrt=0, show=False)
        parts, step = rep.memory_parts, cost.candidate.step
        assert step.activations == flight * parts["saved"] + parts["working"]
        # the batch per microbatch in flight; the update's new state only where the
        # update outgrows the backward pass (the step's peak is the larger phase)
        backward = step.gradients + step.activations
        update = update_bytes(rep, step.optimizer)
        batch = parts["inputs"] - step.parameters
        assert step.other == batch + (flight - 1) * inputs + max(update - backward, 0)
        assert step.parameters == step.gradients / 2  # the state once, whatever the flight
    assert toy.memory == max((c.candidate.step for c in toy.costs), key=lambda m: m.total)


def test_training_refuses_a_bad_in_flight():
    from namedmesh.errors import ParameterError

    with pytest.raises(ParameterError, match="in_flight must be an int >= 1, got 0"):
        Training(in_flight=0)


def test_the_stages_of_a_model_hold_its_parameters_once():
    """3 stages of a tiny MoE with a dense layer first (its layers 1 dense + 4 MoE: 2, 2
    and 1 a stage) on one device each: their parameters add up to the model's (its tied
    embedding on the first and the last stage both)."""
    cfg = catalog.get("tiny").replace(
        experts=4, experts_per_token=2, dense_layers=1, layers=5, length=16
    )  # its learned positions: 16
    build = plan_cli.stage_builder(cfg, batch=8, length=16)
    mesh = Mesh({"stage": 3, "one": 1}, devices="abstract")
    got = staged_choice(build, mesh, Settings(grad_accum=2), [1, 4], RATES, Training(), 8e9,
                        1.0, 8 * 16 * 64 * 4, True, layout=Layout(""))  # fmt: skip
    whole = transformer.lm_shapes(cfg)
    count = lambda shapes: sum(math.prod(p.sizes.values()) for p in _leaves(shapes))
    tied = math.prod(whole["embed"].sizes.values())
    per_stage = {c.positions[0]: c.candidate.step.parameters // F32 for c in got.costs}
    assert sorted(per_stage) == [0, 1, 2] and got.assignment == [(1, 1), (0, 2), (0, 1)]
    assert sum(per_stage.values()) == count(whole) + tied
    middle = count(transformer.stacked(transformer.layer_shapes(cfg), 2))
    assert per_stage[1] == middle  # no embedding, no head: two MoE layers
    assert np.isclose(got.bubble, 2 / 4)


def _leaves(shapes):
    if isinstance(shapes, dict):
        return [leaf for v in shapes.values() for leaf in _leaves(v)]
    return [shapes]


def test_pruning_pipelined_pairs_by_their_bubble_keeps_the_best_plan():
    """joint_search's least time of a pipelined pair is its flops over every device times
    (M + S - 1) / M: at a slow flop rate (compute dominates) it prunes the pipelined
    pairs with few microbatches, and the plan is the one every pair searched finds."""
    from lowering.joint import joint_search

    slow = parse("flops=1e6,bandwidth=1e10,latency=1e-5,memory=8e9")
    whole = lambda settings: toy_build(settings, (5,), True, True)

    def evaluate(mesh, settings, flops, seeds=(), plateau=0.0):
        boundary = B // settings.grad_accum * D * F32
        return staged_choice(toy_build, mesh, settings, [5], slow, Training(), 8e9, flops,
                             boundary, False, seeds=seeds, plateau=plateau)  # fmt: skip

    meshes = [Mesh({"data": 4}, devices="abstract"),
              Mesh({"stage": 2, "data": 2}, devices="abstract")]  # fmt: skip
    staged = (evaluate, [Settings(grad_accum=m) for m in (1, 2, 4, 8)])
    plans = [joint_search(whole, meshes, slow, [Settings()], tokens=B, staged=staged,
                          exhaustive=e) for e in (True, False)]  # fmt: skip
    assert plans[1].pruned.get("least possible step time no better than the best that fits")
    assert plans[1].searched < plans[0].searched
    assert plans[1].best.step_seconds == pytest.approx(plans[0].best.step_seconds)
