"""A mixture-of-experts checkpoint fine-tunes and goes back out: 2 steps of `train
--init-from` a tiny Qwen2-MoE folder (routed experts, the gated shared expert) with its
experts split over a mesh axis write the router's statistics to metrics.jsonl, and the
export is a folder of per-expert tensors, as the hub's checkpoints hold them, that
transformers loads with the zoo's logits."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_finetune_export import base_folder  # noqa: E402

import namedmesh as nm  # noqa: E402
from models.cli import export, generate  # noqa: E402
from models.io import hub  # noqa: E402

IDS = np.arange(24).reshape(2, 12) * 7 % 200


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from models.cli.train import main as train

    root = tmp_path_factory.mktemp("moe_finetune")
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
               shared_expert_intermediate_size=24, output_router_logits=True,
               router_aux_loss_coef=0.05)  # fmt: skip
    base, _ = base_folder(root, transformers.Qwen2MoeForCausalLM, **moe)
    flags = ["--init-from", str(base), "--steps", "2", "--length", "16", "--batch", "4",
             "--eval-batches", "1", "--quiet", "--mesh", "data=2,expert=4",
             "--layout", "batch:data;experts:expert", "--out", str(root / "run")]  # fmt: skip
    assert train(flags) == 0
    return root / "run", base


def test_the_router_statistics_reach_the_metrics(run):
    folder, _ = run
    records = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        loads = [r[f"moe/load/{e}"] for e in range(4)]
        assert sum(loads) == pytest.approx(1.0) and min(loads) >= 0
        assert r["moe/dropped"] == 0 and r["moe/balance_loss"] > 0  # dropless
    params, cfg, _ = generate.load(folder, 2)
    assert (cfg.moe_loss, cfg.shared_ff, cfg.router) == (0.05, 24, "softmax_topk")


def logits_of(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


def test_the_export_is_per_expert_tensors_transformers_reads_with_equal_logits(run, tmp_path):
    folder, base = run
    assert export.main([str(folder), "--out", str(tmp_path / "hf")]) == 0
    from safetensors import safe_open

    with safe_open(tmp_path / "hf" / "model.safetensors", "np") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.0.mlp.shared_expert_gate.weight" in names
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    got = logits_of(back)
    params, cfg, _ = generate.load(folder, 2)
    inputs = nm.tensor(IDS.astype(np.int32), ("batch", "length"))
    want = hub.forward(params, {"inputs": inputs}, cfg, "qwen2_moe")
    want = np.asarray(want.transpose("batch", "length", "vocab").data)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    before = logits_of(transformers.AutoModelForCausalLM.from_pretrained(base).eval())
    assert np.abs(got - before).max() > 1e-4  # the fine-tune moved the weights
