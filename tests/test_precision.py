"""The compute dtype: bfloat16 keeps its dtype through every op, einsum accumulates
bfloat16 products in float32 where asked, and the zoo runs in bfloat16 with float32
parameters, gradients, statistics and loss, close to its float32 self and to NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, lower
from models import architecture as config
from models import catalog, transformer, zoo
from models.training import objectives
from tests.test_models import CFG, np_lm_logits, small_batch

BF16 = np.dtype(jnp.bfloat16)
R = np.random.default_rng(3)


def bf16(shape, dims):
    return nm.tensor(R.normal(size=shape).astype(BF16), dims)


@pytest.mark.parametrize(
    "op, jop",
    [
        (lambda x: x * 0.5, lambda x: x * 0.5),
        (lambda x: 1.0 - x, lambda x: 1.0 - x),
        (lambda x: x + 2, lambda x: x + 2),
        (nm.gelu, jax.nn.gelu),
        (lambda x: nm.rsqrt(nm.abs(x)), lambda x: jax.lax.rsqrt(jnp.abs(x))),
        (lambda x: nm.mean(x, "b"), lambda x: x.mean(-1)),
        (lambda x: nm.softmax(x, "b"), lambda x: jax.nn.softmax(x, -1)),
    ],
)
def test_bfloat16_keeps_its_dtype_as_jax_does(op, jop):
    """The root of the zoo's bf16 failure: Python scalars and float-only ops turned
    bfloat16 (NumPy kind 'V') into float32, so the layer scan's carry changed dtype."""
    x = bf16((3, 4), "a b")
    want = jop(jnp.asarray(x.data)).dtype
    assert want == BF16
    assert op(x).dtype == want  # eager NumPy
    assert op(nm.tensor(jnp.asarray(x.data), "a b")).dtype == want  # eager jax


def _oracle(a, b):
    return np.einsum("ik,kj->ij", a.data.astype(np.float64), b.data.astype(np.float64))


def test_einsum_sums_bfloat16_products_in_float32():
    a, b = bf16((4, 64), "i k"), bf16((64, 6), "k j")
    want = _oracle(a, b)
    f = lambda a, b: nm.einsum(a, b, out="i j", preferred_element_type=np.float32)
    mesh = Mesh({"rows": 2, "cols": 2})
    lowered = lower(f, mesh, "k:rows,cols")  # the contracted dim split: a float32 psum
    runs = {
        "numpy": f(a, b),
        "jax": f(*(nm.tensor(jnp.asarray(t.data), t.dims) for t in (a, b))),
        "lowered": lowered(a, b),
    }
    for name, got in runs.items():
        assert got.dtype == np.float32, name
        np.testing.assert_allclose(np.asarray(got.data), want, rtol=1e-5, atol=1e-5, err_msg=name)
    plan = lowered.plan(a, b)
    assert "psum" in str(plan)
    rep = lowered.report(a, b, show=False)
    assert rep.collectives[("psum", ("rows", "cols"))][1] == pytest.approx(2 * 3 / 4 * 4 * 6 * 4)
    assert nm.einsum(a, b, out="i j").dtype == BF16  # without it: bf16, like jnp


@pytest.mark.parametrize(
    "kw, error, word",
    [
        ({"preferred_element_type": np.int32}, nm.DtypeError, "int32"),
        ({"precision": "best"}, nm.ParameterError, "best"),
    ],
)
def test_einsum_bad_accumulation_is_a_typed_error(kw, error, word):
    a = bf16((2, 3), "i k")
    with pytest.raises(error, match=word):
        nm.einsum(a, a.rename(i="j"), out="i j", **kw)


def _einsum_dtypes(graph, inside=False):
    """(operand dtypes, in the layer scan?) of every einsum in a graph and its scans."""
    for e in graph.eqns:
        if e.primitive.name == "scan":
            yield from _einsum_dtypes(e.params["body"], True)
        elif e.primitive.name == "einsum":
            yield tuple(np.dtype(v.dtype) for v in e.inputs), inside


