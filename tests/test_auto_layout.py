"""auto_layout finds the layouts the Mesh-TensorFlow paper's analysis says are best,
weighs them at stated rates, scales to 4-axis meshes and explains its answer."""

import functools
import json
import math
import re

import numpy as np
import pytest

import namedmesh as nm
from lowering import Layout, Mesh, lower
from lowering import auto_layout as _auto_layout
from lowering import rates as rates_mod
from lowering.cost import Report
from lowering.rates import Rates, RatesError, hardware

# The planning tests weigh candidates at a hardware table's rates: fixed, unlike a
# measurement on the test machine.
auto_layout = functools.partial(_auto_layout, rates="tpu_v2")

A = nm.abstract
MESH = Mesh({"rows": 2, "cols": 4})


def mlp(x, w1, w2):
    return nm.einsum(nm.relu(nm.einsum(x, w1)), w2, out="batch d_model")


def mlp_inputs(b, d, h):
    return A({"batch": b, "d_model": d}), A({"d_model": d, "d_ff": h}), A({"d_ff": h, "d_model": d})


def layer(x, wq, wk, wv, wo, w1, w2):
    """A Transformer layer: multi-head attention and a ReLU FFN, with residuals."""
    q = nm.einsum(x, wq)
    k = nm.rename(nm.einsum(x, wk), seq="kseq")
    v = nm.rename(nm.einsum(x, wv), seq="kseq")
    att = nm.softmax(nm.einsum(q, k, out="batch heads seq kseq") * 0.125, "kseq")
    x = x + nm.einsum(nm.einsum(att, v, out="batch seq heads d_head"), wo, out="batch seq d_model")
    return x + nm.einsum(nm.relu(nm.einsum(x, w1)), w2, out="batch seq d_model")


def layer_inputs(b, s, d, heads, dh, f):
    proj = {"d_model": d, "heads": heads, "d_head": dh}
    return (
        A({"batch": b, "seq": s, "d_model": d}),
        A(proj),
        A(proj),
        A(proj),
        A({"heads": heads, "d_head": dh, "d_model": d}),
        A({"d_model": d, "d_ff": f}),
        A({"d_ff": f, "d_model": d}),
    )


def test_large_batch_small_weights_is_data_parallel():
    layout, _ = auto_layout(mlp, MESH, *mlp_inputs(8192, 64, 256), grad_argnums=(1, 2))
    assert layout == Layout("batch:rows,cols")


def test_small_batch_large_weights_splits_the_hidden_dim():
    layout, table = auto_layout(mlp, MESH, *mlp_inputs(16, 1024, 8192), grad_argnums=(1, 2))
    rules = dict(layout.rules)
    assert "d_ff" in rules and "batch" not in rules
    assert table[0].layout == layout and table[0].time < table[-1].time


def test_transformer_layer_large_batch_is_data_parallel():
    layout, _ = auto_layout(
        layer, MESH, *layer_inputs(512, 128, 256, 8, 32, 1024), grad_argnums=tuple(range(1, 7))
    )
    assert layout == Layout("batch:rows,cols")


def test_transformer_layer_large_model_shares_an_axis_between_heads_and_d_ff():
    """Megatron: attention heads and the FFN's hidden dim split on the same model axis."""
    layout, _ = auto_layout(
        layer, MESH, *layer_inputs(8, 128, 4096, 32, 128, 16384), grad_argnums=tuple(range(1, 7))
    )
    rules = dict(layout.rules)
    assert rules.get("heads") and rules.get("heads") == rules.get("d_ff")
    assert "batch" not in rules


def test_memory_limit_excludes_layouts_and_is_reported():
    inputs = mlp_inputs(8192, 64, 256)
    _, table = auto_layout(mlp, MESH, *inputs)
    tight = sorted(c.memory for c in table if np.isfinite(c.time))[1]
    layout, table = auto_layout(mlp, MESH, *inputs, memory_limit=tight)
    chosen = table[0]
    assert chosen.memory <= tight and chosen.layout == layout
    over = [c for c in table if c.memory > tight and not c.note.startswith("invalid")]
    assert over and all(not c.valid for c in over)
    text = str(table)
    assert f"invalid: {len(over)} x over the memory limit" in text
    assert f"{tight:,} bytes" in text and "chosen" in chosen.note


