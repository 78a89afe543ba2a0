"""Bad layouts, meshes, constraints and arguments: a typed error at the call that made the
mistake, naming the rule, value, device or argument (issue 13, item 11)."""

import jax
import numpy as np
import pytest

import namedmesh as nm
from lowering import Layout, Mesh, lower

X = nm.tensor(np.zeros((4, 8), np.float32), "b s")


@pytest.mark.parametrize(
    "rules, match",
    [
        ({"b": 3}, r"rule for dim 'b': mesh axes must be an axis name .* got 3"),
        ({"b": None}, r"rule for dim 'b': mesh axes must be an axis name .* got None"),
        ({"b": ["x", 3]}, r"rule for dim 'b': mesh axes \('x', 3\)"),
        ({"b": ("x", "x")}, r"rule for dim 'b': mesh axes \('x', 'x'\)"),
        ([("b",)], r"malformed rule \('b',\)"),
        (["bx"], r"malformed rule 'bx'"),
        ({"": "x"}, r"malformed rule \('', 'x'\)"),
        ("b:x;b", r"malformed rule 'b'"),
        (3, "must be a string, dict or list"),
    ],
)
def test_malformed_layout_rules_are_layout_errors_naming_the_rule(rules, match):
    with pytest.raises(nm.LayoutError, match=match):
        Layout(rules)


@pytest.mark.parametrize(
    "rules, match",
    [
        ([("b",)], r"constrain of the value \(b: 4, s: 8\): malformed rule \('b',\)"),
        ({"b": 3}, r"constrain of the value \(b: 4, s: 8\): rule for dim 'b'.* got 3"),
        ("b:", r"constrain of the value \(b: 4, s: 8\): malformed rule 'b:'"),
        ("q:x", r"constrain 'q:x': names dim\(s\) \['q'\] that the value \('b', 's'\) lacks"),
        ("b:x;s:x", r"constrain 'b:x;s:x': mesh axis 'x' would split both 'b' and 's'"),
    ],
)
def test_a_bad_constraint_fails_at_the_nm_constrain_call(rules, match):
    with pytest.raises(nm.LayoutError, match=match):
        nm.constrain(X, rules)  # eagerly: no mesh, no lowering


def test_a_constraint_naming_an_axis_the_mesh_lacks_fails_when_lowered_naming_it():
    fn = lambda t: nm.constrain(t * 2, "s:x;b:q")
    assert np.array_equal(fn(X).data, X.data * 2)  # no mesh yet: nothing to check
    with pytest.raises(
        nm.LayoutError,
        match=r"nm.constrain\(\(b: 4, s: 8\), 's:x;b:q'\): rule b:q names mesh axis 'q', which",
    ):
        lower(fn, Mesh({"x": 2}), "b:x").plan(X)


def test_mesh_devices_must_be_distinct_jax_devices():
    d = jax.devices()
    with pytest.raises(nm.MeshError, match=r"device .* is given twice, as devices\[0\] and"):
        Mesh({"a": 2}, devices=[d[0], d[0]])
    with pytest.raises(nm.MeshError, match=r"devices\[0\] is a int \(1\), not a jax device"):
        Mesh({"a": 2}, devices=[1, 2])
    with pytest.raises(nm.MeshError, match="sequence of jax devices, got 5"):
        Mesh({"a": 2}, devices=5)
    assert Mesh({"a": 2}, devices=np.array(d[2:4])).jax_mesh.devices.tolist() == d[2:4]


def test_a_non_tensor_argument_is_an_argument_error_naming_its_position():
    lowered = lower(lambda t, u: t, Mesh({"x": 2}), "b:x")
    with pytest.raises(nm.ArgumentError, match=r"got a ndarray as argument \[1\]"):
        lowered(X, np.zeros(3))
    with pytest.raises(nm.ArgumentError, match=r"got a int as argument \[0\]\['w'\]\[1\]"):
        lowered({"w": [X, 3]}, X)
    assert issubclass(nm.ArgumentError, nm.NamedMeshError)
    assert issubclass(nm.ArgumentError, TypeError)


def test_a_layout_naming_an_axis_the_mesh_lacks_names_it_and_the_closest_axis():
    with pytest.raises(
        nm.LayoutError,
        match=r"layout b:rowz: rule b:rowz names mesh axis 'rowz', which .* lacks; did you mean "
        r"'rows'\? Its axes: \['rows', 'cols'\]",
    ):
        lower(lambda t: t * 2, Mesh({"rows": 2, "cols": 4}), "b:rowz").plan(X)
