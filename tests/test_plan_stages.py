"""Uneven pipeline stages and MoE microbatches in planning (lowering/stages.py, issue 37):
61 layers in two stacks (DeepSeek-V3's 3 dense + 58 MoE) on 16 stages, planned by
`namedmesh plan --stages 16` on a model of DeepSeek-V3's layer structure at tiny widths
(the full model's printout is docs/layouts.md's; it takes minutes on this machine)."""

import json

import pytest

from lowering.stages import assign_stages
from models import catalog
from models.cli import plan as plan_cli


@pytest.mark.parametrize("stacks, stages", [([3, 58], 16), ([61], 16), ([5, 0, 7], 4), ([8], 8)])
def test_assign_stages_deals_every_layer_in_order_evenly(stacks, stages):
    got = assign_stages(stacks, stages)
    assert len(got) == stages
    # every layer once, in order: the stages' layers laid end to end are the stacks'
    flat = [i for counts in got for i, n in enumerate(counts) for _ in range(n)]
    assert flat == [i for i, n in enumerate(stacks) for _ in range(n)]
    sizes = [sum(c) for c in got]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    if stacks == [3, 58]:
        assert sizes.count(4) == 13 and sizes.count(3) == 3 and got[0] == (3, 1)


def test_more_stages_than_layers_is_refused():
    from namedmesh.errors import ParameterError

    with pytest.raises(ParameterError, match="3 layers cannot fill 4 stages"):
        assign_stages([3], 4)


@pytest.fixture(scope="module")
def moe61():
    """tiny with DeepSeek-V3's stacks: 3 dense layers, then 58 of 8 experts."""
    return catalog.get("tiny").replace(experts=8, experts_per_token=2, dense_layers=3, layers=61)


def test_plan_16_uneven_stages_of_a_moe_with_microbatches(capsys, monkeypatch, moe61):
    monkeypatch.setattr(plan_cli, "load_config", lambda text: moe61)
    status = plan_cli.main(["--config", "moe61", "--mesh", "stage=16,data=2",
                            "--rates", "h100,node=8", "--batch", "512",
                            "--length", "256", "--remat", "full", "--attention", "full",
                            "--json", "--jobs", "1"], prog="namedmesh plan")  # fmt: skip
    out, err = capsys.readouterr()
    assert status == 0, err
    got = json.loads(out)
    assert got["fits"] and got["memory"]["total"] <= got["memory_limit"]
    parts = ("parameters", "gradients", "optimizer", "activations", "other")
    assert sum(got["memory"][k] for k in parts) == got["memory"]["total"]
    assert got["mesh"]["stage"] == 16 and got["settings"]["stages"] == 16
    st = got["stages"]
    assert [sum(c) for c in st["assignment"]] == st["sizes"] and sum(st["sizes"]) == 61
    assert max(st["sizes"]) - min(st["sizes"]) <= 1
    m = got["settings"]["microbatches"]
    assert m > 1  # a MoE pipeline with microbatches: each its own routing group
    assert st["bubble"] == pytest.approx(15 / (m + 15))
    assert got["settings"]["stages_uneven"] is True
    # 13 stages of 4 layers, 3 of 3: the plan charges the latter one pad each
    assert st["pads"] == [0] * 13 + [1] * 3 and st["pad_share"] == pytest.approx(3 / 64)
    # it runs: one pipeline over both stacks (stage 0: 3 dense + 1 MoE, as planned), the
    # MoE microbatches each routed on its own
    runtime = got["settings"]["runtime"]
    assert runtime.startswith("runs as a layers:stage layout (lowering.pipeline), one pipeline")
    assert "3 + 4 layer slots a stage" in runtime
    assert runtime.endswith("each microbatch routed on its own (its balancing loss averaged)")


def test_compare_takes_a_pipelined_layouts_own_microbatches(capsys, monkeypatch, moe61):
    monkeypatch.setattr(plan_cli, "load_config", lambda text: moe61)
    flags = ["--config", "moe61", "--mesh", "stage=16,data=2", "--rates", "h100,node=8",
             "--batch", "512", "--length", "256", "--remat", "full", "--attention", "full",
             "--grad-accum", "16", "--jobs", "1"]  # fmt: skip
    mine = "batch:data;experts:data;microbatches=32@stage=16,data=2"
    status = plan_cli.main([*flags, "--compare", mine, "--json"], prog="namedmesh plan")
    out, err = capsys.readouterr()
    assert status == 0, err
    got = json.loads(out)
    assert got["settings"]["microbatches"] == 16
    (compared,) = got["compare"]
    assert "grad_accum=32" in compared["verdict"]  # its own 32, not the plan's 16
    status = plan_cli.main([*flags, "--compare", mine.replace("32", "7")], prog="namedmesh plan")
    err = capsys.readouterr().err
    assert status == 2 and "microbatches=7 must be an int >= 1 that divides --batch" in err
