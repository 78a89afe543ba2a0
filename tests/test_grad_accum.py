"""Gradient accumulation: N microbatches give the update of one batch N times larger,
with the activation memory of one microbatch."""

import jax
import numpy as np
import optax
import pytest

from lowering import Mesh
from models import zoo
from models.training.trainer import Trainer, TrainSpec
from namedmesh.errors import ParameterError
from tests.test_models import CFG, small_batch

BATCH = small_batch(CFG.replace(batch=8), seed=4)
BATCH["weights"][3, 5:] = 0.0  # microbatches with different token counts


def _trainer(n, mesh=None, layout=""):
    mesh = mesh or Mesh({"one": 1})
    return Trainer(
        zoo.get("lm"), CFG.replace(batch=8), mesh, layout, TrainSpec(optax.sgd(1.0), 0, n)
    )


def _update(n, mesh=None, layout=""):
    """(loss, params before, params after one SGD step of rate 1 (params - grads), the
    step's XLA temporaries in bytes), compiled once."""
    tr = _trainer(n, mesh, layout)
    state, batch = tr.init_state(), tr.place_batch(BATCH)
    before = jax.tree.map(np.asarray, state["params"])
    compiled = jax.jit(tr._update).lower(state, batch, None).compile()
    state, loss, _ = compiled(state, batch, None)  # (the router statistics: none)
    after = jax.tree.map(np.asarray, state["params"])
    return float(loss), before, after, compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("n, sizes, layout", [(4, None, ""), (2, {"data": 2}, "batch:data")])
def test_microbatches_give_the_update_of_the_whole_batch(n, sizes, layout):
    """...with the activations of one microbatch: the whole batch's float32 logits, the
    largest activation, are no longer held at once."""
    mesh = None if sizes is None else Mesh(sizes)
    loss1, before, want, temp1 = _update(1, mesh, layout)
    loss_n, _, got, temp_n = _update(n, mesh, layout)
    assert abs(loss_n - loss1) <= 1e-6 * abs(loss1)
    moved = 0.0
    leaves = [jax.tree.leaves(t) for t in (before, want, got)]
    for b, w, g in zip(*leaves, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6)
        moved = max(moved, float(np.abs(w - b).max()))
    assert moved > 1e-3  # the step did move the parameters
    devices = 1 if sizes is None else 2
    logits = 8 // devices * CFG.length * CFG.vocab * 4  # one device's float32 logits
    assert temp_n <= temp1 - logits * (n - 1) // n


def test_grad_accum_must_divide_the_batch():
    with pytest.raises(
        ParameterError, match=r"grad_accum 3 \(--grad-accum\) .* batch 8 \(--batch\)"
    ):
        _trainer(3)
    with pytest.raises(ParameterError, match="--grad-accum"):
        _trainer(0)
