"""The optimizer state takes its parameters' layout (issue 37): under a layout that
splits parameters, each moment is split as its parameter (not replicated, which held up
to 3x the planned optimizer memory), the steps keep it so, and the losses are those of
the replicated state. A checkpoint saved with replicated moments (before the fix)
resumes into the split ones."""

import functools
import math

import jax
import numpy as np
import optax
import pytest

from lowering import Mesh
from models import zoo
from models.training import checkpoint
from models.training.trainer import Trainer, TrainSpec
from tests.test_models import CFG, small_batch

SIZES = {"data": 2, "model": 4}
SPLIT = {"heads": "model", "d_ff": "model", "vocab": "model"}  # Megatron's rules
LAYOUT = "batch:data;" + ";".join(f"{d}:{a}" for d, a in SPLIT.items())
BATCHES = [small_batch(CFG, seed=s) for s in range(1, 4)]
OPTIMIZERS = {
    "adamw": optax.adamw(1e-2),
    # min_dim_size_to_factor=4: the tiny model's matrices get factored second moments
    "adafactor": optax.adafactor(1e-2, min_dim_size_to_factor=4),
    "lion": optax.lion(1e-3),
    "sgd": optax.sgd(1e-2, momentum=0.9),
}


@functools.cache
def trainer(name: str, replicated: bool = False) -> Trainer:
    """One Trainer (one compiled step) per optimizer and state layout: `replicated`
    only keys the cache, so a replicated state's step compiles apart from a split one's."""
    return Trainer(zoo.get("lm"), CFG, Mesh(SIZES), LAYOUT, TrainSpec(OPTIMIZERS[name]))


def state_of(name: str, replicated: bool = False) -> dict:
    """A fresh state; `replicated`: its optimizer state on every device, as before the fix."""
    state = trainer(name, replicated).init_state()
    if replicated:
        everywhere = jax.sharding.NamedSharding(Mesh(SIZES).jax_mesh, jax.sharding.PartitionSpec())
        state["opt"] = jax.tree.map(lambda x: jax.device_put(x, everywhere), state["opt"])
    return state


def device_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def split_param_bytes(params) -> int:
    """One device's float32 parameter bytes, from the shapes, dims and the rules alone."""
    total = 0
    for t in jax.tree.leaves(params, is_leaf=lambda x: hasattr(x, "dims")):
        ways = [SIZES[SPLIT[d]] if d in SPLIT else 1 for d in t.dims]
        total += math.prod(n // w for n, w in zip(t.shape, ways, strict=True)) * 4
    return total


def node(state, kind):
    """The (one) node of optimizer state type `kind` in `state`."""
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind))
    (found,) = [x for x in leaves if isinstance(x, kind)]
    return found


def train(name: str, state, steps, replicated: bool = False):
    tr, losses = trainer(name, replicated), []
    for s in steps:
        state, loss = tr.step(state, BATCHES[s - 1], s)
        losses.append(loss)
    return state, losses


def same_shardings(moments, params) -> bool:
    same = jax.tree.map(lambda m, p: m.sharding == p.sharding, moments, params)
    return all(jax.tree.leaves(same))


def test_adamw_moments_are_split_as_their_parameters_across_steps():
    state = state_of("adamw")
    params, adam = state["params"], node(state["opt"], optax.ScaleByAdamState)
    assert same_shardings(adam.mu, params) and same_shardings(adam.nu, params)
    split = split_param_bytes(params)
    whole = sum(x.nbytes for x in jax.tree.leaves(params))
    assert device_bytes(params) == split < whole
    tensors = [x for x in jax.tree.leaves(state["opt"]) if x.ndim]
    assert device_bytes(tensors) == 2 * split  # the step counts aside
    counts = [x for x in jax.tree.leaves(state["opt"]) if not x.ndim]
    assert all(x.sharding.is_fully_replicated for x in counts)
    before = [x.sharding for x in jax.tree.leaves(state)]
    state, got = train("adamw", state, range(1, 4))
    # the steps keep every leaf where it was: no resharding, no second compile
    assert [x.sharding for x in jax.tree.leaves(state)] == before
    _, want = train("adamw", state_of("adamw", True), range(1, 4), replicated=True)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "name, kind", [("lion", optax.ScaleByLionState), ("sgd", optax.TraceState)]
)
def test_lion_and_momentum_are_split_as_their_parameters(name, kind):
    state = state_of(name)
    moments = node(state["opt"], kind)
    assert same_shardings(moments.mu if name == "lion" else moments.trace, state["params"])
    assert device_bytes([x for x in jax.tree.leaves(state["opt"]) if x.ndim]) == (
        split_param_bytes(state["params"])
    )


def test_adafactor_factored_moments_split_as_the_dims_they_keep():
    """A factored moment keeps all but one of its parameter's dims: those kept are split
    as in the parameter (the ffn's d_ff 4 ways), and the steps keep them so."""
    state = state_of("adafactor")
    factored = node(state["opt"], optax.FactoredState)
    wi = state["params"]["layers"]["ffn"]["wi"]  # (layers, d_model, d_ff)
    assert wi.dims[1:] == ("d_model", "d_ff")
    left_out = {}  # the dim of wi each factored moment leaves out (it holds the others)
    for moment in (factored.v_row, factored.v_col):
        m = moment["layers"]["ffn"]["wi"].data
        (i,) = [i for i in range(wi.ndim) if m.shape == wi.shape[:i] + wi.shape[i + 1 :]]
        left_out[i] = m
    assert sorted(left_out) == [1, 2]  # the two largest dims are factored
    # the moment that keeps d_ff (it left d_model out) splits it 4 ways; the other is whole
    assert left_out[1].addressable_shards[0].data.shape == (CFG.layers, CFG.d_ff // 4)
    assert left_out[2].sharding.is_fully_replicated
    before = [x.sharding for x in jax.tree.leaves(state)]
    state, losses = train("adafactor", state, range(1, 3))  # the step takes them as they are
    assert [x.sharding for x in jax.tree.leaves(state)] == before
    assert np.isfinite(losses).all()


COMPILES: list[str] | None = None  # XLA compiles while a test counts them


def count_compiles(event: str, _secs: float, **_) -> None:
    if COMPILES is not None and event == "/jax/core/compile/backend_compile_duration":
        COMPILES.append(event)


jax.monitoring.register_event_duration_secs_listener(count_compiles)


def test_a_checkpoint_with_replicated_moments_resumes_split(tmp_path):
    """Saved before the fix (every moment replicated), restored into this run's state:
    the same values, split as the parameters, and the next step's loss unchanged. The
    save compiles at most its checksums' program: orbax's replica-parallel saving, on
    one process, compiled a slice per device and replicated shape (105 here, 17 s)."""
    global COMPILES
    old, _ = train("adamw", state_of("adamw", True), range(1, 3), replicated=True)
    saved = jax.tree.map(np.asarray, old["opt"])
    ckpt, COMPILES = checkpoint.Checkpointer(tmp_path), []
    try:
        ckpt.save(2, old, {"model": "lm"})
        ckpt.close()
        assert len(COMPILES) <= 1, f"{len(COMPILES)} compiles to save a checkpoint"
    finally:
        COMPILES = None
    state, meta = checkpoint.restore(tmp_path, state_of("adamw"))
    assert meta["step"] == 2
    for got, want in zip(jax.tree.leaves(state["opt"]), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    adam = node(state["opt"], optax.ScaleByAdamState)
    assert same_shardings(adam.mu, state["params"]) and same_shardings(adam.nu, state["params"])
    _, got = train("adamw", state, [3])
    _, want = train("adamw", old, [3], replicated=True)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