def test_bfloat16_lm_is_numpy_within_bfloat16_rounding():
    cfg = CFG.replace(dtype="bfloat16")
    params = transformer.init(transformer.lm_shapes(cfg), 0)
    tokens = nm.tensor(small_batch(cfg)["inputs"], ("batch", "length"))
    got = jax.jit(lambda p, t: transformer.lm_logits(p, t, cfg))(params, tokens)
    assert got.dtype == np.float32  # the loss's statistics stay float32
    want = np_lm_logits(params, tokens.data, cfg)
    err = np.abs(np.asarray(got.data) - want)
    assert err.max() < 0.1 and err.mean() < 0.02  # bf16 keeps 8 bits of mantissa
    graph = nm.trace(lambda p, t: transformer.lm_logits(p, t, cfg), params, tokens)
    layer = [dts for dts, inside in _einsum_dtypes(graph) if inside]
    assert layer and all(dts == (BF16, BF16) for dts in layer)


def _model_batch(name, cfg):
    model = zoo.get(name)
    cfg = model.configure(cfg)
    params = transformer.init(model.shapes(cfg), 0)
    batch = objectives.abstract_batch(model.objective, cfg.batch, cfg.length)
    r = np.random.default_rng(0)
    batch = {
        k: nm.tensor(
            r.integers(0, cfg.vocab, v.shape).astype(v.dtype)
            if np.issubdtype(v.dtype, np.integer)
            else np.ones(v.shape, v.dtype),
            v.dims,
        )
        for k, v in batch.items()
    }
    return model, cfg, params, batch


def _loss_and_grads(cfg, mesh, layout):
    model, cfg, params, batch = _model_batch("lm", cfg)
    f = lower(lambda p, b: model.loss(p, b, cfg, None), mesh, layout)
    return jax.jit(jax.value_and_grad(lambda p, b: f(p, b).data))(params, batch)


@pytest.mark.parametrize("name", ["moe", "encdec", "bert"])
def test_bfloat16_zoo_loss_is_float32_within_rounding(name):
    """Each model's scan carries keep bf16 (the MoE's routing, the encoder's memory)."""
    losses = []
    for dtype in ("float32", "bfloat16"):
        model, cfg, params, batch = _model_batch(name, CFG.replace(dtype=dtype))
        loss = jax.jit(lambda p, b, cfg=cfg, model=model: model.loss(p, b, cfg, None).data)
        value = loss(params, batch)
        assert value.dtype == np.float32
        losses.append(float(value))
    assert abs(losses[1] - losses[0]) < 0.01 * abs(losses[0])


def test_bfloat16_training_step_is_float32_within_rounding():
    """LM loss and gradients in bf16 under a 2x2 layout against the same model in float32:
    gradients float32, the loss within 1%, each gradient pointing the same way."""
    mesh, layout = Mesh({"rows": 2, "cols": 2}), "batch:rows;heads:cols;d_ff:cols"
    cfg = CFG.replace(length=8, batch=4)
    loss32, g32 = _loss_and_grads(cfg, mesh, layout)
    loss16, g16 = _loss_and_grads(cfg.replace(dtype="bfloat16"), mesh, layout)
    assert loss16.dtype == np.float32
    assert abs(float(loss16) - float(loss32)) < 0.01 * abs(float(loss32))
    for a, b in zip(jax.tree.leaves(g32), jax.tree.leaves(g16), strict=True):
        assert b.dtype == np.float32
        a, b = np.ravel(np.asarray(a, np.float64)), np.ravel(np.asarray(b, np.float64))
        if np.linalg.norm(a) > 1e-6:
            assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.98


def test_unknown_compute_dtype_is_refused_by_config_naming_it():
    with pytest.raises(config.ConfigError, match="Config.dtype .*'float16'"):
        catalog.get("tiny", dtype="float16")
