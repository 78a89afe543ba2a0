"""`python -m benchmarks.run --quick`: the results file's schema, and the deterministic
part of the goals: namedmesh sends exactly the analytical minimum of collective bytes,
and never more than XLA's partitioner."""

import json

from benchmarks import run


def test_quick_run_writes_rows_at_the_minimum(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    assert run.main(["--quick", "--results", str(tmp_path), "--docs", str(docs)]) == 0
    (result,) = tmp_path.glob("*.json")
    data = json.loads(result.read_text())
    assert set(data) == {"machine", "rows"} and data["machine"]["cpus"] >= 1
    rows = [r for r in data["rows"] if r["bench"] == "collective_bytes"]
    timed = [r for r in data["rows"] if r["bench"] != "collective_bytes"]
    assert {r["bench"] for r in timed} == {"compile_time", "planner_time"}
    assert all(set(r) == set(run.FIELDS) and r["namedmesh"] > 0 for r in timed)
    layouts = {r["layout"].split(":")[0] for r in rows}
    assert layouts == {"data-parallel", "model-parallel", "2d", "fsdp"}
    for r in rows:
        assert set(r) == set(run.FIELDS)
        assert r["namedmesh"] > 0
        assert r["ratio_to_min"] == 1.0, r
        assert r["ratio_to_gspmd"] <= 1.0, r
        assert r["hand"] is None or r["ratio_to_hand"] == 1.0, r
    run.write_docs(docs, rows, "again", data["machine"])  # a rerun replaces the section
    text = docs.read_text()
    assert text.count(run.SECTION) == 1 and "## Other\n\nkept" in text and "`again`" in text
