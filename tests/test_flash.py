"""namedmesh.flash, the row-block attention kernel nm.dot_product_attention runs on CPU
for long self-attention: values against NumPy's full softmax and gradients (q, k, v and
the bias) against jax's autodiff of the same full softmax, for causal masks, windows,
grouped heads, lengths the row block does not divide, more queries than keys and both
kinds of bias; a row whose keys a bias masks all, against XLA's kernel; bfloat16 through
nm.dot_product_attention; under layouts that split heads; memory linear in length; which
kernel "auto" picks, and an unknown kernel refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh
from namedmesh import attention, flash
from namedmesh.errors import ParameterError
from namedmesh.testing import assert_same_as_reference

R = np.random.default_rng(11)
NEG = -1e9


def reference(q, k, v, bias, causal, window, scale, xp):
    """Full softmax attention on q (h, g, n, d), k and v (h, m, d), bias (h, g, n|1, m),
    written apart from the kernel: the whole (n, m) logits, masked by position (the
    mask replaces logits, as XLA's: a row that sees no key is uniform)."""
    n, m = q.shape[2], k.shape[1]
    i, j = np.arange(n)[:, None], np.arange(m)[None, :]
    ok = np.ones((n, m), bool)
    if causal:
        ok &= j <= i
    if window:
        ok &= j > i - window
    s = xp.einsum("hgnd,hmd->hgnm", q, k) * scale
    if bias is not None:
        s = s + bias
    s = xp.where(ok, s, NEG)
    w = xp.exp(s - s.max(-1, keepdims=True))
    return xp.einsum("hgnm,hmd->hgnd", w / w.sum(-1, keepdims=True), v)


CASES = {  # name: (length, memory, group, block, causal, window, bias rows (0: none))
    "causal, 11 rows in blocks of 4": (11, 11, 1, 4, True, 0, 0),
    "causal + window 3, grouped heads, per-row bias": (12, 12, 2, 4, True, 3, 12),
    "causal + window wider than a block, padding bias": (13, 13, 1, 3, True, 7, 1),
    "window alone (keys after the query too)": (10, 10, 2, 4, False, 4, 0),
    "cross-attention: 6 queries over 9 keys, bias": (6, 9, 1, 4, False, 0, 6),
    # rows 4.. past memory shift by the last key; rows 6.. see no key (uniform)
    "causal + window 3, 9 queries over 4 keys, per-row bias": (9, 4, 2, 3, True, 3, 9),
    # key 6 sees every later row's logit over 88 above the row's own: those blocks'
    # sums overflow when shifted by the own logit, and are computed again by the max
    "causal, key 6 far above the rows' own logits": (11, 11, 1, 4, True, 0, 0),
    "same, window 5 and a per-row bias": (11, 11, 2, 4, True, 5, 11),
}
LOUD_KEY = {"causal, key 6 far above the rows' own logits", "same, window 5 and a per-row bias"}


@pytest.mark.parametrize(
    "tiles", ["whole rows, exp tiles kept", "a block of keys per tile, computed again"]
)
@pytest.mark.parametrize("case", list(CASES))
def test_flash_equals_full_softmax_values_and_gradients(case, tiles, monkeypatch):
    if not tiles.startswith("whole rows"):  # causal rows' keys in tiles of `block` (flash._tiles)
        monkeypatch.setattr(flash, "TILE", 1)
    if tiles.endswith("computed again"):  # the backward pass's logits computed again
        monkeypatch.setattr(flash, "KEEP_BUDGET", 0)
    n, m, g, block, causal, window, bias_rows = CASES[case]
    h, d, scale = 2, 4, 0.6
    q = R.normal(size=(h, g, n, d)).astype(np.float32)
    k, v = (R.normal(size=(h, m, d)).astype(np.float32) for _ in range(2))
    bias = R.normal(size=(h, g, bias_rows, m)).astype(np.float32) if bias_rows else None
    if case in LOUD_KEY:
        q = np.abs(q) + 1
        k[:, 6] = 60.0  # scale * q . k[6] >= 0.6 * 4 * 60 = 144 for every row
    args = (q, k, v, bias)

    def run(q, k, v, bias):
        return flash.attention(q, k, v, bias, scale, causal, window, block)

    def ref(q, k, v, bias):
        return reference(q, k, v, bias, causal, window, scale, jnp)

    want = reference(*args, causal, window, scale, np)
    w = R.normal(size=want.shape).astype(np.float32)

    def value_and_grads(f):  # one compiled program: the values and w's pullback
        out, pull = jax.vjp(f, *args)
        return out, pull(w)

    got, grads = jax.jit(lambda: value_and_grads(run))()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    ref_grads = jax.jit(lambda: value_and_grads(ref)[1])()
    # the backward pass's probabilities are exp(logit - log-sum-exp): logits of 150 are
    # float32's to about 1.5e-5, which the loud key's gradients (k of 60) show
    atol = 1e-4 if case in LOUD_KEY else 1e-5
    for name, a, b in zip("q k v bias".split(), grads, ref_grads, strict=True):
        if b is not None:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), 1e-4, atol, err_msg=name)