def test_no_valid_layout_is_a_layout_error():
    with pytest.raises(nm.LayoutError, match="no layout"):
        auto_layout(mlp, MESH, *mlp_inputs(8192, 64, 256), memory_limit=1)


def test_fsdp_when_replicated_weights_do_not_fit():
    """Data parallelism fits no longer: the weights are split over the data axis too.
    The limit is a whole copy of the weights below data parallelism's training step,
    and below that of splitting d_ff alone (Megatron's FFN, whole-batch activations;
    with the estimate counting only what the backward pass reads it needs less than
    data parallelism less the weights), so neither fits: only FSDP-style layouts,
    batch and a weight dim on the axis, do."""
    mesh = Mesh({"data": 8}, devices="abstract")
    inputs = mlp_inputs(4096, 1024, 4096)
    dp = lower(mlp, mesh, "batch:data").report(*inputs, wrt=(1, 2), show=False)
    weights = 2 * 1024 * 4096 * 4
    megatron = lower(mlp, mesh, "d_ff:data").report(*inputs, wrt=(1, 2), show=False)
    limit = min(dp.peak_memory - weights, megatron.peak_memory - 1)
    assert megatron.peak_memory > limit  # the premise: only FSDP-style layouts fit
    layout, table = auto_layout(mlp, mesh, *inputs, grad_argnums=(1, 2), memory_limit=limit)
    assert table[0].memory <= limit
    rules = dict(layout.rules)
    assert rules.get("batch") == ("data",)
    assert {"d_model", "d_ff"} & set(rules)  # some weight dim is split as well


def test_four_axis_mesh_is_searched_without_the_product():
    """A 4-axis mesh: far fewer candidates planned than the product over axes."""
    mesh = Mesh({"a": 2, "b": 2, "c": 2, "d": 2}, devices="abstract")
    inputs = layer_inputs(16, 64, 256, 8, 32, 1024)
    layout, table = auto_layout(layer, mesh, *inputs, grad_argnums=tuple(range(1, 7)))
    dims = {d for t in inputs for d in t.dims} | {"kseq"}
    assert len(table) < (1 + len(dims)) ** 4 / 20
    assert table[0].layout == layout and table[0].valid
    best = lower(layer, mesh, layout).report(*inputs, wrt=tuple(range(1, 7)), show=False)
    assert table[0].time == pytest.approx(hardware("tpu_v2").seconds(best))
    # no worse than plain data parallelism over the whole mesh
    dp = lower(layer, mesh, "batch:a,b,c,d").report(*inputs, wrt=tuple(range(1, 7)), show=False)
    assert table[0].time <= hardware("tpu_v2").seconds(dp) * (1 + 1e-9)


def test_printout_states_assumptions_top_ten_and_why():
    _, table = auto_layout(
        layer, MESH, *layer_inputs(8, 128, 4096, 32, 128, 16384), grad_argnums=tuple(range(1, 7))
    )
    text = str(table)
    assert "22.5 TFLOP/s per device" in text and "62 GB/s" in text and "10 µs" in text
    assert "memory limit: 8 GiB" in text
    ranked = [ln for ln in text.splitlines() if ln[:3].strip().isdigit()]
    groups = table.alike()  # the valid candidates, those that plan alike once
    assert len(ranked) == min(10, len(groups))
    assert sum(map(len, groups)) == sum(c.valid for c in table)
    figures = lambda c: (c.time, c.memory, c.flops, c.bytes, c.collectives)
    assert len({figures(g[0]) for g in groups}) == len(groups)  # each plan shown once
    for line, (c, *same) in zip(ranked, groups, strict=False):
        assert line.split()[1] == str(c.layout)
        assert (f"(+{len(same)} alike)" in line) == bool(same)
        assert all(figures(s) == figures(c) for s in same)
    assert any("alike)" in line for line in ranked)  # this layer has some
    head = text.splitlines()
    assert text.splitlines()[-1].startswith(f"chosen: {table[0].layout}. It ")
    assert len(head) < 25  # not a row per candidate
    valid = [c for c in table if c.valid]
    assert all(c.time == pytest.approx(c.compute + c.comm) for c in valid)


