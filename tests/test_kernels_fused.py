"""The fused kernel (attention='fused': nm.dot_product_attention, run by
jax.nn.dot_product_attention): values against NumPy and gradients against plain
jax.numpy with causal masks, windows, grouped heads and bias tensors; the LM's loss and
gradients equal full attention's under layouts that split batch and heads, and one
that splits length (relaid out whole for the kernel); what it cannot do refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, lower
from models import transformer
from models.architecture import Config, ConfigError
from models.families.gemma2 import Softcaps
from models.layers import kernels
from models.layers.common import attention_kernel, kernel_name
from models.layers.kernels import KERNELS, Options
from tests.test_kernels_skip import KD, QD, SIZES, allowed, mask_fn, reference
from tests.test_models import CFG, small_batch

R = np.random.default_rng(9)
CASES = {  # name: (causal, window, bias dims)
    "causal, grouped heads": (True, 0, None),
    "causal + window, padding bias": (True, 3, ("batch", "memory")),
    "window alone, per-head relative bias": (False, 3, ("kv_heads", "length", "memory")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_equals_numpy_values_and_jnp_gradients(case):
    causal, window, bias_dims = CASES[case]
    sizes = {**SIZES, "length": 8, "memory": 8}
    q, k, v = (R.normal(size=[sizes[d] for d in dims]).astype(np.float32) for dims in (QD, KD, KD))
    order = ("batch", "kv_heads", "length", "memory")
    bias, b_t = np.zeros([sizes[d] for d in order], np.float32), None
    if bias_dims:
        b = R.normal(size=[sizes[d] for d in bias_dims]).astype(np.float32)
        b_t = nm.tensor(jnp.asarray(b), bias_dims)
        shape = [sizes[d] if d in bias_dims else 1 for d in order]
        perm = [bias_dims.index(d) for d in order if d in bias_dims]
        bias = bias + b.transpose(perm).reshape(shape)
    ok = allowed(8, causal, window)
    opts = Options(b_t, mask_fn(causal, window), 0.5, causal=causal, window=window, masks_only=True)

    def kernel(q, k, v):
        t = nm.tensor
        return KERNELS["fused"].fn(t(q, QD), t(k, KD), t(v, KD), opts).transpose(*QD).data

    want = reference(q, k, v, bias, ok, 0.5, 0.0, np)
    w = R.normal(size=want.shape).astype(np.float32)

    def value_and_grads(f):
        out, back = jax.vjp(f, q, k, v)
        return out, back(w)

    got, grads = jax.jit(lambda: value_and_grads(kernel))()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    ref = lambda q, k, v: reference(q, k, v, jnp.asarray(bias), ok, 0.5, 0.0, jnp)
    for g, e in zip(grads, value_and_grads(ref)[1], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-5)


LAYOUTS = {
    "batch and heads split": ({"rows": 2, "cols": 2}, "batch:rows;heads:cols"),
    "length split": ({"rows": 2}, "length:rows"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_lm_equals_full_attention_under_layouts(layout):
    sizes, rules = LAYOUTS[layout]
    cfg = CFG.replace(layers=1, sliding_window=5)
    params = transformer.init(transformer.lm_shapes(cfg), 0)
    batch = {k: nm.tensor(v, ("batch", "length")) for k, v in small_batch(cfg).items()}
    kinds = [cfg.replace(attention=a) for a in ("full", "fused")]
    both = lambda p, b: [transformer.lm_loss(p, b, c) for c in kinds]
    f = lower(both, Mesh(sizes), rules)
    each = lambda p, b: [jax.value_and_grad(lambda p, i=i: f(p, b)[i].data)(p) for i in (0, 1)]
    (full, g_full), (fused, g_fused) = jax.jit(each)(params, batch)  # one compile
    np.testing.assert_allclose(fused, full, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_fused), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "change, option",
    [({"parts": Softcaps(attention_softcap=5.0)}, "softcap"), ({"relative_bias": 4}, "positional")],
)
def test_fused_refuses_what_it_cannot_do_by_name(change, option):
    cfg = CFG.replace(attention="fused", layers=1, **change)
    params = transformer.init(transformer.lm_shapes(cfg), 0)
    batch = {k: nm.tensor(v, ("batch", "length")) for k, v in small_batch(cfg).items()}
    with pytest.raises(ConfigError, match=f"attention='fused' with {option}"):
        transformer.lm_loss(params, batch, cfg)


def test_fused_t5_buckets_and_padding_as_bias_tensors_equal_full_attention():
    """T5's relative buckets (a bias tensor over heads, length and memory) and the
    encoder's padding (over batch and memory, in cross-attention too) go to the fused
    kernel as its bias: the encoder-decoder's loss equals full attention's."""
    cfg = CFG.replace(
        positions="none", relative_buckets=8, relative_max_distance=16, layers=1
    ).replace(attention_scale=False)
    params = transformer.init(transformer.encdec_shapes(cfg), 0)
    r = np.random.default_rng(3)
    tok = lambda: nm.tensor(r.integers(0, cfg.vocab, (4, 8)).astype(np.int32), "batch length")
    weights = np.ones((4, 8), np.float32)
    weights[1, 5:] = 0  # a padded encoder row
    batch = {"inputs": tok(), "decoder_inputs": tok(), "targets": tok()}
    batch["input_weights"] = nm.tensor(weights, "batch length")
    batch["weights"] = nm.tensor(np.ones((4, 8), np.float32), "batch length")
    losses = jax.jit(
        lambda p, b: [
            transformer.encdec_loss(p, b, cfg.replace(attention=a)).data for a in ("full", "fused")
        ]
    )(params, batch)
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


def test_fused_on_numpy_low_precision_and_integers_computes_in_float():
    """NumPy has no bfloat16 einsum and a softmax of integers is a float: bfloat16 and
    float16 are summed in float32 and rounded once, ints and bools give float32, each
    equal to a float32 NumPy softmax (the dtype rule float_valued ops share)."""
    cases = ((jnp.bfloat16, jnp.bfloat16, 1e-2), (np.float16, np.float16, 1e-3),
             (np.int32, np.float32, 1e-6), (bool, np.float32, 1e-6))  # fmt: skip
    for dt, want_dtype, tol in cases:
        q, k = ((R.normal(size=(2, 4, 8)) * 2).astype(dt) for _ in range(2))
        got = nm.dot_product_attention(
            nm.tensor(q, "heads length d_kv"), nm.tensor(k, "heads memory d_kv"),
            nm.tensor(k, "heads memory d_kv"), scale=0.25, causal=True,
        )  # fmt: skip
        q32, k32 = q.astype(np.float32), k.astype(np.float32)
        s = np.einsum("hld,hmd->hlm", q32, k32) * 0.25
        s = np.where(np.tril(np.ones((4, 4), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        want = np.einsum("hlm,hmd->hld", p / p.sum(-1, keepdims=True), k32)
        assert got.data.dtype == want_dtype, dt
        np.testing.assert_allclose(np.asarray(got.data, np.float32), want, rtol=tol, atol=tol)


def cli_choices(flag: str) -> tuple:
    """The values `namedmesh train` offers for `flag`."""
    from models.cli import train

    (action,) = [a for a in train.parser()._actions if flag in a.option_strings]
    return tuple(action.choices)


def test_every_cli_dtype_works_with_every_attention_kernel(monkeypatch):
    """Issue 38: each --dtype with each --attention (the fused kernel both ways on CPU:
    XLA's below attention.FLASH_FROM tokens, flash from it as "auto" picks it), rotary
    positions (q and k rotated in float32 beside bfloat16 values: the fused kernel's
    traceback) and a
    sliding window: the LM's loss and gradients equal float32 full attention's to the
    dtype's rounding, or Config refuses the pair naming both."""
    from namedmesh import attention

    base = CFG.replace(layers=1, positions="rotary", sliding_window=5)
    params = transformer.init(transformer.lm_shapes(base), 0)
    batch = {k: nm.tensor(v, ("batch", "length")) for k, v in small_batch(base).items()}
    runs = [(base.replace(attention="full"), attention.FLASH_FROM)]  # the oracle
    for dtype in cli_choices("--dtype"):
        for kernel in cli_choices("--attention"):
            try:
                cfg = base.replace(dtype=dtype, attention=kernel)
            except ConfigError as e:  # refused: by name
                assert dtype in str(e) and kernel in str(e), e
                continue
            # fused with XLA's kernel (below FLASH_FROM); "auto" picks fused at these 8
            # tokens with FUSED_FROM and FLASH_FROM at 4: flash's row blocks, by the rule
            runs += [(cfg, attention.FLASH_FROM)] if kernel == "fused" else [(cfg, 4)]

    def each(p, b):
        out = []
        for cfg, flash_from in runs:  # "auto"s read these as each loss is traced
            monkeypatch.setattr(attention, "FLASH_FROM", flash_from)
            # attention="auto" picks the fused kernel here (flash's row blocks)
            monkeypatch.setattr(kernels, "FUSED_FROM", flash_from)
            out.append(jax.value_and_grad(lambda p, c=cfg: transformer.lm_loss(p, b, c).data)(p))
        return out

    (want, g_want), *got = jax.jit(each)(params, batch)  # one compile
    assert len(got) == len(cli_choices("--dtype")) * len(cli_choices("--attention"))
    for (cfg, flash_from), (loss, grads) in zip(runs[1:], got, strict=True):
        tol = 1e-5 if cfg.dtype == "float32" else 2e-2
        what = f"{cfg.dtype} {cfg.attention} {flash_from}"
        np.testing.assert_allclose(loss, want, rtol=tol, err_msg=what)
        for a, b in zip(jax.tree.leaves(g_want), jax.tree.leaves(grads), strict=True):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_allclose(b, a, atol=30 * tol * np.abs(a).max(), err_msg=what)


def test_auto_picks_fused_by_length_where_it_implements_the_options():
    """attention="auto" (the default) resolves where the queries' length is known: full
    attention below kernels.FUSED_FROM, the fused kernel from it, and full attention
    whatever the length when the call asks what the fused kernel refuses (a soft-cap,
    a positional bias) or runs over a KV cache; an explicit kernel is never swapped."""
    cfg = CFG.replace(attention="auto")
    assert Config().attention == "auto"
    n = kernels.FUSED_FROM
    masks = {"bias_fn": mask_fn(True, 0), "causal": True, "masks_only": True}
    assert kernel_name(cfg, Options(**masks), n - 1) == "full"
    assert kernel_name(cfg, Options(**masks), n) == "fused"
    for asks in ({"softcap": 5.0}, {"masks_only": False}, {"cached": True}):
        assert kernel_name(cfg, Options(**{**masks, **asks}), 4 * n) == "full", asks
    assert kernel_name(cfg.replace(attention="full"), Options(**masks), 4 * n) == "full"
    assert attention_kernel(cfg.replace(length=n)) == f"auto (fused at {n} tokens)"
    gemma = cfg.replace(length=n, parts=Softcaps(attention_softcap=5.0))
    assert attention_kernel(gemma) == f"auto (full at {n} tokens)"
    assert attention_kernel(cfg.replace(attention="blockwise")) == "blockwise"
    # a layout that splits the queries' length keeps full attention (the fused kernel's
    # rule would gather the sequence whole on every device); one that does not, fused
    picked = []

    def attend(x):
        picked.append(kernel_name(cfg, Options(**masks), x.size_of("length")))
        return x

    x = nm.tensor(np.zeros((2, n), np.float32), ("batch", "length"))
    for layout in ("length:data", "batch:data"):
        lower(attend, Mesh({"data": 2}), layout).report(x, show=False)
    assert picked == ["full", "fused"]