def test_a_row_masked_whole_by_its_bias_equals_xlas_kernel():
    """A query whose every key a padding bias of -1e9 hides: its logits round to one
    value, so XLA's softmax is uniform. Its shift (about -1e9) rounds log(keys) away in
    a log-sum-exp, which made each of its probabilities 1, not 1/keys, in the backward
    pass: values and gradients equal XLA's (jax.nn.dot_product_attention's autodiff)."""
    q, k, v = (R.normal(size=(1, 6, 2, 4)).astype(np.float32) for _ in range(3))
    bias = np.zeros((1, 2, 6, 6), np.float32)
    bias[:, :, 3] = NEG  # query 3 sees no key
    w = R.normal(size=q.shape).astype(np.float32)

    def value_and_grads(kernel):
        run = lambda *x: attention.KERNELS[kernel](*x, scale=0.5, causal=True, window=0)
        out, pull = jax.vjp(run, q, k, v, bias)
        return out, pull(w)

    both = jax.jit(lambda: [value_and_grads(name) for name in ("flash", "xla")])()
    (got, grads), (want, xla_grads) = both
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for name, a, b in zip("q k v bias".split(), grads, xla_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


def test_flash_bfloat16_and_float16_through_dot_product_attention():
    """Low-precision q, k, v are computed in float32 and rounded once: the result has
    v's dtype and equals a float32 NumPy softmax of the same (rounded) inputs."""
    dims_q, dims_k = ("heads", "length", "d_kv"), ("heads", "memory", "d_kv")
    for dt in (jnp.bfloat16, np.float16):
        q, k, v = (R.normal(size=(2, 9, 8)).astype(dt) for _ in range(3))
        got = nm.dot_product_attention(
            nm.tensor(jnp.asarray(q), dims_q), nm.tensor(jnp.asarray(k), dims_k),
            nm.tensor(jnp.asarray(v), dims_k), scale=0.3, causal=True, window=4,
            kernel="flash",
        )  # fmt: skip
        f = lambda x: x.astype(np.float32)[:, None]
        want = reference(f(q), f(k)[:, 0], f(v)[:, 0], None, True, 4, 0.3, np)[:, 0]
        assert got.data.dtype == dt
        np.testing.assert_allclose(np.asarray(got.data, np.float32), want, rtol=1e-2, atol=1e-2)


def _grouped(q, k, v, b):
    return nm.dot_product_attention(q, k, v, b, scale=0.5, causal=True, window=5, kernel="flash")


@pytest.mark.parametrize("layout", ["kv_heads:x", "batch:x;kv_heads:y", "q_per_kv:y;length:x"])
def test_flash_under_layouts_equals_numpy(layout, monkeypatch):
    """Grouped heads (q_per_kv), a relative bias over heads, length and memory, rows in
    blocks of 4 (16 positions); heads or batch split over mesh axes, or length split
    (relaid out whole for the kernel): equal to the primitive's NumPy reference."""
    monkeypatch.setattr(flash, "block_for", lambda length, heads: 4)
    qd, kd = (
        ("batch", "length", "kv_heads", "q_per_kv", "d_kv"),
        ("batch", "memory", "kv_heads", "d_kv"),
    )
    sizes = {"batch": 2, "length": 16, "memory": 16, "kv_heads": 2, "q_per_kv": 2, "d_kv": 4}
    t = lambda dims: nm.tensor(R.normal(size=[sizes[d] for d in dims]).astype(np.float32), dims)
    inputs = (t(qd), t(kd), t(kd), t(("kv_heads", "length", "memory")))
    assert_same_as_reference(_grouped, Mesh({"x": 2, "y": 2}), layout, *inputs)


def test_lm_with_flash_equals_full_attention_loss_and_gradients(monkeypatch):
    """The LM with attention='fused' where "auto" picks flash (FLASH_FROM lowered to the
    test's length), under a layout splitting batch and heads: loss and gradients equal
    full attention's."""
    from lowering import lower
    from models import transformer
    from tests.test_models import CFG, small_batch

    monkeypatch.setattr(attention, "FLASH_FROM", 4)
    monkeypatch.setattr(flash, "block_for", lambda length, heads: 6)
    calls, run = [], flash.attention
    monkeypatch.setattr(flash, "attention", lambda *a: calls.append(1) or run(*a))
    cfg = CFG.replace(layers=1, sliding_window=5)
    params = transformer.init(transformer.lm_shapes(cfg), 0)
    batch = {k: nm.tensor(v, ("batch", "length")) for k, v in small_batch(cfg).items()}
    kinds = [cfg.replace(attention=a) for a in ("full", "fused")]
    f = lower(lambda p, b: [transformer.lm_loss(p, b, c) for c in kinds],
              Mesh({"rows": 2, "cols": 2}), "batch:rows;heads:cols")  # fmt: skip
    each = lambda p, b: [jax.value_and_grad(lambda p, i=i: f(p, b)[i].data)(p) for i in (0, 1)]
    (full, g_full), (fused, g_fused) = jax.jit(each)(params, batch)
    assert calls, "attention='fused' did not run the flash kernel"
    np.testing.assert_allclose(fused, full, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_fused), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_flash_training_memory_grows_linearly_in_length(monkeypatch):
    """XLA's memory analysis of the compiled loss and gradients: past flash.KEEP_BUDGET
    (here 0), doubling the length about doubles flash's temporaries (row blocks of fixed
    size; whole logits would grow fourfold), and they stay under the size of one
    (length, memory) logits. Within it the forward pass keeps its exp tiles: at most
    the budget's bytes more."""

    def temp_bytes(kernel, n):
        x = jnp.zeros((n, 2, 16), jnp.float32)
        t = lambda a, dim: nm.tensor(a, (dim, "heads", "d_kv"))

        def loss(q, k, v):
            out = nm.dot_product_attention(
                t(q, "length"), t(k, "memory"), t(v, "memory"), causal=True, kernel=kernel
            )
            return out.data.sum()

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return step.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes

    kept = temp_bytes("flash", 2048)
    monkeypatch.setattr(flash, "KEEP_BUDGET", 0)
    small, large = temp_bytes("flash", 1024), temp_bytes("flash", 2048)
    assert large / small < 2.5, (small, large)
    assert large < 2 * 2048 * 2048 * 4, large  # the logits of 2 heads
    # 2 heads' causal half of 2048 x 2048 in blocks of 256 rows: 36 squares of 256^2
    # (less the buffers of the logits computed again, which the kept pass needs not)
    tiles = 2 * 36 * 256 * 256 * 4
    assert tiles / 2 < kept - large < tiles + large, (kept, large)


def test_auto_picks_flash_for_long_self_attention_on_cpu_only():
    choose = attention.choose_kernel
    long = attention.FLASH_FROM
    assert choose(long, long, "cpu") == "flash"
    assert choose(long // 2, long // 2, "cpu") == "xla"  # short: XLA's is faster
    assert choose(1, long, "cpu") == "xla"  # a decoding step over a cache
    assert choose(long, 2 * long, "cpu") == "xla"
    assert choose(long, long, "gpu") == "xla"  # cuDNN's fused kernel


def test_unknown_kernel_is_refused_by_name():
    x = nm.tensor(np.ones((4, 2), np.float32), ("length", "d_kv"))
    y = nm.rename(x, length="memory")
    with pytest.raises(ParameterError, match=r"kernel='cudnn' is none of 'auto', 'xla', 'flash'"):
        nm.dot_product_attention(x, y, y, kernel="cudnn")
