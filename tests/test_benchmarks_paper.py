"""benchmarks/paper.py (the LM1B models at paper scale, planned without devices) against
counts made by hand from the configs, and benchmarks/gpu.py run once on CPU."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import paper, run
from lowering import Layout, Mesh, lower
from lowering.layout import local_shape
from models import architecture as config
from models import catalog, transformer
from models.training import objectives

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rows():
    return paper.rows()


def _value(rows, case, metric):
    (r,) = [r for r in rows if r["case"] == case and r["metric"] == metric]
    return r


def test_rows_cover_every_lm1b_config_with_the_run_fields(rows):
    lm1b = {name for name in config.CONFIGS if name.startswith("lm1b_")}
    assert {r["case"] for r in rows} == lm1b == set(paper.CONFIGS)
    for r in rows:
        assert set(r) == set(run.FIELDS) and r["bench"] == "paper_scale"
        assert r["gspmd"] is None and r["hand"] is None and r["ratio_to_hand"] is None
        assert math.isfinite(r["namedmesh"]) and r["namedmesh"] > 0, r
    for name in lm1b:
        assert {r["metric"] for r in rows if r["case"] == name} == set(paper.METRICS)
        cfg = catalog.get(name)
        assert _value(rows, name, paper.METRICS[0])["mesh"] == paper.mesh_text(cfg)
        # the parameter count matches tensor2tensor's, to the two digits it gives
        billions = _value(rows, name, "parameters (billions)")["namedmesh"]
        assert round(billions, 2) == config.PAPER_PARAMS[paper._size(name)]


def _single_device_flops(cfg) -> float:
    params = transformer.abstract(transformer.lm_shapes(cfg))
    batch = objectives.abstract_batch("lm", cfg.batch, cfg.length)
    f = lower(
        lambda p, b: transformer.lm_loss(p, b, cfg), Mesh({"batch": 1}, "abstract"), "batch:batch"
    )
    return f.report(params, batch, show=False).flops


def test_data_parallel_forward_flops_match_a_hand_count(rows):
    cfg = catalog.get("lm1b_m1")
    devices = math.prod(n for _, n in cfg.mesh)
    per_device = _value(rows, "lm1b_m1", "forward flops per device")["namedmesh"]
    # batch-splitting divides every op's work except what has no batch dim, which each
    # device repeats: the causal mask (compare + select over length x memory, per layer)
    # and a few scalar ops of the loss mean
    replicated = (per_device * devices - _single_device_flops(cfg)) / (devices - 1)
    assert abs(replicated - 2 * cfg.layers * cfg.length**2) <= 8
    # 2 flops per multiply-add: T tokens through the layers' q, k, v, o, wi, wo and the
    # softmax matrix, plus q·k and weights·v over all `length` positions of each layer
    t, layers, d, hk = cfg.batch * cfg.length, cfg.layers, cfg.d_model, cfg.heads * cfg.d_kv
    matmul_params = layers * (4 * d * hk + 2 * d * cfg.d_ff) + d * cfg.vocab
    hand = 2 * t * matmul_params + 2 * 2 * t * layers * cfg.length * hk
    # the rest is elementwise (norms, ReLU, softmax, residuals, the loss): at most ~10
    # flops for each activation element a token makes, which bounds the excess (under 2%
    # of the matmuls here; the cost model's excess is 0.18%)
    per_token = layers * (6 * d + 2 * cfg.d_ff + 3 * cfg.heads * cfg.length + 4 * hk)
    elementwise_bound = 10 * t * (per_token + 4 * cfg.vocab)
    assert 0 <= per_device * devices - hand <= elementwise_bound
    assert elementwise_bound < 0.02 * hand


def _grad_sync(cfg) -> float:
    """The hand count of the data-parallel gradient all-reduce: each parameter's shard
    summed over the mesh axes that split `batch` and not it, 2(n-1)/n of its bytes."""
    mesh = Mesh(dict(cfg.mesh), devices="abstract")
    layout = Layout(cfg.layout)
    batch_axes = dict(layout.rules).get("batch", ())
    sent = 0.0
    for t in paper._tensors(transformer.abstract(transformer.lm_shapes(cfg))):
        lay = layout.of(t.dims, t.shape, mesh, "parameter")
        used = {a for axes in lay for a in axes}
        n = math.prod(mesh.sizes[a] for a in batch_axes if a not in used)
        sent += 2 * (n - 1) / n * math.prod(local_shape(lay, t.shape, mesh)) * 4
    return sent


def test_collective_bytes(rows):
    fwd = "forward collective bytes per device"
    step = "training-step collective bytes per device (forward + backward)"
    for name in ("lm1b_m1", "lm1b_0"):  # one-axis data parallel
        r = _value(rows, name, fwd)
        # the forward sends only the loss mean's two float32 scalars (+ count), no tensors
        assert r["namedmesh"] < 64 and r["minimum"] == 0 and r["ratio_to_min"] is None
        # the step adds the gradient all-reduce of all parameters, 2(n-1)/n each
        cfg = catalog.get(name)
        n = dict(cfg.mesh)["batch"]
        abstract = transformer.abstract(transformer.lm_shapes(cfg))
        params = sum(math.prod(t.shape) for t in paper._tensors(abstract))
        grad = 2 * (n - 1) / n * 4 * params
        assert _grad_sync(cfg) == pytest.approx(grad)
        assert _value(rows, name, step)["namedmesh"] == pytest.approx(r["namedmesh"] + grad)
    for name in ("lm1b_1", "lm1b_3", "lm1b_5"):  # heads, d_ff and vocab split over `model`
        r = _value(rows, name, fwd)
        assert r["namedmesh"] > 1e8 and r["minimum"] > 0
        # the hand analysis' activation all-reduces, plus per-position loss scalars only
        assert 1.0 <= r["ratio_to_min"] < 1.01, r
        # the backward: the same activation all-reduces again (the replicated inputs'
        # gradients), plus the gradient sync over batch of each device's shards
        want = 2 * r["minimum"] + _grad_sync(catalog.get(name))
        assert _value(rows, name, step)["namedmesh"] == pytest.approx(want, rel=0.01), name


def test_training_flops_and_predictions_follow_their_formulas(rows):
    for name in paper.CONFIGS:
        fwd = _value(rows, name, "forward flops per device")["namedmesh"]
        flops = _value(rows, name, "training-step flops per device (forward + backward)")
        # each weight matmul's backward is two matmuls; the first layer's input and the
        # token ids need no gradient, so a little under 3x
        assert 2.9 * fwd <= flops["namedmesh"] <= 3 * fwd
        nbytes = _value(
            rows, name, "training-step collective bytes per device (forward + backward)"
        )
        for hw, h in paper.HARDWARE.items():
            want = flops["namedmesh"] / h["peak_flops"]
            want += nbytes["namedmesh"] / h["link_bytes_per_s"]
            got = _value(rows, name, f"predicted step seconds, {hw} (estimate)")["namedmesh"]
            assert got == pytest.approx(want)


def test_write_docs_replaces_its_section_and_says_what_was_not_found(rows, tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    paper.write_docs(docs, rows, "first")
    paper.write_docs(docs, rows, "again")
    text = docs.read_text()
    assert text.count(paper.SECTION) == 1 and "## Other\n\nkept" in text and "`again`" in text
    assert "could not be found" in text and "TPUv2" in text and "TPUv3" in text
    assert all(f"`{name}`" in text for name in paper.CONFIGS)


def test_gpu_script_runs_on_cpu_and_prints_tokens_per_second(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    env["JAX_PLATFORMS"] = "cpu"
    docs = tmp_path / "gpu.md"
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--config", "tiny", "--steps", "2"]
    cmd += ["--warmup", "1", "--max-seconds", "60", "--docs", str(docs)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    tokens_per_s = float(re.search(r"tokens/s: ([0-9.]+)", out.stdout).group(1))
    assert tokens_per_s > 0
    text = docs.read_text()
    assert "not a GPU" in text and "## One GPU: base LM training step in bf16" in text
    # every matmul of the compiled step took bf16 operands
    dots, total = map(int, re.search(r"\| (\d+) of (\d+) \|", text).groups())
    assert dots == total > 0
