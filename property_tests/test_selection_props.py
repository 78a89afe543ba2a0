"""isel, var/std, expand_dims/squeeze, update_slice and gather (starts and indices
negative and beyond either end) in random programs, on random meshes and layouts: the
lowered result equals the NumPy reference (or the layout deserves its LayoutError), as
for every other op. A focused draw: the general suite draws most of these kinds too,
but rarely next to each other, and update_slice only here."""

from hypothesis import given, settings
from test_lowering_props import check_case

from namedmesh.testing import strategies as S

KINDS = ("slice", "var", "std", "expand_dims", "squeeze", "einsum", "add", "sum", "update_slice",
         "gather")  # fmt: skip


@settings(max_examples=40)  # the general suite covers them too; this adds a focused 40
@given(S.cases(max_steps=4, kinds=KINDS))
def test_selection_ops_equal_reference_or_deserved_layout_error(case):
    check_case(case)
