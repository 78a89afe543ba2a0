"""A pipeline beside the other ways to split a model (issue 18): FSDP-style rules with the
scan's remat policy, a mixture of experts, and the encoder-decoder's two stacks (each
`nm.scan` over `layers` its own pipeline, one after the other). Loss and gradients
equal the model run by jax on one device, unlowered, run from the Planner's plan (equal
to the traced one); one compile per layout. The MoE runs 2 microbatches, each routed
on its own and its balancing loss averaged (Megatron's rule): against the unlowered
model run microbatch by microbatch, losses and gradients averaged.
(Pipeline x data x Megatron on a 2x2x2 mesh: tests/test_pipeline.py.)"""

import functools

import jax
import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, lower
from models import transformer, zoo
from models.training import objectives
from tests.test_pipeline import BATCH, CFG, PARAMS, one_device

SMALL = CFG.replace(layers=2, batch=4)
SPAN_VOCAB = 80  # the byte ids below 80 - special tokens, the span sentinels above


def _span_batch() -> dict:
    base = SPAN_VOCAB - objectives.special_tokens("span")
    r = np.random.default_rng(1)
    windows = r.integers(0, base, size=(SMALL.batch, SMALL.length))
    batch = objectives.make("span", windows, base, r)
    return {k: nm.tensor(v, ("batch", "length")) for k, v in batch.items()}


@functools.cache
def case(name: str):
    """(loss of (params, batch), params, batch) of the model named by the case."""
    if name == "moe":  # its balancing loss mixes examples: each microbatch has its own
        cfg = zoo.get("moe").configure(SMALL)
        params = transformer.init(transformer.lm_shapes(cfg), 0)
        batch = {k: nm.tensor(np.asarray(v.data)[: cfg.batch], v.dims) for k, v in BATCH.items()}
        return functools.partial(transformer.lm_loss, cfg=cfg), params, batch
    cfg = SMALL.replace(vocab=SPAN_VOCAB)
    params = transformer.init(transformer.encdec_shapes(cfg), 0)
    return functools.partial(transformer.encdec_loss, cfg=cfg), params, _span_batch()


def _value_and_grads(loss, params, batch):
    return jax.jit(jax.value_and_grad(lambda p: loss(p, batch).data))(params)


def _by_microbatch(loss, params, batch, m: int):
    """The unlowered loss and gradients of `m` microbatches of `batch`'s rows, averaged:
    what a pipeline of `m` microbatches computes where each routes on its own."""
    rows = batch["inputs"].size_of("batch") // m
    parts = [{k: nm.tensor(np.asarray(v.data)[i * rows : (i + 1) * rows], v.dims)
              for k, v in batch.items()} for i in range(m)]  # fmt: skip
    mean = lambda p: sum(loss(p, b).data for b in parts) / m
    return jax.jit(jax.value_and_grad(mean))(params)


def _assert_equal(got, want):
    (got_loss, got_grads), (want_loss, want_grads) = got, want
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    got, want = jax.tree_util.tree_leaves(got_grads), jax.tree_util.tree_leaves(want_grads)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_fsdp_rules_and_remat_inside_the_stages():
    """The stack split over `stage` and, FSDP-style, `d_model` over `data` (gathered
    per layer inside each stage), each layer rematerialised but its matmuls."""
    cfg = CFG.replace(remat="dots")  # values and gradients those of no remat
    lowered = lower(lambda p, b: transformer.lm_loss(p, b, cfg), Mesh({"stage": 2, "data": 4}),
                    "layers:stage;batch:data;d_model:data;microbatches=2", check=True)  # fmt: skip
    _assert_equal(_value_and_grads(lowered, PARAMS, BATCH), one_device())  # emitted, checked
    (plan,) = lowered.report(PARAMS, BATCH, wrt=0, show=False).pipelines
    assert (plan.stages, plan.microbatches) == (2, 2)


@pytest.mark.parametrize(
    "name, sizes, layout, pipelines",
    [
        ("moe", {"stage": 2, "data": 2}, "layers:stage;batch:data;experts:data", 1),
        ("encdec", {"stage": 2, "data": 2}, "layers:stage;batch:data", 2),
    ],
)
def test_moe_and_the_encoder_decoder_pipelined(name, sizes, layout, pipelines):
    loss, params, batch = case(name)
    lowered = lower(loss, Mesh(sizes), layout, check=True)  # emitted, checked against its plan
    want = _by_microbatch(loss, params, batch, 2) if name == "moe" else None
    want = want or _value_and_grads(loss, params, batch)
    _assert_equal(_value_and_grads(lowered, params, batch), want)
    plans = lowered.report(params, batch, wrt=0, show=False).pipelines
    assert [p.stages for p in plans] == [2] * pipelines
    assert all(p.microbatches == 2 for p in plans)  # the MoE's too: its balance averaged
    assert [p.averaged for p in plans] == [1 if name == "moe" else 0] * pipelines
