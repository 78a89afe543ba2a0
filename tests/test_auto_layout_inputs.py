"""auto_layout's and the rates' inputs: rates given as text (`--rates`), figures checked
field by field, parameters refused before any search, the measured-rates cache robust to
a damaged file. Each bad input is a typed error naming the parameter or field at fault."""

import json
import math

import pytest

import namedmesh as nm
from lowering import Mesh, auto_layout
from lowering import rates as rates_mod
from lowering.rates import KINDS, Rates, RatesError, hardware, parse

MESH = Mesh({"rows": 2, "cols": 4}, devices="abstract")
INPUTS = (
    nm.abstract({"batch": 64, "d_model": 32}),
    nm.abstract({"d_model": 32, "d_ff": 128}),
    nm.abstract({"d_ff": 128, "d_model": 32}),
)


def mlp(x, w1, w2):
    return nm.einsum(nm.relu(nm.einsum(x, w1)), w2, out="batch d_model")


def test_parse_a_name_a_name_with_changes_and_figures_alone():
    assert parse("tpu_v4") == hardware("tpu_v4")
    changed = parse("tpu_v4, latency=2e-5, psum=1e9")
    assert changed.latency_s == 2e-5 and changed.flops_per_s == 275e12
    assert changed.bytes_per_s["psum"] == 1e9 and changed.bytes_per_s["ppermute"] == 50e9
    assert changed.memory_bytes == 32 * 2**30
    own = parse("flops=1e12,bandwidth=1e10,latency=1e-5,memory=8e9")
    assert own.flops_per_s == 1e12 and own.latency_s == 1e-5 and own.memory_bytes == 8 * 10**9
    assert dict(own.bytes_per_s) == dict.fromkeys(KINDS, 1e10)
    assert isinstance(own.memory_bytes, int)
    apart = parse("flops=1e12,bandwidth=1e10,psum=2e10,latency=0")  # one kind set apart
    assert apart.bytes_per_s["psum"] == 2e10 and apart.bytes_per_s["all_gather"] == 1e10


@pytest.mark.parametrize(
    "text, names",
    [
        ("", "hardware name"),
        ("tpu_v9", "unknown hardware 'tpu_v9'"),
        ("h10", "did you mean 'h100'"),
        ("tpu_v2,memory=nan", "memory_bytes must be a finite number > 0, got nan"),
        ("flops=1e12,bandwith=1e10,latency=1e-5", "did you mean 'bandwidth'"),
        ("tpu_v2,latency", "'latency' is not key=value"),
        ("tpu_v2,latency=fast", "latency='fast' is not a number"),
        ("bandwidth=1e10,latency=1e-5", "no flops= given"),
        ("flops=1e12,bandwidth=1e10", "no latency= given"),
        ("flops=1e12,psum=1e10,latency=1e-5", "bytes_per_s lacks 'psum_scatter'"),
        ("tpu_v2,latency=-1", "latency_s must be a finite number >= 0, got -1.0"),
        ("tpu_v2,flops=nan", "flops_per_s must be a finite number > 0, got nan"),
        ("tpu_v2,memory=0", "memory_bytes must be a finite number > 0, got 0"),
        ("tpu_v2,latency=1e-5,latency=2e-5", "latency given more than once"),
    ],
)
def test_parse_names_the_part_at_fault(text, names):
    with pytest.raises(RatesError) as e:
        parse(text)
    assert names in str(e.value)