def test_hardware_table_rates_and_seconds():
    v2 = hardware("TPU-v2")
    assert v2.flops_per_s == 22.5e12 and v2.memory_bytes == 8 * 2**30 and v2.source
    assert set(rates_mod.HARDWARE) == {"tpu_v2", "tpu_v3", "tpu_v4", "tpu_v5e", "tpu_v5p",
                                       "tpu_v6e", "a100", "h100", "h200", "b200"}  # fmt: skip
    rep = Report(
        4.5e12, {("psum", ("x",)): (3, 6.2e9)}, 0, 4.5e12, {("all_gather", ("y",)): (1, 3.1e9)}
    )
    assert v2.seconds(rep) == pytest.approx(9e12 / 22.5e12 + 4 * 10e-6 + 9.3e9 / 62e9)
    with pytest.raises(RatesError, match="tpu_v2"):
        hardware("tpu_v9")
    with pytest.raises(RatesError, match="bytes_per_s"):
        Rates("bad", 1e12, {"psum": 1e9}, 0.0)


def test_abstract_mesh_needs_rates():
    mesh = Mesh({"x": 4}, devices="abstract")
    with pytest.raises(RatesError, match="no devices to measure"):
        _auto_layout(mlp, mesh, *mlp_inputs(64, 32, 64))


def test_measured_rates_are_cached_by_device_kind_and_mesh_shape(tmp_path):
    mesh = Mesh({"x": 2})
    rates_mod.clear_cache()
    measured = rates_mod.measure(mesh, tmp_path, repeats=1)
    assert measured.flops_per_s > 0 and all(v > 0 for v in measured.bytes_per_s.values())
    assert rates_mod.measure(mesh, tmp_path) is measured  # memory
    stored = json.loads((tmp_path / "rates.json").read_text())
    (key,) = stored
    assert key.endswith("x=2") and "cpu" in key
    rates_mod.clear_cache()
    assert rates_mod.measure(mesh, tmp_path) == measured  # disk, not measured again
    assert math.isclose(stored[key]["latency_s"], measured.latency_s)


SMALL_RUN = ["--config", "tiny", "--length", "16", "--batch", "8", "--quiet", "--eval-batches", "1"]


def test_cli_layout_auto_prints_the_search(capsys):
    """`--layout auto --rates tpu_v2`'s path (models/training/run.py pick_layout): the printout."""
    from models import catalog, zoo
    from models.training.run import pick_layout
    from models.training.trainer import OptimizerSpec, Trainer, TrainSpec, optimizer

    model = zoo.get("lm")
    cfg = model.configure(catalog.get("tiny")).replace(length=16, batch=8)
    opt, _ = optimizer(OptimizerSpec("adamw", 3e-3, 10, 1, 1.0))
    layout = pick_layout("auto", Trainer(model, cfg, Mesh({"data": 2}), "", TrainSpec(opt)), "lm",
                         "tpu_v2")  # fmt: skip
    text = capsys.readouterr().out
    assert "rates: tpu_v2: 22.5 TFLOP/s" in text
    assert f"chosen: {str(layout) or '(replicated)'}. It " in text


