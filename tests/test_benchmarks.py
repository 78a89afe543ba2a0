"""`python -m benchmarks.run --quick`: the results file's schema, and the deterministic
part of the goals: namedmesh sends exactly the analytical minimum of collective bytes
(a lower bound for the MoE rows, whose gaps docs/benchmarks.md names), never more
than XLA's partitioner outside the rows with a named gap, and the cost model's forward
and training-step bytes equal the compiled HLO's; every peak-memory row more than 10%
off the ideal names its causes, and the ideal follows its contract on a model small
enough to count."""

import json

import pytest

from benchmarks import cases, memory, run, steps
from benchmarks.collectives import count as cases_count


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    docs = tmp / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    assert run.main(["--quick", "--results", str(tmp), "--docs", str(docs)]) == 0
    (result,) = tmp.glob("*.json")
    return json.loads(result.read_text()), docs


def test_rows_follow_the_schema(quick):
    data, _ = quick
    assert set(data) == {"machine", "rows"} and data["machine"]["cpus"] >= 1
    assert all(set(r) == set(run.FIELDS) for r in data["rows"])
    benches = {r["bench"] for r in data["rows"]}
    assert benches == {
        "collective_bytes", "step_time", "cost_model_bytes", "cost_model_time", "peak_memory",
        "compile_time", "planner_time", "paper_scale",
    }  # fmt: skip
    timed = [r for r in data["rows"] if r["bench"] in (
        "step_time", "cost_model_time", "compile_time", "peak_memory")]  # fmt: skip
    assert all(r["namedmesh"] > 0 for r in timed)


def test_collective_bytes_are_at_the_minimum(quick):
    rows = [r for r in quick[0]["rows"] if r["bench"] == "collective_bytes"]
    kinds = {r["case"].split()[0] for r in rows}
    assert kinds == {"mlp", "attention", "layer", "moe"}
    layouts = {r["layout"].split(":")[0] for r in rows}
    assert {"data-parallel", "model-parallel", "2d", "fsdp", "sequence-parallel", "3d"} <= layouts
    for r in rows:
        assert r["namedmesh"] > 0
        if run._gap(r) is None:
            assert r["ratio_to_min"] == 1.0, r
            assert r["ratio_to_gspmd"] <= 1.0, r
        else:  # the MoE minimum leaves out the gating: a lower bound
            assert r["ratio_to_min"] >= 1.0, r
        assert r["hand"] is None or r["ratio_to_hand"] == 1.0, r
    assert any(r["hand"] is not None for r in rows if r["case"].startswith("attention"))


def test_cost_model_bytes_equal_the_hlo(quick):
    rows = [r for r in quick[0]["rows"] if r["bench"] == "cost_model_bytes"]
    pairs: dict = {}
    for r in rows:  # "<pass> bytes per device, cost model" / "..., compiled HLO"
        key = (r["case"], r["layout"], r["mesh"], r["metric"].split(",")[0])
        pairs.setdefault(key, {})[r["metric"].split(", ")[1]] = r["namedmesh"]
    assert len(pairs) == 2 * cases_count("quick") and {k[-1] for k in pairs} == {
        "forward bytes per device", "training-step bytes per device"}  # fmt: skip
    for key, v in pairs.items():
        assert v["cost model"] == pytest.approx(v["compiled HLO"], abs=0.5), key


def test_docs_sections_are_replaced_not_repeated(quick):
    data, docs = quick
    run.write_docs(docs, data["rows"], "again", data["machine"])
    text = docs.read_text()
    assert text.count(run.SECTION) == 1 and "## Other\n\nkept" in text and "`again`" in text
    assert text.count(run.STEP_TIME) == 1 and text.count(run.COST) == 1
    assert text.count(run.TIME_MODEL) == 1
    assert text.count(run.MEMORY) == 1


def test_memory_gaps_have_causes(quick):
    rows = [r for r in quick[0]["rows"] if r["bench"] == "peak_memory"]
    assert {r["case"].split()[0] for r in rows} == {"mlp", "attention", "layer", "moe"}
    for r in rows:
        # a lower bound but for activations XLA puts in the gradients' output buffers
        assert r["ratio_to_min"] >= 0.9, r
        if abs(r["ratio_to_min"] - 1) > 0.10:
            assert run._memory_causes(r), r
    assert all(c in memory.REASONS for named in memory.CAUSES.values() for c in named)


def test_ideal_memory_counts_the_layout_shards():
    model = cases.models("quick")[0]  # mlp b=16 d=32 h=64: out = relu(x·wi)·wo
    params, x = model.inputs()
    ideal = lambda mesh, rules: memory.ideal_bytes(model.loss, params, x, mesh, rules)
    f32, (b, d, h) = 4, (16, 32, 64)
    # params and gradients (wi, wo) + x + relu's output (for relu and wo's gradient) +
    # out (for out * out); x·wi keeps x, which is the input, and wo is a parameter
    whole = 2 * 2 * d * h + b * d + b * h + b * d
    assert ideal({"data": 1}, "batch:data") == whole * f32
    assert ideal({"data": 8}, "batch:data") == (2 * 2 * d * h + (b * d + b * h + b * d) // 8) * f32
    # d_ff split: the weights and relu's output are divided, x and out are whole
    assert ideal({"model": 8}, "d_ff:model") == ((2 * 2 * d * h + b * h) // 8 + 2 * b * d) * f32


def test_temporaries_at_peak_reads_the_gradient_all_reduce():
    """The diagnostic parses XLA's dumps: on the data-parallel MLP the arena is
    memory_analysis's temp and holds the two un-reduced weight gradients at once."""
    model = cases.models("quick")[0]
    params, x = model.inputs()
    fn, args = steps.namedmesh_step(model.loss, params, x, {"data": 8}, "batch:data")
    lowered = fn.lower(*args)
    arena, live, buffers = memory.temporaries_at_peak(lowered)
    assert arena == lowered.compile().memory_analysis().temp_size_in_bytes == live
    assert [b for b, *_ in buffers] == [32 * 64 * 4] * 2
    assert all("transpose" in op for *_, op in buffers)  # made by the backward pass
