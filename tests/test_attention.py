"""Blockwise attention (models/layers/blockwise.py) against full attention written in plain
jax.numpy: values and gradients with causal, padding, relative and per-head biases,
rotated queries and keys, grouped heads; and the LM with blockwise attention (and
remat) against the LM with full attention under every layout the model tests use."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, lower
from lowering.hlo import collectives
from models import transformer
from models.architecture import Config, ConfigError
from models.layers.blockwise import Options, blockwise_attend, ring_attend
from tests.test_models import CFG, LAYOUTS, small_batch

R = np.random.default_rng(11)
SIZES = {"batch": 2, "heads": 3, "length": 8, "memory": 8, "d_kv": 4}


def rotary(x, axis_len):
    """Rotary position embedding of the last dim (pairs rotated by position), NumPy."""
    half = x.shape[-1] // 2
    pos = np.arange(x.shape[axis_len])[:, None] * (1e-2 ** (np.arange(half) / half))
    shape = [1] * x.ndim
    shape[axis_len], shape[-1] = x.shape[axis_len], half
    cos, sin = np.cos(pos).reshape(shape), np.sin(pos).reshape(shape)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1).astype(np.float32)


def arr(dims):
    return R.normal(size=[SIZES[d] for d in dims]).astype(np.float32)


def bias_array(dims):
    """A bias over `dims`: causal where it has length and memory, padding where it has
    batch and memory (the last 3 positions of row 1), else learned-like values."""
    b = arr(dims) * 0.5
    full = np.zeros([SIZES[d] for d in ("batch", "heads", "length", "memory")], np.float32)
    if "length" in dims and "memory" in dims:
        full += np.where(np.tril(np.ones((8, 8), bool)), 0.0, -1e9)
    if "batch" in dims and "memory" in dims:
        full[1, :, :, -3:] += -1e9
    order = ("batch", "heads", "length", "memory")
    kept = full[tuple(slice(None) if d in dims else 0 for d in order)]
    return b + kept.transpose([[d for d in order if d in dims].index(d) for d in dims])


QD, KD = ("batch", "length", "heads", "d_kv"), ("batch", "memory", "heads", "d_kv")


def jnp_attention(q, k, v, bias, bias_dims, scale):
    """Full attention on positional arrays q (b l h k), k/v (b m h k): the oracle."""
    logits = jnp.einsum("blhk,bmhk->bhlm", q, k) * scale
    if bias is not None:
        order = [d for d in ("batch", "heads", "length", "memory") if d in bias_dims]
        b = jnp.transpose(bias, [bias_dims.index(d) for d in order])
        shape = [SIZES[d] if d in bias_dims else 1 for d in ("batch", "heads", "length", "memory")]
        logits = logits + b.reshape(shape)
    return jnp.einsum("bhlm,bmhk->blhk", jax.nn.softmax(logits, -1), v)


@pytest.mark.parametrize(
    "bias_dims, block",
    [
        (None, 8),  # one block
        (("length", "memory"), 2),  # causal
        (("batch", "memory"), 4),  # padding
        (("heads", "length", "memory"), 2),  # relative position bias
        (("memory", "batch", "heads", "length"), 2),  # all, in another order
        (("heads",), 4),  # no memory: added to every block
        (("length", "memory"), 3),  # causal, 8 keys in blocks 3, 3, 2 (+1 masked slot)
        (("batch", "memory"), 5),  # padding, 8 keys in blocks 5, 3 (+2 masked slots)
    ],
)
def test_blockwise_equals_full_attention_values_and_gradients(bias_dims, block):
    q, k, v = rotary(arr(QD), 1), rotary(arr(KD), 1), arr(KD)
    bias = None if bias_dims is None else bias_array(bias_dims)
    scale = 0.5

    def ours(q, k, v, b):
        bt = None if b is None else nm.tensor(b, bias_dims)
        opts = Options(bt, scale=scale, block=block)
        out = blockwise_attend(nm.tensor(q, QD), nm.tensor(k, KD), nm.tensor(v, KD), opts)
        return out.transpose(*QD).data

    def oracle(q, k, v, b):
        return jnp_attention(q, k, v, b, bias_dims, scale)

    args = [jnp.asarray(a) for a in (q, k, v)] + [None if bias is None else jnp.asarray(bias)]
    np.testing.assert_allclose(jax.jit(ours)(*args), oracle(*args), rtol=1e-5, atol=1e-5)
    cot = jnp.asarray(arr(QD))
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    grad = lambda f: jax.grad(lambda *a: (f(*a) * cot).sum(), argnums=argnums)
    got, want = jax.jit(grad(ours))(*args), grad(oracle)(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_blockwise_matches_grouped_heads_by_name():
    """k and v lack q's q_per_kv dim (grouped-query attention): matched by name."""
    q = nm.tensor(R.normal(size=(2, 8, 2, 3, 4)).astype(np.float32), "batch length kv q d_kv")
    k = nm.tensor(R.normal(size=(2, 8, 2, 4)).astype(np.float32), "batch memory kv d_kv")
    v = nm.tensor(R.normal(size=(2, 8, 2, 4)).astype(np.float32), "batch memory kv d_kv")
    got = blockwise_attend(q, k, v, Options(block=4)).transpose(*q.dims).data
    logits = np.einsum("blgqk,bmgk->bgqlm", q.data, k.data)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("bgqlm,bmgk->blgqk", w / w.sum(-1, keepdims=True), v.data)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_blockwise_errors_name_the_fault():
    q, k = nm.tensor(arr(QD), QD), nm.tensor(arr(KD), KD)
    with pytest.raises(nm.ShapeError, match="block 0 must be positive .*--attention-block"):
        blockwise_attend(q, k, k, Options(block=0))
    with pytest.raises(nm.ShapeError, match="lacks"):
        blockwise_attend(q.rename(length="l"), k, k, Options())
    with pytest.raises(nm.ShapeError, match="bias dim"):
        blockwise_attend(q, k, k, Options(nm.tensor(np.zeros(3, np.float32), "other")))


