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


def test_a_program_given_too_many_or_too_few_inputs_or_none_is_an_argument_error():
    def two(t, u):
        return t + u

    lowered = lower(two, Mesh({"x": 2}), "b:x")
    for args, why in (((X,), "missing a required argument: 'u'"), ((X,) * 3, "too many")):
        with pytest.raises(
            nm.ArgumentError,
            match=rf"a lowered function: two\(t, u\) was given {len(args)} input\(s\): {why}",
        ):
            lowered(*args)
        with pytest.raises(nm.ArgumentError, match=rf"trace: two\(t, u\) was given {len(args)}"):
            nm.trace(two, *args)
    with pytest.raises(nm.ArgumentError, match="takes its inputs by position, got keyword.* u"):
        lowered(X, u=X)
    with pytest.raises(
        nm.ArgumentError, match="lower: the program must be a function of Tensors, got 3"
    ):
        lower(3, Mesh({"x": 2}), "b:x")
    np.testing.assert_array_equal(lower(lambda *ts: ts[0] + 1, Mesh({"x": 2}), "b:x")(X, X).data, 1)


def test_a_layout_naming_an_axis_the_mesh_lacks_names_it_and_the_closest_axis():
    with pytest.raises(
        nm.LayoutError,
        match=r"layout b:rowz: rule b:rowz names mesh axis 'rowz', which .* lacks; did you mean "
        r"'rows'\? Its axes: \['rows', 'cols'\]",
    ):
        lower(lambda t: t * 2, Mesh({"rows": 2, "cols": 4}), "b:rowz").plan(X)


Q = nm.tensor(np.ones((2, 4, 8), np.float32), "heads length d_kv")
K = nm.tensor(np.ones((2, 4, 8), np.float32), "heads memory d_kv")
IDX = nm.tensor(np.array([1, 0]), "i")
INT_PARAMS = [  # (call with a float where an int is meant, what the error names)
    (lambda n: nm.one_hot(IDX, "c", n), "one_hot: the size of the new dim 'c'"),
    (lambda n: nm.slice(X, "s", n, 6), "slice: start along 's'"),
    (lambda n: nm.slice(X, "s", 0, n), "slice: stop along 's'"),
    (lambda n: nm.pad(X, {"s": (n, 0)}), "pad: the width for dim 's'"),
    (lambda n: nm.pad(X, {"s": n}), "pad: the width for dim 's'"),
    (lambda n: nm.reshape(X, {"p": n, "q": -1}, from_="s"), "reshape: the size of new dim 'p'"),
    (lambda n: nm.split(X, "s", (n, 8 - n)), "split: a part's size along 's'"),
    (lambda n: nm.shift(X, "s", n), "shift: offset"),
    (lambda n: nm.expand_dims(X, {"e": n}), "expand_dims: the size of 'e'"),
    (lambda n: nm.var(X, "s", ddof=n), "var: ddof"),
    (lambda n: nm.random.key(n), "key: seed"),
    (lambda n: nm.random.integers(0, {"i": 3}, n, 9), "integers: low"),
    (lambda n: nm.dot_product_attention(Q, K, K, window=n), "dot_product_attention: window"),
]


@pytest.mark.parametrize("call, names", INT_PARAMS, ids=[n for _, n in INT_PARAMS])
def test_an_int_parameter_refuses_a_float_rather_than_cutting_it(call, names):
    """2.0 and 2.5 alike: int(2.5) would silently run the op with 2; NumPy refuses a
    float size or index the same way. A NumPy integer is an int."""
    for bad in (2.0, 2.5, True):
        with pytest.raises(nm.ArgumentError, match=f"^{names} must be an int, got {bad!r}$"):
            call(bad)
    call(np.int64(2))  # accepted


def test_attention_flags_are_checked_at_the_call():
    with pytest.raises(nm.ShapeError, match="window must be >= 0, got -1"):
        nm.dot_product_attention(Q, K, K, window=-1)
    with pytest.raises(nm.ArgumentError, match="causal must be True or False, got 'yes'"):
        nm.dot_product_attention(Q, K, K, causal="yes")
    with pytest.raises(nm.ArgumentError, match="scale must be a number, got 'a'"):
        nm.dot_product_attention(Q, K, K, scale="a")
