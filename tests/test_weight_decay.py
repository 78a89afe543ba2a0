"""Which parameters weight decay pulls toward 0 (--decay; models/training/optim.py):
by default the matrices, as Hugging Face's Trainer and nanoGPT choose (not biases, norm
scales nor other vectors, whatever a stack's `layers` axis adds), held against the dims
each model declares; `all` decays every one, and a run recorded before --decay existed
resumes with it, equal to the run never stopped."""

import json
import shutil

import jax
import numpy as np
import pytest

from models import transformer
from models.architecture import Config
from models.cli import evaluate
from models.cli.train import main as train
from models.training.optim import OptimizerSpec, decay_mask, optimizer
from models.transformer import STACK_DIMS

SMALL = dict(vocab=64, d_model=16, heads=2, d_kv=8, d_ff=24, layers=2, length=8, batch=2)
MODELS = {
    "gpt2-like": (transformer.lm_shapes, Config(**SMALL, bias=True)),
    "deepseek-like": (transformer.lm_shapes, Config(**SMALL, experts=4, dense_layers=1,
                                                    router="sigmoid_topk", shared_ff=8)),
    "t5-like": (transformer.encdec_shapes, Config(**SMALL, relative_buckets=8)),
}  # fmt: skip


def leaves(tree, path=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, (*path, k))
    else:
        yield path, tree


@pytest.mark.parametrize("name", MODELS)
def test_the_default_decays_the_matrices_the_model_declares(name):
    """Decayed: a parameter of 2 or more declared dims besides the stack's `layers`
    (never the router's choosing bias), whether the mask sees the trainer's Tensors or
    raw arrays; by name, nothing undecayed but biases, norms' scales and vectors."""
    shapes_of, cfg = MODELS[name]
    shapes = shapes_of(cfg)
    arrays = jax.tree.map(lambda p: jax.ShapeDtypeStruct(tuple(p.sizes.values()), np.float32),
                          shapes, is_leaf=lambda x: hasattr(x, "sizes"))  # fmt: skip
    mask = dict(leaves(decay_mask()(arrays)))  # raw arrays: by shape and place
    params = dict(leaves(shapes))
    assert mask.keys() == params.keys()
    # the trainer's: namedmesh Tensors (abstract: their dims, no values), by dims
    tensors = jax.eval_shape(lambda: transformer.init(shapes, 0))
    assert dict(leaves(decay_mask()(tensors))) == mask
    for path, p in params.items():
        dims = [d for d in p.sizes if d not in STACK_DIMS]
        want = len(dims) >= 2 and path[-1] != "gate_bias"
        assert mask[path] == want, (path, p.sizes)
        if not want:
            assert "bias" in path[-1] or "norm" in "/".join(path) or len(dims) < 2, path
    assert any(mask.values()) and not all(mask.values())
    everything = dict(leaves(decay_mask("all")(arrays)))
    assert everything == {k: k[-1] != "gate_bias" for k in params}


def test_an_update_decays_what_the_mask_says():
    """With zero gradients AdamW's update is -lr * wd * p where decayed, else 0."""
    rng = np.random.default_rng(0)
    stack = {"scale": rng.normal(size=(2, 4)), "w": rng.normal(size=(2, 4, 3))}
    params = {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=4), "layers": stack}
    params = jax.tree.map(lambda x: x.astype(np.float32), params)
    zeros = jax.tree.map(np.zeros_like, params)
    for decay, on in (
        ("matrices", {"w", "layers/w"}),
        ("all", {"w", "b", "layers/scale", "layers/w"}),
    ):
        spec = OptimizerSpec("adamw", 0.5, 10, 0, 0.0, "constant", weight_decay=0.1, decay=decay)
        opt, _ = optimizer(spec)
        updates, _ = opt.update(zeros, opt.init(params), params)
        for path, u in leaves(updates):
            p = dict(leaves(params))[path]
            want = -0.5 * 0.1 * p if "/".join(path) in on else 0 * p
            np.testing.assert_allclose(u, want, rtol=1e-6, atol=1e-9, err_msg=f"{decay} {path}")


def test_a_run_recorded_before_decay_existed_resumes_decaying_all(tmp_path):
    """Its run.json without "decay": resumed, it trains as the `--decay all` run never
    stopped (every weight equal), not as the new default would."""
    flags = ["--config", "tiny", "--set", "layers=1", "--set", "d_model=16", "--length", "8"]
    flags += ["--batch", "2", "--quiet", "--eval-batches", "1", "--save-every", "1"]
    flags += ["--warmup", "0", "--lr", "0.1", "--weight-decay", "0.5", "--schedule", "constant"]
    whole, old = tmp_path / "a", tmp_path / "b"
    assert train([*flags, "--steps", "2", "--decay", "all", "--out", str(whole)]) == 0
    # an older run stopped at step 1: it decayed all (the rule then), its run.json has
    # no "decay"
    shutil.copytree(whole, old)
    shutil.rmtree(old / "checkpoints" / "2")
    (old / "metrics.jsonl").write_text((old / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    record = json.loads((old / "run.json").read_text())
    del record["decay"]
    (old / "run.json").write_text(json.dumps(record))
    assert train([*flags, "--steps", "2", "--resume", "--out", str(old)]) == 0
    a, b = (evaluate.load(str(run))[1] for run in (whole, old))
    for (path, x), (_, y) in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-6, err_msg=str(path))