def _lm_value_and_grads(cfg, mesh, layout, hlo=False):
    """The LM's loss and gradients under `layout`; with `hlo`, also the compiled step's
    text (the same compile)."""
    params = transformer.init(transformer.lm_shapes(cfg), 0)
    batch = {k: nm.tensor(v, ("batch", "length")) for k, v in small_batch(cfg).items()}
    f = lower(lambda p, b: transformer.lm_loss(p, b, cfg), mesh, layout)
    step = jax.jit(jax.value_and_grad(lambda p, b: f(p, b).data)).lower(params, batch).compile()
    return (*step(params, batch), step.as_text()) if hlo else step(params, batch)


LM_CFG = CFG.replace(relative_bias=4, attention_block=4, layers=1, batch=8)
SEQ = ({"rows": 2, "cols": 2}, "ring:rows;length:rows;memory:rows;heads:cols")  # sequence parallel


@pytest.mark.parametrize("name", [*sorted(LAYOUTS), "length"])
def test_blockwise_lm_loss_equals_full_attention_under_every_layout(name):
    sizes, layout = SEQ if name == "length" else LAYOUTS[name]
    cfg = LM_CFG.replace(layers=sizes.get("stage", 1))  # a pipeline: one layer per stage
    params = transformer.init(transformer.lm_shapes(cfg), 0)
    batch = {k: nm.tensor(v, ("batch", "length")) for k, v in small_batch(cfg).items()}
    kinds = [cfg.replace(attention=a) for a in ("full", "blockwise", "ring")]
    every = lambda p, b: [transformer.lm_loss(p, b, c) for c in kinds]
    full, block, ring = lower(every, Mesh(sizes), layout)(params, batch)  # one compile
    np.testing.assert_allclose(np.asarray(block.data), np.asarray(full.data), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ring.data), np.asarray(full.data), rtol=1e-5)


@pytest.fixture(scope="module")
def two_layers():
    """(config, mesh, layout, the 2-layer LM's loss, gradients and compiled text with
    full attention in a layer loop): the oracle of the next two tests, compiled once."""
    mesh, layout = Mesh(LAYOUTS["model"][0]), LAYOUTS["model"][1]
    cfg = LM_CFG.replace(layers=2)
    return cfg, mesh, layout, _lm_value_and_grads(cfg.replace(scan_layers=True), mesh, layout, True)


