"""The whole training step's memory estimate (lowering/train_step.py) on cases outside
docs/benchmarks.md's nine-row table, from `python -m benchmarks.step_memory --cases
random`: against XLA's memory_analysis of the trainer's compiled step (within 15%),
and its parameters and optimizer parts against the bytes of the trainer's own state on
device 0 (exact). Each case is compiled once, never run."""

import pytest

from benchmarks.step_memory import FAMILIES, catalog_config, measure_forward, measure_step

# (family, mesh, rules, config changes, grad_accum)
CASES = {
    # FSDP: each layer's weights are gathered whole for its matmuls, and jax saves the
    # gathered copies for the backward pass, which makes their cotangents whole before
    # reducing them; the estimate counted the shards (0.75 of XLA before lowering.memory.Read)
    "llama GQA, FSDP over 8": (
        "llama (GQA)", {"data": 8}, "batch:data;d_model:data",
        dict(remat="none", dtype="float32", attention="full", scan_layers=True), 1,
    ),
    # Megatron on 4x2, blockwise attention, remat dots, accumulated; a
    # vocabulary that 8 does not divide (replicated) and an FFN of 60 per device
    "gemma 2, Megatron 4x2": (
        "gemma 2 (soft-caps)", {"data": 4, "model": 2},
        "batch:data;kv_heads:model;d_ff:model;vocab:model",
        dict(remat="dots", dtype="float32", attention="blockwise", attention_block=16,
             scan_layers=True, vocab=250, d_ff=120), 2,
    ),
    # bfloat16 on XLA:CPU: the intermediates are float32 as its float normalisation
    # keeps them (lowering.memory.cpu_bytes; 0.85 before, counted as bfloat16), the casts'
    # copies of the weights bfloat16; the update's phase against the backward's
    "gpt bfloat16, vocab split 4x2": (
        "gpt", {"data": 4, "model": 2}, "batch:data;vocab:model",
        dict(remat="none", dtype="bfloat16", attention="blockwise", attention_block=16,
             scan_layers="auto"), 2,
    ),
    # MoE, the layer stack as a loop under remat: the backward loop's own cotangents
    # beside one recomputed iteration's working set, and the step's peak the larger of
    # the backward pass and the update (the new parameters and moments beside the old)
    "qwen3-moe, experts split 4x2, loop": (
        "qwen3-moe", {"data": 4, "model": 2}, "batch:data;experts:model",
        dict(remat="full", dtype="float32", attention="blockwise", attention_block=16,
             scan_layers=True), 4,
    ),
    # MoE under remat dots, a loop: the grouped FFN's saves found at the 256 rows each
    # device runs (352 saved rows, where the graph's 2048 give 2336: Made at the local
    # op's shapes) and stored per layer with its output (jax's dots_saveable keeps the
    # products its kernel's dots make): 0.79 of XLA before, 0.91 after
    "qwen3-moe, data parallel 2x4, dots": (
        "qwen3-moe", {"data": 2, "model": 4}, "batch:data,model",
        dict(remat="dots", dtype="float32", attention="full", scan_layers=True), 1,
    ),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(CASES))
def measured(request):
    family, sizes, rules, changes, accum = CASES[request.param]
    base, own = FAMILIES[family]
    return measure_step(catalog_config(base, **(own | changes)), sizes, rules, accum)


def test_the_step_estimate_is_within_15_percent_of_xla(measured):
    est, xla, _ = measured
    assert 0.85 <= est.total / xla <= 1.15, (est, xla)


def test_the_parameters_and_optimizer_parts_are_the_states_bytes(measured):
    est, _, real = measured
    assert est.parameters == real["parameters"]
    assert est.optimizer == real["optimizer"]
    assert est.gradients in (est.parameters, 2 * est.parameters)  # as the parameters


@pytest.mark.parametrize("rows, hidden, groups", [(256, 128, 4), (1024, 96, 8)])
def test_a_grouped_ffns_backward_bytes_are_what_xla_holds_for_its_gradient(rows, hidden, groups):
    """The grouped FFN's declared saves and backward working set (lowering.memory.Made),
    in x's sizes, against XLA's temporaries of the kernel's gradient alone (gated, an even
    load): never under them, at most 10% over."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import namedmesh as nm

    x = np.zeros((rows, 64), np.float32)
    wi, wg = (np.zeros((groups, 64, hidden), np.float32) for _ in range(2))
    wo = np.zeros((groups, hidden, 64), np.float32)
    g = np.arange(rows, dtype=np.int32) % groups
    dims = ("t d", "experts d f", "experts f o", "t", "experts d f")
    ins = [nm.tensor(a, d) for a, d in zip((x, wi, wo, g, wg), dims, strict=True)]

    def loss(x, wi, wo, wg):
        named = [nm.tensor(a, d) for a, d in zip((x, wi, wo, g, wg), dims, strict=True)]
        return jnp.sum(nm.grouped_ffn(*named, activation="silu").data)

    grad = jax.jit(jax.grad(loss, (0, 1, 2, 3))).lower(x, wi, wo, wg).compile()
    xla = grad.memory_analysis().temp_size_in_bytes
    prim, params = nm.REGISTRY["grouped_ffn"], {"dim": "experts", "activation": "silu"}
    declared = (prim.backward_saves(ins, params) + prim.backward_working(ins, params)) * x.nbytes
    assert xla <= declared <= 1.1 * xla, (declared, xla)


def test_a_moe_steps_forward_pass_is_what_xla_holds_for_it():
    """The forward phase of a step (lowering.memory.training_forward: the values the
    backward reads, made so far, the layer loop's stacks whole from its start beside
    one iteration, the grouped FFN's gathered operands and its declared forward
    working set) against XLA's memory_analysis of jax.vjp's forward of the same
    lowered loss, which holds what the backward reads as its outputs: Qwen3-MoE, data
    parallel over 8, the layer stack a loop without remat. 0.87 of XLA (jax keeps
    0.47 MB more residuals than the estimate's saved values: 2.69 against 2.22); the
    inputs alone, were the forward walk dropped, 0.16."""
    base, own = FAMILIES["qwen3-moe"]
    changes = dict(remat="none", dtype="float32", attention="full", scan_layers=True)
    est, xla = measure_forward(catalog_config(base, **(own | changes)), {"data": 8}, "batch:data")
    assert 0.85 <= est / xla <= 1.15, (est, xla)
