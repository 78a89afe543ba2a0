"""Every primitive declares all its rules in one place, and every public op is documented."""

import re
from pathlib import Path

import numpy as np

import namedmesh as nm
from namedmesh.primitive import Aval, Cost


def test_every_primitive_declares_its_rules():
    assert len(nm.REGISTRY) >= 60
    for name, p in nm.REGISTRY.items():
        assert p.name == name
        for rule in (p.shape_rule, p.numpy_impl, p.jax_impl, p.cost_rule):
            assert callable(rule), (name, rule)
        flags = (p.elementwise, p.combines_inputs, p.matmul, p.pins_layout, p.aliases_input)
        flags += (p.stops_gradient, p.loop)
        assert all(isinstance(f, bool) for f in flags), name


def test_the_lowering_reads_flags_not_names():
    """Elementwise ops combine their inputs; a contraction's backward pass costs it per
    input; only nm.constrain pins a layout (independent of how each was registered)."""
    flagged = lambda flag: {n for n, p in nm.REGISTRY.items() if getattr(p, flag)}
    assert {"add", "where", "exp", "less"} <= flagged("elementwise")
    assert not {"sum", "einsum", "softmax", "convert"} & flagged("elementwise")
    contractions = {"einsum", "grouped_matmul"}
    assert flagged("combines_inputs") == flagged("elementwise") | contractions
    assert flagged("matmul") == contractions
    assert flagged("pins_layout") == {"constrain"}
    assert flagged("aliases_input") == {"rename", "constrain"}
    assert flagged("stops_gradient") == {"stop_gradient"}
    assert flagged("loop") == {"scan"}


def test_cost_rules_return_costs_for_a_traced_program():
    x = nm.zeros({"a": 4, "b": 6})
    g = nm.trace(lambda x: nm.softmax(nm.einsum(x, x * 2, out="a"), "a").sum(), x)
    for e in g.eqns:
        c = e.primitive.cost_rule([v.aval for v in e.inputs], [v.aval for v in e.outputs], e.params)
        assert isinstance(c, Cost) and c.flops >= 0 and c.bytes > 0


def test_aval_sizes_and_bytes():
    a = Aval(("a", "b"), (2, 3), np.dtype(np.float32))
    assert a.sizes == {"a": 2, "b": 3} and a.nbytes == 24


def test_each_primitive_is_exercised_by_the_tests():
    """A primitive no test file names is an untested primitive."""
    text = "".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    text += "".join(
        p.read_text() for p in (Path(__file__).parent.parent / "property_tests").glob("test_*.py")
    )
    public = {
        "random": "random.normal",
        "random_fold_in": "fold_in",
        "full": "zeros",
        "iota": "arange",
        "convert": "astype",
        "slice": "nm.slice",
    }
    missing = [n for n in nm.REGISTRY if not re.search(re.escape(public.get(n, n)), text)]
    assert not missing