def test_blockwise_lm_gradients_with_remat_equal_full_attention(two_layers):
    cfg, mesh, layout, (want, g_full, _) = two_layers
    got, g_block = _lm_value_and_grads(
        cfg.replace(attention="blockwise", remat="full"), mesh, layout
    )
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_block), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_unrolled_layers_keep_the_lm_values_and_gradients(two_layers):
    """Config.scan_layers's default, "auto", unrolls a 2-layer LM (no while loop left in
    the compiled step; nm.scan's unroll="auto" rule, tests/test_remat.py) with the loss
    and gradients of the layers as one loop (scan_layers=True, which equals
    transformers' models in tests/test_hub.py), under a layout."""
    cfg, mesh, layout, (want, g_scan, looped) = two_layers
    assert cfg.scan_layers == "auto"
    got, g_unrolled, unrolled = _lm_value_and_grads(cfg, mesh, layout, hlo=True)
    assert " while(" in looped and " while(" not in unrolled
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_scan), jax.tree.leaves(g_unrolled), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


RING = Mesh({"rows": 4})
RING_LAYOUT = "ring:rows;length:rows;memory:rows"


def test_ring_attention_sends_keys_and_values_around_the_ring():
    """Under a layout splitting `ring`: values and gradients of full attention (causal by
    bias_fn, padding rotating with the keys), only ppermutes, and per device
    (n-1)/n of its keys and values (plus their positions and padding) sent."""
    q, k, v = arr(QD), arr(KD), arr(KD)
    pad = bias_array(("batch", "memory"))
    causal = lambda queries, slots: nm.where(slots <= queries, 0.0, -1e9)

    def ours(q, k, v, pad):
        out = ring_attend(q, k, v, Options(pad, causal, 0.5), 4)
        return out.transpose(*QD)

    lowered = lower(ours, RING, RING_LAYOUT)
    args = [nm.tensor(a, d) for a, d in ((q, QD), (k, KD), (v, KD), (pad, ("batch", "memory")))]
    bias = pad[:, None, None, :] + np.where(np.tril(np.ones((8, 8), bool)), 0.0, -1e9)
    bias = np.broadcast_to(bias, (2, 3, 8, 8)).astype(np.float32)
    want = jnp_attention(q, k, v, bias, ("batch", "heads", "length", "memory"), 0.5)
    np.testing.assert_allclose(np.asarray(lowered(*args).data), want, rtol=1e-5, atol=1e-5)
    cot = arr(QD)
    got = jax.grad(lambda *a: (lowered(*a).data * cot).sum(), argnums=(0, 1, 2))(*args)
    oracle = lambda q, k, v: (
        jnp_attention(q, k, v, bias, ("batch", "heads", "length", "memory"), 0.5) * cot
    ).sum()
    for g, w in zip(got, jax.grad(oracle, argnums=(0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_allclose(g.data, w, rtol=1e-5, atol=1e-5)
    n = 4
    kv_block = 2 * (SIZES["batch"] * 2 * SIZES["heads"] * SIZES["d_kv"] * 4)  # k and v
    side = SIZES["batch"] * 2 * 4 + 2 * 4  # the padding's and the positions' block
    sent = lowered.report(*args, show=False).collectives
    assert set(sent) == {("ppermute", ("rows",))}
    assert sent[("ppermute", ("rows",))][1] == (n - 1) * (kv_block + side)
    kv_total = 2 * SIZES["batch"] * SIZES["memory"] * SIZES["heads"] * SIZES["d_kv"] * 4
    assert (n - 1) * kv_block == kv_total * (n - 1) // n  # (n-1)/n of k and v
    hlo = collectives(lowered.compile(*args).as_text())
    assert {kind for kind, *_ in hlo} == {"collective-permute"}
    assert sorted(b for _, b, _ in hlo) == sorted(
        [kv_block // 2] * 2 + [SIZES["batch"] * 2 * 4, 2 * 4]
    )


def test_ring_errors_name_the_fault():
    q, k = nm.tensor(arr(QD), QD), nm.tensor(arr(KD), KD)
    with pytest.raises(nm.ShapeError, match="ring 3 must divide length=8.*--attention-block"):
        ring_attend(q, k, k, Options(), 3)
    whole = nm.tensor(np.zeros((8, 8), np.float32), "length memory")
    with pytest.raises(nm.ShapeError, match="bias_fn"):
        ring_attend(q, k, k, Options(whole), 2)
    for attend in (ring_attend, blockwise_attend):  # the bias where Options go (the old call)
        with pytest.raises(
            nm.ParameterError, match=r"opts must be models.layers.blockwise.Options"
        ):
            attend(q, k, k, whole)


@pytest.mark.parametrize(
    "field,value,named",
    [("attention", "flash", "Config.attention"), ("attention_block", 0, "--attention-block"),
     ("remat", "some", "Config.remat"), ("scan_layers", "no", "Config.scan_layers")],
)  # fmt: skip
def test_bad_long_sequence_options_are_parameter_errors_at_the_config(field, value, named):
    with pytest.raises(nm.ParameterError, match=named) as caught:
        Config(**{field: value})
    assert isinstance(caught.value, ConfigError)


def test_model_options_checked_when_shaped_are_parameter_errors_too():
    with pytest.raises(ConfigError, match="MoE FFN .* no biases: Config.bias"):
        transformer.lm_shapes(Config(experts=4, bias=True))
    with pytest.raises(ConfigError, match="experts_per_token=5 .* experts=4"):
        Config(experts=4, experts_per_token=5)
    with pytest.raises(ConfigError, match="Config.routing"):
        Config(experts=4, routing="dropful")
    with pytest.raises(nm.ParameterError, match="Config.ffn must be one of"):
        transformer.lm_shapes(Config(ffn="gelu2"))


@pytest.mark.parametrize("kernel,block", [("full", 8), ("blockwise", 3), ("ring", 4)])
def test_kernels_soft_cap_and_window_as_numpy(kernel, block):
    """Each kernel with softcap 2 and a sliding window of 3 built from positions (as
    transformer.self_attention_bias makes it), against NumPy: the whole logits, keys in
    blocks of 3 (the cap inside the online softmax), a ring of 2."""
    from models.layers.kernels import KERNELS, Options

    q, k, v = (arr(("heads", n, "d_kv")) for n in ("length", "memory", "memory"))
    i, j = np.arange(8)[:, None], np.arange(8)[None, :]
    allowed = (j <= i) & (j > i - 3)
    logits = 2.0 * np.tanh(np.einsum("hld,hmd->hlm", q, k) * 0.5 / 2.0)
    logits = np.where(allowed, logits, -1e9)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("hlm,hmd->hld", w / w.sum(-1, keepdims=True), v)

    def window(queries, slots):
        ok = (slots <= queries) & (slots > queries - 3)
        return nm.where(ok, 0.0, -1e9)

    t = lambda x, dims: nm.tensor(x, dims)
    opts = Options(bias_fn=window, scale=0.5, softcap=2.0, block=block)
    got = KERNELS[kernel].fn(
        t(q, ("heads", "length", "d_kv")), t(k, ("heads", "memory", "d_kv")),
        t(v, ("heads", "memory", "d_kv")), opts,
    )  # fmt: skip
    np.testing.assert_allclose(got.transpose("heads", "length", "d_kv").data, want, atol=1e-5)


@pytest.mark.parametrize("factor", [1.0, 1.5, "tensor", "traced"])
def test_rotate_equals_the_float64_rotation_by_table_or_traced(factor):
    """models.layers.common.rotate against the rotation in float64 (NumPy): with known
    positions and frequencies its cos and sin are a NumPy table (a float factor or a 0-d
    Tensor's), with a traced factor they are traced ops; both within float32's rounding,
    positions over two dims (packed examples') included."""
    from models.layers import common

    x = nm.tensor(arr(QD), QD)
    at = np.stack([np.arange(8), np.arange(8)[::-1]]).astype(np.int32)
    pos = nm.tensor(at, ("batch", "length"))
    inv64 = np.array([1.0, 0.3, 0.01, 1e-3] * 2)[: SIZES["d_kv"]]
    inv = nm.tensor(inv64.astype(np.float32), ("d_kv",))
    f = 1.0 if factor == 1.0 else 1.5
    angle = at[..., None].astype(np.float64) * inv64.astype(np.float32)
    cos, sin = (np.cos(angle) * f)[:, :, None], (np.sin(angle) * f)[:, :, None]
    h = SIZES["d_kv"] // 2
    xd = x.data.astype(np.float64)
    want = xd * cos + np.concatenate([-xd[..., h:], xd[..., :h]], -1) * sin
    if factor == "traced":
        run = jax.jit(lambda g: common.rotate(x, pos, inv, nm.tensor(g, ())).transpose(*QD).data)
        got = run(np.float32(f))
    else:
        g = nm.tensor(np.float32(f), ()) if factor == "tensor" else factor
        got = common.rotate(x, pos, inv, g).transpose(*QD).data
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