def test_rates_name_each_field_at_fault():
    every = dict.fromkeys(KINDS, 1e9)
    with pytest.raises(RatesError) as e:
        Rates("r", float("nan"), {**every, "all_reduce": 1e9, "psum": 0.0}, "1e-5")
    text = str(e.value)
    assert "flops_per_s must be a finite number > 0, got nan" in text
    assert "latency_s must be a finite number >= 0, got '1e-5'" in text
    assert "unknown kind 'all_reduce'" in text
    assert "bytes_per_s['psum'] must be a finite number > 0, got 0.0" in text
    assert Rates("r", 1e12, every, 0.0, None).memory_bytes is None  # unknown memory is fine


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"memory_limit": "8GiB"}, "memory_limit must be a positive number of bytes"),
        ({"memory_limit": 0}, "memory_limit"),
        ({"memory_limit": -1}, "memory_limit"),
        ({"memory_limit": float("nan")}, "memory_limit"),
        ({"memory_limit": True}, "memory_limit"),
        ({"beam": 0}, "beam must be a positive int"),
        ({"beam": -1}, "beam"),
        ({"beam": 1.5}, "beam"),
        ({"grad_argnums": "w1"}, "auto_layout(grad_argnums=...): argument positions are ints"),
        ({"grad_argnums": (1, True)}, "argument positions are ints"),
        ({"grad_argnums": 3}, "auto_layout(grad_argnums=...): no argument at position [3]"),
        ({"rates": "tpu_v2,latency=x"}, "latency='x' is not a number"),
    ],
)
def test_auto_layout_refuses_bad_parameters_naming_them(kwargs, names):
    with pytest.raises(nm.NamedMeshError) as e:
        auto_layout(mlp, MESH, *INPUTS, **{"rates": "tpu_v2", **kwargs})
    assert names in str(e.value)


def test_an_infinite_memory_limit_is_no_limit():
    over = {"memory_limit": 1, "rates": "tpu_v2"}
    with pytest.raises(nm.LayoutError, match="over the memory limit"):
        auto_layout(mlp, MESH, *INPUTS, **over)
    _, table = auto_layout(mlp, MESH, *INPUTS, **{**over, "memory_limit": math.inf})
    assert all(c.valid for c in table)


def test_auto_layout_takes_rates_text_and_one_candidate_as_a_string():
    slow_links = "flops=1e12,bandwidth=1e6,latency=1e-3"
    layout, table = auto_layout(mlp, MESH, *INPUTS, rates=slow_links, candidates="d_ff:cols")
    assert table.rates.bytes_per_s["psum"] == 1e6 and table.rates.latency_s == 1e-3
    # a collective costs 1 ms at these rates, more than the whole replicated step's
    # flops (2 matmuls of 2 * 64 * 32 * 128 = 1 Mflop: 1 µs): the choice has none
    assert table[0].layout == layout and table[0].collectives == 0
    assert table[0].time < 1e-3
    (theirs,) = table.theirs
    assert str(theirs.layout) == "d_ff:cols"
    with pytest.raises(nm.LayoutError, match="layout rules must be a string, dict or list"):
        table.compare(5)
    _, table = auto_layout(mlp, MESH, *INPUTS, rates="tpu_v2", candidates={"d_ff": "cols"})
    assert [str(c.layout) for c in table.theirs] == ["d_ff:cols"]


def test_measured_rates_cache_survives_a_damaged_file(tmp_path, monkeypatch):
    fake = Rates("measured: fake", 1e12, dict.fromkeys(KINDS, 1e9), 1e-5, None, 1e-4)
    calls = []
    monkeypatch.setattr(rates_mod, "calibrate", lambda *a, **k: calls.append(1) or fake)
    mesh = Mesh({"x": 2})
    for damaged in ['{"cpu:cpu:x=2": {"name": "m", "flops', '{"cpu:cpu:x=2": {"speed": 1}}']:
        (tmp_path / "rates.json").write_text(damaged)
        rates_mod.clear_cache()
        with pytest.warns(UserWarning, match="rates.json is unreadable"):
            assert rates_mod.measure(mesh, tmp_path) == fake
        stored = json.loads((tmp_path / "rates.json").read_text())  # rewritten whole
        (entry,) = stored.values()
        assert math.isclose(entry["overhead_s"], 1e-4) and entry["bytes_per_s"]["psum"] == 1e9
    assert len(calls) == 2
    rates_mod.clear_cache()
    assert rates_mod.measure(mesh, tmp_path) == fake and len(calls) == 2  # read back
    assert not list(tmp_path.glob(".*.tmp"))
    rates_mod.clear_cache()


def test_a_mesh_given_as_sizes_or_a_program_not_a_function_is_named():
    with pytest.raises(
        nm.MeshError, match=r"auto_layout needs a lowering.Mesh, got dict; write Mesh"
    ):
        auto_layout(mlp, {"rows": 2, "cols": 4}, *INPUTS, rates="tpu_v2")
    with pytest.raises(
        nm.ArgumentError, match="the program must be a function of Tensors, got 'mlp'"
    ):
        auto_layout("mlp", MESH, *INPUTS, rates="tpu_v2")
