"""Hardware specs with levels (`h100,node=8`): which mesh axes cross nodes, collectives
over both levels costed hierarchically (checked against the formulas written out),
compute efficiency and overlap, the new rate tables, and bad specs refused."""

import pytest

from lowering.cost import Report
from lowering.rates import HARDWARE, RatesError, levels, parse


def test_innermost_axes_fill_a_node_first():
    assert levels((("data", 256), ("model", 8)), 8) == {"model": (8, 1), "data": (1, 256)}
    assert levels((("a", 4), ("b", 2), ("c", 2)), 8) == {"c": (2, 1), "b": (2, 1), "a": (2, 2)}
    # an axis split between levels leaves every axis outside it across nodes
    assert levels((("a", 2), ("b", 16)), 8) == {"b": (8, 2), "a": (1, 2)}


def _seconds(rates, kind, axes, put, mesh):
    """Seconds of one collective of `kind` that puts `put` bytes in per device."""
    from lowering.ops import OPS

    n = 1
    for a in axes:
        n *= dict(mesh)[a]
    rep = Report(0.0, collectives={(kind, axes): (1, OPS[kind].traffic(n, put))}, mesh=mesh)
    return rates.comm_seconds(rep)


def test_a_collective_over_both_levels_is_costed_hierarchically():
    r = parse("h100,node=8")
    fast, slow, lat = 450e9, 50e9, 15e-6
    mesh, S = (("data", 4), ("model", 8)), 2.0**30
    # inside a node: the ring all-reduce at NVLink's rate
    assert _seconds(r, "psum", ("model",), S, mesh) == pytest.approx(lat + 2 * 7 / 8 * S / fast)
    # across nodes alone: InfiniBand's rate and its latency
    assert _seconds(r, "psum", ("data",), S, mesh) == pytest.approx(
        lat + 10e-6 + 2 * 3 / 4 * S / slow
    )
    # both: reduce-scatter and all-gather in the node, the 1/8 piece all-reduced across
    want = lat + 10e-6 + 2 * 7 / 8 * S / fast + 2 * 3 / 4 * (S / 8) / slow
    assert _seconds(r, "psum", ("data", "model"), S, mesh) == pytest.approx(want)
    # an all-gather of S per device: S across nodes, then 4S inside, 7 times
    want = lat + 10e-6 + 3 * S / slow + 7 * 4 * S / fast
    assert _seconds(r, "all_gather", ("data", "model"), S, mesh) == pytest.approx(want)
    # one level (no node=): every axis at NVLink's rate, as before
    flat = parse("h100")
    assert _seconds(flat, "psum", ("data",), S, mesh) == pytest.approx(lat + 2 * 3 / 4 * S / fast)


def test_efficiency_scales_compute_and_overlap_takes_the_larger():
    rep = Report(1e15, collectives={("psum", ("x",)): (1, 45e9)}, mesh=(("x", 8),))
    r = parse("h100,efficiency=0.5,latency=0")
    assert r.compute_seconds(rep) == pytest.approx(1e15 / (0.5 * 989e12))
    assert r.seconds(rep) == pytest.approx(1e15 / (0.5 * 989e12) + 0.1)
    both = parse("h100,efficiency=0.5,latency=0,overlap=1")
    assert both.seconds(rep) == pytest.approx(1e15 / (0.5 * 989e12))
    assert "does not overlap" in str(r) and "overlaps compute" in str(both)


def test_the_new_tables_hold_the_published_figures():
    assert HARDWARE["tpu_v5p"].flops_per_s == 459e12
    assert HARDWARE["tpu_v6e"].flops_per_s == 918e12
    assert HARDWARE["b200"].memory_bytes == 180e9 and HARDWARE["h200"].memory_bytes == 141e9
    v5p = parse("tpu_v5p,slice=4096")
    assert v5p.level_names == ("ICI", "DCN") and v5p.outer_bytes_per_s == 50e9 / 8


@pytest.mark.parametrize(
    "spec, match",
    [("h100,node=0", "node=0"), ("h100,node=2.5", "node=2.5"), ("tpu_v4,slice=8", "outer="),
     ("h100,efficiency=1.5", "efficiency"), ("h100,node=8,slice=8", "give one"),
     ("h100,overlap=2", "0 or 1")],
)  # fmt: skip
def test_a_bad_level_spec_is_refused_naming_it(spec, match):
    with pytest.raises(RatesError, match=match):
        parse(spec)
