"""`namedmesh plan` on abstract meshes: the done-when cases of issue 37 (Llama 3 70B on
2,048 H100 against an exhaustive search, Llama 3 8B at 8k tokens per chip choosing
remat itself, a refusal that names the closest plan and its fix) and bad flags."""

import json

import pytest

from lowering import Mesh
from lowering.joint import Settings, joint_search
from lowering.rates import parse
from models import catalog
from models.cli.plan import main

MODEL_DIMS = {"heads", "kv_heads", "q_per_kv", "d_ff", "vocab", "d_kv"}


def _plan(capsys, *flags) -> tuple[int, dict | str]:
    # in this process: the workers of --jobs are tests/test_joint_jobs.py's
    status = main([*flags, "--json", "--jobs", "1"], prog="namedmesh plan")
    out, err = capsys.readouterr()
    return status, (json.loads(out) if status == 0 else err)


def test_llama3_70b_on_2048_h100_splits_model_dims_in_node_within_1_1x_of_exhaustive():
    """The plan `namedmesh plan` prints (models.cli.plan.plan) against every (remat,
    microbatches) pair searched, none pruned nor seeded, no failing descent stopped at a
    plateau. The `cache` shares no search: the plan's pairs climb from their lead's layout
    and stop failing descents (their cache keys hold their seeds and plateau), so it is
    the seeded, stopped search that is held to 1.1x."""
    from models.cli.plan import arguments, builder, plan

    flags = ["--config", "llama3-70b", "--mesh", "data=256,model=8", "--rates", "h100,node=8",
             "--batch", "2048", "--length", "8192", "--attention", "blockwise",
             "--jobs", "1"]  # fmt: skip
    space = [Settings(r, "bfloat16", "blockwise", g) for r in ("none", "dots", "full")
             for g in (1, 2, 4, 8)]  # fmt: skip
    cache: dict = {}
    every = joint_search(builder(catalog.get("llama3-70b"), 2048, 8192),
                         [Mesh({"data": 256, "model": 8}, devices="abstract")],
                         parse("h100,node=8"), space, exhaustive=True, cache=cache)  # fmt: skip
    assert every.searched == len(space)
    got = plan(arguments(flags), cache=cache)
    assert got["fits"] and got["memory"]["total"] <= 80e9  # the H100's 80 GB
    assert got["searched"] < len(space)  # pruned
    for key in ("parameters", "gradients", "optimizer", "activations"):
        assert 0 < got["memory"][key] < got["memory"]["total"]
    rules = dict(r.split(":") for r in got["layout"].split(";"))
    inside = {d for d, axes in rules.items() if "model" in axes.split(",")}
    assert inside & MODEL_DIMS, got["layout"]  # tensor parallelism inside the node
    assert got["step_seconds"] <= 1.1 * every.best.step_seconds
    assert got["tokens_per_second_per_device"] == pytest.approx(8192 / got["step_seconds"])


def test_llama3_8b_at_8k_tokens_per_chip_fits_choosing_remat_and_a_refusal_names_the_fix(
    capsys,
):
    flags = ["--config", "llama3-8b", "--mesh", "data=8", "--rates", "h100",
             "--batch", "8", "--length", "8192", "--attention", "blockwise"]  # fmt: skip
    status, got = _plan(capsys, *flags)
    assert status == 0 and got["fits"] and got["memory"]["total"] <= 80e9
    assert got["settings"]["remat"] != "none"
    # without remat nothing fits: the refusal names the closest plan's memory and a fix
    status, err = _plan(capsys, *flags, "--remat", "none", "--grad-accum", "1")
    assert status == 1
    line = err.strip()
    assert "\n" not in line and "no plan fits" in line and "The closest" in line
    assert "activations" in line and "To fit" in line


@pytest.mark.parametrize(
    "flags, match",
    [(["--rates", "h100,node=0"], "--rates"), (["--batch", "0"], "--batch 0"),
     (["--config", "llama9"], "llama9"), (["--grad-accum", "3"], "--grad-accum 3"),
     (["--stages", "2"], "--stages"), (["--jobs", "0"], "--jobs 0"),
     (["--mesh", "data=6", "--rates", "h100,node=4"],
                                        "6 devices are not whole nodes of 4")],
)  # fmt: skip
def test_a_bad_flag_is_one_line_and_status_2(capsys, flags, match):
    base = {"--config": "tiny", "--mesh": "data=2", "--batch": "8", "--length": "64"}
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        base[flag] = value
    status = main([x for kv in base.items() for x in kv], prog="namedmesh plan")
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err and match in err, err


def test_compare_and_devices_on_a_tiny_lm(capsys):
    """--devices 8 searches the mesh's shape; --compare weighs a layout of yours under the
    chosen settings, its memory the step's as lowering.train_step counts it for that
    layout's own report."""
    from lowering import lower
    from lowering.train_step import Training, step_memory
    from models import transformer
    from models.training import objectives

    mine = "batch:data,model"
    status, got = _plan(capsys, "--config", "tiny", "--devices", "8", "--rates", "h100",
                        "--batch", "16", "--length", "64", "--compare", mine,
                        "--attention", "full", "--grad-accum", "1")  # fmt: skip
    assert status == 0 and got["fits"]
    sizes = got["mesh"]
    assert sorted(sizes) == ["data", "model"] and sizes["data"] * sizes["model"] == 8
    s = got["settings"]
    cfg = catalog.get("tiny", remat=s["remat"], dtype=s["dtype"], attention=s["attention"],
                     batch=16 // s["grad_accum"], length=64)  # fmt: skip
    params = transformer.abstract(transformer.lm_shapes(cfg))
    batch = objectives.abstract_batch("lm", cfg.batch, cfg.length)
    rep = lower(lambda p, b: transformer.lm_loss(p, b, cfg), Mesh(sizes, devices="abstract"),
                mine).report(params, batch, wrt=0, show=False)  # fmt: skip
    want = step_memory(rep, sizes, ("data", "model"), Training(grad_accum=s["grad_accum"]))
    (theirs,) = got["compare"]
    assert theirs["layout"] == mine and theirs["memory"] == want.as_dict()
    assert theirs["step_seconds"] >= got["step_seconds"] * (1 - 1e-9)  # the chosen is best
    # --stages 2 adds the shapes of 4 devices beside a stage axis: 4 + 3 meshes, 3 remats
    status, staged = _plan(capsys, "--config", "tiny", "--devices", "8", "--stages", "2",
                           "--rates", "h100", "--batch", "16", "--length", "64",
                           "--attention", "full", "--grad-accum", "1")  # fmt: skip
    assert status == 0 and staged["searched"] + sum(staged["pruned"].values()) == 7 * 3
    status = main(["--config", "tiny", "--devices", "8", "--stages", "3", "--batch", "16",
                   "--length", "64"], prog="namedmesh plan")  # fmt: skip
    assert status == 2 and "--stages 3" in capsys.readouterr().err