def test_cli_layout_auto_plans_the_microbatch_that_grad_accum_trains(capsys):
    """With --grad-accum N the step runs on batch/N rows: a search that planned the whole
    batch chose `batch` over all 4 devices, which 2-row microbatches cannot take."""
    from models import catalog, zoo
    from models.training.run import pick_layout
    from models.training.trainer import OptimizerSpec, Trainer, TrainSpec, optimizer

    model = zoo.get("lm")
    cfg = model.configure(catalog.get("tiny")).replace(length=16, batch=8)
    opt, _ = optimizer(OptimizerSpec("adamw", 3e-3, 10, 1, 1.0))
    mesh, cheap_links = Mesh({"data": 4}), "flops=1e9,bandwidth=1e10,latency=1e-7"
    whole = pick_layout("auto", Trainer(model, cfg, mesh, "", TrainSpec(opt)), "lm", cheap_links)
    assert dict(whole.rules)["batch"] == ("data",)  # what the whole batch of 8 takes
    spec = TrainSpec(opt, 0, grad_accum=4)
    layout = pick_layout("auto", Trainer(model, cfg, mesh, "", spec), "lm", cheap_links)
    assert "batch" not in dict(layout.rules)  # 2 rows do not split over 4 devices
    Trainer(model, cfg, mesh, layout, spec).report()  # the run's step plans
    capsys.readouterr()


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--layout", "auto", "--rates", "tpu_v9"], "tpu_v9"),
        (["--layout", "auto", "--rates", "tpu_v2,latncy=1e-5"], "did you mean 'latency'"),
        (["--layout", "batch:data", "--rates", "tpu_v2"], "--rates"),
    ],
)
def test_cli_bad_rates_exit_2_naming_them(tmp_path, capsys, flags, names):
    from models.cli import train

    argv = [*SMALL_RUN, "--mesh", "data=2", *flags, "--steps", "1", "--out", str(tmp_path)]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and names in err[0] and "error:" in err[0]


def test_callers_candidates_are_weighed_and_each_says_why_not_chosen():
    """A caller's layouts (a paper's rules) are costed beside the search's; the printout
    says of each why it lost: over the limit (its memory, the time it would plan at) or
    slower (the ratio to the chosen). Times and memory checked against `Lowered.report`."""
    inputs, wrt = mlp_inputs(8192, 64, 256), (1, 2)
    report = lambda rules: lower(mlp, MESH, rules).report(*inputs, wrt=wrt, show=False)
    seconds = lambda rules: hardware("tpu_v2").seconds(report(rules))
    limit = report("batch:rows,cols").peak_memory - 1  # data parallelism is over it
    mine = ["batch:rows,cols", "batch:rows,cols;d_model:rows,cols"]  # FSDP-style
    layout, table = auto_layout(
        mlp, MESH, *inputs, grad_argnums=wrt, memory_limit=limit, candidates=mine
    )
    lines = {ln.split(": ")[1]: ln for ln in str(table).splitlines() if ln.startswith("yours:")}
    assert set(lines) == set(mine)
    over = lines["batch:rows,cols"]
    assert "over the memory limit" in over and f"{limit + 1:,}" not in over
    numbers = [float(x) for x in re.findall(r"([0-9.]+) ms per step, ([0-9.]+)x", over)[0]]
    chosen_s = seconds(layout)
    assert numbers[0] == pytest.approx(seconds("batch:rows,cols") * 1e3, rel=1e-3)
    assert numbers[1] == pytest.approx(seconds("batch:rows,cols") / chosen_s, rel=1e-3)
    assert (
        report("batch:rows,cols;d_model:rows,cols").peak_memory <= limit
        and seconds("batch:rows,cols;d_model:rows,cols") > chosen_s
    )
    slower = re.findall(
        r"([0-9.]+) ms per step, ([0-9.]+)x", lines["batch:rows,cols;d_model:rows,cols"]
    )[0]
    assert float(slower[1]) == pytest.approx(
        seconds("batch:rows,cols;d_model:rows,cols") / chosen_s, rel=1e-3
    )
    assert table.compare(layout) == "chosen."
    assert "over the memory limit" in table.compare(Layout("batch:rows,cols"))
    with pytest.raises(nm.LayoutError, match="rowz"):
        auto_layout(mlp, MESH, *inputs, grad_argnums=wrt, candidates=["batch:rowz"])
    with pytest.raises(nm.LayoutError, match="'batchh'.*did you mean 'batch'"):
        auto_layout(mlp, MESH, *inputs, grad_argnums=wrt, candidates=["batchh:rows"])
    with pytest.raises(nm.LayoutError, match="'d_fff'"):
        table.compare("d_fff:rows")
