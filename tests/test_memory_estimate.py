"""The lowering report's training-step peak-memory estimate against what XLA reserves
for the compiled step (`memory_analysis()`: arguments + outputs + temporaries - aliased),
within 25%, for the LM under full and blockwise attention, remat none and full, the
layers one loop and unrolled, on one device and a 2x4 layout (the rows of
benchmarks/long_seq.py, at a short length)."""

import jax
import numpy as np
import pytest

import namedmesh as nm
from benchmarks.step_memory import NOT_RUN, xla_bytes
from lowering import Mesh, lower
from models import catalog, transformer

LENGTH = 64
LAYOUTS = {
    "one device": ({"one": 1}, ""),
    "2x4": ({"rows": 2, "cols": 4}, "length:rows;heads:cols;d_ff:cols;vocab:cols"),
}


@pytest.mark.parametrize(
    "attention, remat, layout, scan_layers, length",
    [("full", "none", "one device", True, LENGTH),
     ("blockwise", "full", "one device", "auto", LENGTH),
     ("blockwise", "none", "2x4", "auto", LENGTH),
     # the fused kernel runs flash on CPU from 512 tokens, which keeps its exp tiles for
     # the backward pass (namedmesh.flash.kept_logits): the estimate counts them
     ("fused", "none", "one device", "auto", 512)],
)  # fmt: skip
def test_training_peak_estimate_is_within_25_percent_of_xla(attention, remat, layout, scan_layers,
                                                            length):  # fmt: skip
    # "auto" keeps a loop under remat and unrolls this stack without it: the estimate
    # models each as it runs (lowering/memory.py)
    cfg = catalog.get("tiny", length=length, batch=1, attention=attention, remat=remat)
    cfg = cfg.replace(attention_block=32, scan_layers=scan_layers)
    sizes, rules = LAYOUTS[layout]
    # zeros: the memory does not depend on the values (drawing them compiles per shape)
    params = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype),
                                    transformer.abstract(transformer.lm_shapes(cfg)))  # fmt: skip
    tok = np.random.default_rng(0).integers(0, cfg.vocab, (1, length + 1)).astype(np.int32)
    batch = {
        "inputs": nm.tensor(tok[:, :-1], "batch length"),
        "targets": nm.tensor(tok[:, 1:], "batch length"),
        "weights": nm.tensor(np.ones((1, length), np.float32), "batch length"),
    }
    lowered = lower(lambda p, b: transformer.lm_loss(p, b, cfg), Mesh(sizes), rules)
    estimate = lowered.report(params, batch, wrt=0, show=False).peak_memory
    step = jax.jit(jax.value_and_grad(lambda p, b: lowered(p, b).data))
    xla = xla_bytes(step.lower(params, batch).compile(compiler_options=NOT_RUN))
    assert 0.75 <= estimate / xla <= 1.25, (estimate, xla)


def test_an_unknown_backward_reads_is_refused_at_registration():
    from namedmesh.primitive import REGISTRY, primitive

    with pytest.raises(ValueError, match="'probe_op'.*backward_reads"):
        primitive("probe_op", None, None, None, backward_reads="sometimes")
    assert "probe_op" not in REGISTRY


@pytest.mark.parametrize(
    "name", ["gelu", "silu", "tanh", "exp", "sigmoid", "rsqrt", "square", "softmax", "log_softmax"]
)
def test_declared_backward_reads_match_the_residuals_jax_saves(name):
    """For ops whose result has their input's shape: the input-sized values jax's
    autodiff saves for the op's jax implementation (jax.ad_checkpoint's report of saved
    residuals) are as many as the primitive declares (input, output, and its own)."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals

    from namedmesh.primitive import REGISTRY

    prim = REGISTRY[name]
    x = np.linspace(0.1, 2.0, 64 * 32, dtype=np.float32).reshape(64, 32)
    if prim.elementwise:
        f = lambda a: prim.jax_impl(a, in_dims=(("a", "b"),), out_dims=("a", "b")).sum()
    else:
        f = lambda a: prim.jax_impl(a, axes=(1,)).sum()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(f, x)
    saved = sum(line.startswith("f32[64,32]") for line in out.getvalue().splitlines())
    reads = prim.backward_reads
    declared = (reads in ("inputs", "both")) + (reads in ("output", "both")) + prim.backward_saves
    assert saved == declared, out.getvalue()
