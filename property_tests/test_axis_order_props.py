"""Properties over the cases `programs()` drew too rarely to find issue 13's items 3, 4,
5, 7 and 11 (namedmesh/testing/axis_strategies.py): one op along a dim split over 2 or
3 mesh axes in any order (a hand-written kind, or any other registered primitive by
its example), index tensors of any int dtype with dims in any order, 64-bit
inputs with jax_enable_x64 off and on, layout rules of any value.

1. The lowered result equals nm.reference (exactly for integers), or a DtypeError when
   the program holds a 64-bit value and x64 is off, or a LayoutError when an output's
   size is one the layout's axes do not divide; gradients equal single-device ones.
2. A layout rule of any value builds a Layout or raises a LayoutError, never another
   error; a mesh over any list of things builds only over distinct jax devices.
"""

import contextlib
import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import namedmesh as nm
from lowering import Layout, Mesh
from namedmesh.testing import CASES, compare
from namedmesh.testing import lowered as cached_lower
from namedmesh.testing import strategies as S

# Each case compiles once: a fifth of the profile's examples (60 under ci); a gradient
# compiles the backward pass too: a twentieth (15 under ci).
SOME = settings(max_examples=max(10, settings.default.max_examples // 5))
FEW = settings(max_examples=max(5, settings.default.max_examples // 20))
GRAD_KINDS = ("shift", "conv", "pool_max", "pool_mean", "cumsum", "gather", "where", "relayout")


def check_along(case, x64: bool = False) -> None:
    """Property 1 for one case, with jax_enable_x64 as `x64`."""
    program, mesh, layout = case
    with jax.enable_x64(x64) if x64 else contextlib.nullcontext():
        xs = program.example_inputs()
        graph = nm.trace(program, *xs)
        lowered = cached_lower(program, mesh, layout)
        if S.has_64_bit(graph) and not x64:
            with pytest.raises(nm.DtypeError):
                lowered(*xs)
            return
        try:
            out = lowered(*xs)
        except nm.LayoutError as e:  # a registry kind may change "p"'s size (pad, slice)
            assert indivisible_output(graph, mesh, layout), f"undeserved LayoutError: {e}"
            return
        CASES["lowered"] += 1
        compare(out, nm.reference(graph)(*xs))


def indivisible_output(graph, mesh, layout) -> bool:
    """Whether some output's dim has a size its rule's mesh axes do not divide."""
    for v in graph.outputs:
        for d, axes in layout.rules:
            if d in v.dims and v.shape[v.dims.index(d)] % math.prod(mesh.sizes[a] for a in axes):
                return True
    return False


@SOME
@given(S.axis_order_cases(), st.integers(0, 3))
def test_ops_along_a_dim_over_mesh_axes_in_any_order_equal_reference(case, x64):
    check_along(case, x64=x64 == 0)  # x64 on in a quarter of the cases


@FEW
@given(S.axis_order_cases(kinds=GRAD_KINDS, x_dtypes=("float32",)))
def test_gradients_along_a_dim_over_mesh_axes_in_any_order(case):
    program, mesh, layout = case
    x, idx = program.example_inputs()

    def loss(x, idx):
        outs = program(x, idx)
        outs = outs if isinstance(outs, list) else [outs]
        return sum((o.astype(np.float32) ** 2).mean() for o in outs if o.dtype.kind == "f")

    lowered = cached_lower(loss, mesh, layout)
    got = jax.jit(jax.grad(lambda x: lowered(x, idx).data))(x)  # one compile each
    want = jax.jit(jax.grad(lambda x: loss(x, idx).data))(x)
    CASES["lowered"] += 1
    compare(got, nm.tensor(np.asarray(want.data), want.dims), rtol=1e-3)


@settings(max_examples=settings.default.max_examples)
@given(st.dictionaries(st.sampled_from(["b", "d", ""]), S.rule_values(), max_size=3))
def test_any_layout_rule_value_is_a_layout_or_a_layout_error(rules):
    try:
        layout = Layout(rules)
    except nm.LayoutError:
        return
    for dim, axes in layout.rules:
        assert isinstance(dim, str) and dim
        assert axes and all(isinstance(a, str) and a for a in axes)


@settings(max_examples=settings.default.max_examples)
@given(st.lists(st.one_of(st.integers(0, 7), st.sampled_from([None, 1.5, "cpu"])), max_size=4))
def test_a_mesh_is_built_only_over_distinct_jax_devices(picks):
    devices = [jax.devices()[p] if isinstance(p, int) else p for p in picks]
    try:
        mesh = Mesh({"a": 2}, devices=devices)
    except nm.MeshError:
        return
    used = list(mesh.jax_mesh.devices.flat)
    assert all(isinstance(d, jax.Device) for d in devices)
    assert len(set(devices)) == len(devices) and len(used) == 2
