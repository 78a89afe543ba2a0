"""Every attention kernel with every bias kind (issue 26): blockwise, ring and fused
attention equal full attention (models.layers.attend) with the same bias, whether it
comes as a tensor over any of batch, heads, length and memory or from `bias_fn` of the
positions (a causal mask, a relative bias; under the causal mask blockwise attention
skips the key blocks it hides whole, and the fused kernel applies it itself); a
combination a kernel refuses (a ring with a bias over both length and memory: T5's
buckets, which Config refuses) is a ShapeError."""

import jax.numpy as jnp
import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import namedmesh as nm
from models.attention import blockwise_attend, ring_attend
from models.kernels import KERNELS, Options
from models.layers import attend

BUDGET = settings(max_examples=max(8, settings.default.max_examples // 20))  # eager: slow
BIASES = {  # kind -> the dims of a bias tensor (None: no tensor)
    "none": None,
    "padding": ("batch", "memory"),
    "fixed": ("heads", "length"),
    "t5": ("heads", "length", "memory"),
}
FUNCTIONS = {  # kind -> bias_fn(queries, slots)
    "none": None,
    "causal": lambda q, s: nm.where(q >= s, 0.0, np.float32(-1e9)),
    "relative": lambda q, s: nm.astype(nm.clip(s - q, -2, 2), np.float32) * 0.3,
}
SIZES = {"batch": 2, "heads": 2, "length": 8, "memory": 8, "d_kv": 4}


def tensor(dims, r):
    return nm.tensor(jnp.asarray(r.normal(size=[SIZES[d] for d in dims]), jnp.float32), dims)


@BUDGET
@given(
    st.sampled_from(["blockwise", "ring", "fused"]),
    st.sampled_from(list(BIASES)),
    st.sampled_from(list(FUNCTIONS)),
    st.sampled_from([1, 2, 3, 4, 8]),
    st.integers(0, 2**31 - 1),
)
def test_every_kernel_with_every_bias_kind_equals_full_attention(kernel, bias, fn, block, seed):
    assume(not (kernel == "fused" and fn == "relative"))  # refused: Options.masks_only
    r = np.random.default_rng(seed)
    q = tensor(("batch", "length", "heads", "d_kv"), r)
    k, v = (tensor(("batch", "memory", "heads", "d_kv"), r) for _ in range(2))
    b = None if BIASES[bias] is None else tensor(BIASES[bias], r)
    bias_fn = FUNCTIONS[fn]
    full = b
    if bias_fn is not None:
        more = bias_fn(nm.arange("length", 8), nm.arange("memory", 8))
        full = more if full is None else full + more
    want = attend(q, k, v, full, 0.5)
    try:
        if kernel == "blockwise":  # causal: the key blocks the mask hides are skipped
            got = blockwise_attend(q, k, v, b, 0.5, block, bias_fn, causal=fn == "causal")
        elif kernel == "fused":  # the causal mask applied by the kernel itself
            causal = fn == "causal"
            opts = Options(b, bias_fn, 0.5, causal=causal, masks_only=True)
            got = KERNELS["fused"].fn(q, k, v, opts)
        else:
            got = ring_attend(q, k, v, b, 0.5, 8 // block if 8 % block == 0 else 2, bias_fn)
    except nm.ShapeError as e:
        assert kernel == "ring" and bias == "t5", e
        assert "bias over both length and memory" in str(e)
        return
    assert not (kernel == "ring" and bias == "t5")
    np.testing.assert_allclose(np.asarray(got.data), np.asarray(want.data), rtol=1e-5, atol=1e-5)
