"""lowering.mesh.Mesh and lowering.layout.Layout: construction, parsing, errors, rule order."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import namedmesh as nm
from lowering.layout import Layout, check_divisible, local_shape, partition_spec
from lowering.lower import lower
from lowering.mesh import Mesh
from namedmesh.errors import LayoutError, MeshError, NamedMeshError

# --- Mesh -------------------------------------------------------------------------------


def test_mesh_sizes_axis_names_and_devices():
    m = Mesh({"rows": 2, "cols": 4})
    assert m.sizes == {"rows": 2, "cols": 4}
    assert m.axis_names == ("rows", "cols")
    assert m.size == 8
    assert m.jax_mesh.axis_names == ("rows", "cols")
    assert m.jax_mesh.devices.shape == (2, 4)
    # row-major over the first prod(sizes) devices
    assert list(m.jax_mesh.devices.flat) == jax.devices()[:8]
    assert repr(m) == "Mesh(rows=2, cols=4)"


def test_mesh_order_of_axes_is_kept():
    m = Mesh({"cols": 4, "rows": 2})
    assert m.axis_names == ("cols", "rows")
    assert m.jax_mesh.devices.shape == (4, 2)


def test_mesh_smaller_than_device_count_uses_first_devices():
    m = Mesh({"x": 2})
    assert m.size == 2 and list(m.jax_mesh.devices.flat) == jax.devices()[:2]


def test_mesh_on_given_devices():
    devs = jax.devices()[4:8]
    m = Mesh({"a": 2, "b": 2}, devices=devs)
    assert list(m.jax_mesh.devices.flat) == devs


def test_mesh_three_axes():
    m = Mesh({"a": 2, "b": 2, "c": 2})
    assert m.axis_names == ("a", "b", "c") and m.size == 8
    assert m.jax_mesh.devices.shape == (2, 2, 2)


def test_mesh_equality_and_hash():
    assert Mesh({"rows": 2, "cols": 4}) == Mesh({"rows": 2, "cols": 4})
    assert hash(Mesh({"rows": 2, "cols": 4})) == hash(Mesh({"rows": 2, "cols": 4}))
    assert Mesh({"rows": 2, "cols": 4}) != Mesh({"rows": 4, "cols": 2})


def test_mesh_too_few_devices():
    with pytest.raises(MeshError, match="16") as info:
        Mesh({"rows": 4, "cols": 4})
    assert "8" in str(info.value)
    assert isinstance(info.value, NamedMeshError)


def test_mesh_too_few_given_devices():
    with pytest.raises(MeshError, match="needs 4 devices"):
        Mesh({"a": 2, "b": 2}, devices=jax.devices()[:3])


@pytest.mark.parametrize("size", [0, -1, -4, 2.0, "2", None])
def test_mesh_rejects_sizes_that_are_not_positive_ints(size):
    with pytest.raises(MeshError, match="rows"):
        Mesh({"rows": size, "cols": 2})


@pytest.mark.parametrize("name", ["", 1, None, ("a",)])
def test_mesh_rejects_bad_axis_names(name):
    with pytest.raises(MeshError):
        Mesh({name: 2})


@pytest.mark.parametrize("sizes", [{}, [("rows", 2)], "rows:2", None, 8])
def test_mesh_needs_a_nonempty_mapping(sizes):
    with pytest.raises(MeshError):
        Mesh(sizes)


def test_mesh_accepts_numpy_int_sizes():
    m = Mesh({"rows": np.int64(2), "cols": np.int32(4)})
    assert m.sizes == {"rows": 2, "cols": 4}
    assert all(type(v) is int for v in m.sizes.values())


# --- Layout parsing ---------------------------------------------------------------------


def test_parse_two_rules():
    lay = Layout("batch:rows;d_ff:cols")
    assert lay.rules == (("batch", ("rows",)), ("d_ff", ("cols",)))


def test_parse_dim_over_two_axes():
    assert Layout("batch:rows,cols").rules == (("batch", ("rows", "cols")),)


def test_parse_whitespace_and_empty_parts():
    lay = Layout("  batch : rows , cols ;  d_ff:cols ; ")
    assert lay.rules == (("batch", ("rows", "cols")), ("d_ff", ("cols",)))
    assert Layout(";;").rules == ()


def test_parse_empty():
    assert Layout("").rules == ()
    assert Layout().rules == ()
    assert Layout({}).rules == ()
    assert Layout([]).rules == ()


def test_parse_dict():
    lay = Layout({"batch": "rows", "d_ff": ("rows", "cols")})
    assert lay.rules == (("batch", ("rows",)), ("d_ff", ("rows", "cols")))


def test_parse_list_of_pairs():
    lay = Layout([("batch", "rows"), ("d_ff", ["cols"]), ("d_model", ("rows", "cols"))])
    assert lay.rules == (
        ("batch", ("rows",)),
        ("d_ff", ("cols",)),
        ("d_model", ("rows", "cols")),
    )


def test_string_dict_and_list_forms_are_equal():
    a = Layout("batch:rows;d_ff:cols,rows")
    b = Layout({"batch": "rows", "d_ff": ("cols", "rows")})
    c = Layout([("batch", ("rows",)), ("d_ff", ["cols", "rows"])])
    assert a == b == c
    assert hash(a) == hash(b) == hash(c)
    assert a != Layout("d_ff:cols,rows;batch:rows")  # rules are ordered
    assert a != Layout("batch:rows;d_ff:cols,rows", strict=True)


def test_repr_round_trips():
    lay = Layout("batch:rows,cols;d_ff:cols")
    assert repr(lay) == "Layout('batch:rows,cols;d_ff:cols')"
    assert eval(repr(lay), {"Layout": Layout}) == lay
    assert "strict=True" in repr(Layout("batch:rows", strict=True))


@pytest.mark.parametrize(
    "text",
    ["batch", "batch:", ":rows", " : ", "batch:rows;d_ff", "batch: ;d_ff:cols", "batch:rows,"],
)
def test_malformed_strings(text):
    with pytest.raises(LayoutError):
        Layout(text)


def test_malformed_string_message_names_the_rule():
    with pytest.raises(LayoutError, match="d_ff") as info:
        Layout("batch:rows;d_ff")
    assert "dim:axis" in str(info.value)


def test_two_colons_never_lowers():
    """'a:b:c' is not a valid rule; at the latest it must fail as an unknown mesh axis."""
    mesh = Mesh({"b": 2, "c": 4})
    with pytest.raises(LayoutError):
        Layout("a:b:c").check(mesh)


def test_two_colons_is_malformed():
    with pytest.raises(LayoutError):
        Layout("a:b:c")


@pytest.mark.parametrize(
    "rules",
    [
        "batch:rows;batch:cols",
        "batch:rows; d_ff:cols ;batch:rows",
        [("batch", "rows"), ("batch", "cols")],
    ],
)
def test_dim_mapped_twice(rules):
    with pytest.raises(LayoutError, match="batch"):
        Layout(rules)


@pytest.mark.parametrize(
    "rules",
    ["batch:rows,rows", {"batch": ("rows", "rows")}, [("batch", ["cols", "rows", "cols"])]],
)
def test_repeated_axis_in_one_rule(rules):
    with pytest.raises(LayoutError, match="batch"):
        Layout(rules)


@pytest.mark.parametrize(
    "rules",
    [
        5,
        [("batch",)],
        [("batch", "rows", "cols")],
        [(1, "rows")],
        {"batch": ()},
        {"batch": ""},
        {"batch": ("rows", 3)},
        "batch:rows,,cols",
    ],
)
def test_malformed_rules_of_other_forms(rules):
    with pytest.raises(LayoutError):
        Layout(rules)


def test_layout_errors_are_value_errors():
    with pytest.raises(ValueError):
        Layout("batch")
    assert issubclass(LayoutError, NamedMeshError)


# --- Layout.check: unknown mesh axes ----------------------------------------------------


def test_check_unknown_mesh_axis():
    mesh = Mesh({"rows": 2, "cols": 4})
    Layout("batch:rows;d_ff:cols,rows").check(mesh)
    with pytest.raises(LayoutError) as info:
        Layout("batch:rows;d_ff:model").check(mesh)
    msg = str(info.value)
    assert "model" in msg and "d_ff" in msg and "Mesh(rows=2, cols=4)" in msg


def test_unknown_mesh_axis_is_reported_by_lower_before_any_call():
    mesh = Mesh({"rows": 2, "cols": 4})
    with pytest.raises(LayoutError, match="'model'"):
        lower(lambda x: x * 2, mesh, "batch:rows;d_ff:model")


def test_unknown_mesh_axis_reported_by_of():
    mesh = Mesh({"x": 8})
    with pytest.raises(LayoutError, match="rows"):
        Layout("batch:rows").of(("batch",), (8,), mesh)


def test_lower_rejects_a_non_mesh():
    with pytest.raises(MeshError, match=r"lower needs a lowering.Mesh, got dict; write Mesh\("):
        lower(lambda x: x, {"rows": 2}, "batch:rows")


# --- Layout.of: divisibility --------------------------------------------------------------


def test_of_gives_axes_per_dim():
    mesh = Mesh({"rows": 2, "cols": 4})
    lay = Layout("batch:rows;d_ff:cols")
    assert lay.of(("batch", "d_model"), (8, 16), mesh) == (("rows",), ())
    assert lay.of(("d_model", "d_ff"), (16, 32), mesh) == ((), ("cols",))
    assert lay.of(("batch", "d_ff"), (8, 32), mesh) == (("rows",), ("cols",))
    assert lay.of(("d_ff", "batch"), (32, 8), mesh) == (("cols",), ("rows",))
    assert lay.of((), (), mesh) == ()


def test_not_divisible_message_names_tensor_dim_size_axes_rule():
    mesh = Mesh({"rows": 2, "cols": 4})
    lay = Layout("batch:rows;d_ff:cols")
    with pytest.raises(LayoutError) as info:
        lay.of(("batch", "d_ff"), (8, 6), mesh, "weight w1")
    msg = str(info.value)
    for part in ["weight w1", "'d_ff'", "6", "('cols',)", "4", "d_ff:cols", "batch:rows;d_ff:cols"]:
        assert part in msg, (part, msg)


def test_not_divisible_by_two_axes():
    mesh = Mesh({"rows": 2, "cols": 4})
    with pytest.raises(LayoutError) as info:
        Layout("batch:rows,cols").of(("batch",), (12,), mesh)
    msg = str(info.value)
    assert "'batch'" in msg and "12" in msg and "('rows', 'cols')" in msg and "8" in msg


def test_check_divisible_directly():
    mesh = Mesh({"rows": 2, "cols": 4})
    check_divisible((("rows",), ()), ("a", "b"), (4, 3), mesh, "t")
    with pytest.raises(LayoutError, match="'b' of size 3"):
        check_divisible(((), ("cols",)), ("a", "b"), (4, 3), mesh, "t")


def test_lowered_call_with_indivisible_input_names_the_input():
    mesh = Mesh({"rows": 2, "cols": 4})
    x = nm.tensor(np.ones((6, 16), np.float32), "batch d_model")
    f = lower(lambda x: x * 2, mesh, "batch:cols")
    with pytest.raises(LayoutError) as info:
        f(x)
    msg = str(info.value)
    for part in ["input 0", "batch: 6", "'batch'", "size 6", "('cols',)", "batch:cols"]:
        assert part in msg, (part, msg)
    with pytest.raises(LayoutError):  # before compilation too
        f.compile(x)
    with pytest.raises(LayoutError):
        f.plan(x)


def test_lowered_call_with_indivisible_output_names_the_output():
    mesh = Mesh({"rows": 2, "cols": 4})
    x = nm.tensor(np.ones((8, 16), np.float32), "batch d")
    f = lower(lambda x: nm.slice(x, "d", 0, 6), mesh, "d:cols")
    with pytest.raises(LayoutError) as info:
        f(x)
    msg = str(info.value)
    assert "output 0" in msg and "'d'" in msg and "6" in msg and "d:cols" in msg


# --- ordered rules ------------------------------------------------------------------------


def test_ordered_rules_skip_an_axis_taken_by_an_earlier_rule():
    lay = Layout("d_model:cols;d_ff:cols")
    assert lay.assign(("d_model", "d_ff")) == (("cols",), ())
    assert lay.assign(("d_ff", "d_model")) == ((), ("cols",))  # rule order, not dim order
    assert lay.assign(("batch", "d_ff")) == ((), ("cols",))
    assert lay.assign(("batch", "d_model")) == ((), ("cols",))


def test_ordered_rules_partial_skip_of_a_multi_axis_rule():
    lay = Layout("batch:rows;d_ff:rows,cols")
    assert lay.assign(("batch", "d_ff")) == (("rows",), ("cols",))
    assert lay.assign(("d_ff",)) == (("rows", "cols"),)
    mesh = Mesh({"rows": 2, "cols": 4})
    assert lay.of(("d_model", "d_ff"), (16, 32), mesh) == ((), ("rows", "cols"))


def test_ordered_rules_of_on_mesh():
    mesh = Mesh({"rows": 2, "cols": 4})
    lay = Layout("d_model:cols;d_ff:cols")
    assert lay.of(("d_model", "d_ff"), (16, 32), mesh) == (("cols",), ())
    assert lay.of(("batch", "d_ff"), (8, 32), mesh) == ((), ("cols",))


def test_ordered_rules_in_a_lowered_program():
    """w[d_model, d_ff] is split on d_model only; the output [batch, d_ff] on d_ff."""
    mesh = Mesh({"rows": 2, "cols": 4})
    rng = np.random.default_rng(0)
    x = nm.tensor(rng.normal(size=(8, 16)).astype(np.float32), "batch d_model")
    w = nm.tensor(rng.normal(size=(16, 32)).astype(np.float32), "d_model d_ff")
    f = lower(lambda x, w: nm.einsum(x, w), mesh, "d_model:cols;d_ff:cols")
    assert f.local_shapes(x, w) == [(8, 4), (4, 32)]
    y = f(x, w)
    assert y.dims == ("batch", "d_ff")
    assert y.data.sharding.shard_shape(y.shape) == (8, 8)
    np.testing.assert_allclose(np.asarray(y.data), x.data @ w.data, rtol=1e-5, atol=1e-5)


def test_strict_rejects_the_conflict():
    lay = Layout("d_model:cols;d_ff:cols", strict=True)
    assert lay.assign(("batch", "d_ff")) == ((), ("cols",))  # no conflict here
    with pytest.raises(LayoutError) as info:
        lay.assign(("d_model", "d_ff"), (16, 32), "weight")
    msg = str(info.value)
    assert "'d_model'" in msg and "'d_ff'" in msg and "'cols'" in msg and "weight" in msg


def test_strict_conflict_is_raised_by_lower():
    mesh = Mesh({"rows": 2, "cols": 4})
    x = nm.tensor(np.ones((8, 16), np.float32), "batch d_model")
    w = nm.tensor(np.ones((16, 32), np.float32), "d_model d_ff")
    f = lower(lambda x, w: nm.einsum(x, w), mesh, Layout("d_model:cols;d_ff:cols", strict=True))
    with pytest.raises(LayoutError) as info:
        f(x, w)
    msg = str(info.value)
    assert "'d_model'" in msg and "'d_ff'" in msg and "'cols'" in msg


def test_strict_conflict_in_a_multi_axis_rule():
    lay = Layout("batch:rows;d_ff:rows,cols", strict=True)
    assert lay.assign(("d_ff",)) == (("rows", "cols"),)
    with pytest.raises(LayoutError, match="'rows'"):
        lay.assign(("batch", "d_ff"))


# --- partition_spec / local_shape ----------------------------------------------------------


def test_partition_spec_of_layouts():
    assert partition_spec(()) == P()
    assert partition_spec(((), ())) == P(None, None)
    assert partition_spec((("rows",), ())) == P("rows", None)
    assert partition_spec(((), ("cols",))) == P(None, "cols")
    assert partition_spec((("rows", "cols"), ())) == P(("rows", "cols"), None)
    assert partition_spec((("cols",), ("rows",), ())) == P("cols", "rows", None)
    assert isinstance(partition_spec((("rows",),)), P)


def test_partition_spec_of_rule_layouts():
    mesh = Mesh({"rows": 2, "cols": 4})
    of = lambda rules, dims, shape: partition_spec(Layout(rules).of(dims, shape, mesh))
    assert of("batch:rows;d_ff:cols", ("batch", "d_model"), (8, 16)) == P("rows", None)
    assert of("batch:rows;d_ff:cols", ("d_model", "d_ff"), (16, 32)) == P(None, "cols")
    assert of("batch:rows,cols", ("batch", "d_model"), (8, 16)) == P(("rows", "cols"), None)
    assert of("d_model:cols;d_ff:cols", ("d_model", "d_ff"), (16, 32)) == P("cols", None)
    assert of("", ("batch", "d_model"), (8, 16)) == P(None, None)


def test_local_shape():
    mesh = Mesh({"rows": 2, "cols": 4})
    assert local_shape((("rows",), ("cols",)), (8, 16), mesh) == (4, 4)
    assert local_shape((("rows", "cols"), ()), (8, 16), mesh) == (1, 16)
    assert local_shape(((), ()), (8, 16), mesh) == (8, 16)
