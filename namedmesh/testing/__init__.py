"""namedmesh.testing: check that a function gives the same answer under any mesh and layout.

`assert_same_as_reference(fn, mesh, layout, *inputs)` checks one case: `fn` lowered
onto `mesh` under `layout` against `nm.reference`, its single-device NumPy run.
`check_layouts(fn, *inputs)` draws meshes and layouts with hypothesis and, on a
mismatch, fails with the smallest mesh and layout it found and a snippet that
reproduces it. namedmesh.testing is the floor above `lowering`, which it imports; the
language (every other namedmesh module) imports neither (tests/test_layering.py).
"""

from __future__ import annotations

import functools

import jax
import ml_dtypes
import numpy as np

import namedmesh as nm
from lowering import Layout, lower
from namedmesh.primitive import is_inexact
from namedmesh.tensor import Tensor
from namedmesh.testing import strategies

CASES = {"lowered": 0}  # how many cases were lowered and run, for the suites' reports


def tolerance(dtype) -> tuple[float, float]:
    """(rtol, atol relative to the result's largest finite magnitude) fit for `dtype`."""
    dt = np.dtype(dtype)
    if not is_inexact(dt):
        return 0.0, 0.0
    return {2: (2e-2, 2e-2), 4: (2e-4, 2e-5), 8: (1e-9, 1e-12)}.get(dt.itemsize, (2e-4, 2e-5))


@functools.lru_cache(maxsize=256)
def lowered(fn, mesh, layout):
    """`lowering.lower(fn, mesh, layout, check=True)`, cached: a case hypothesis replays
    while it shrinks (same fn, mesh and layout; Programs compare by value) is not compiled
    again. The emitter's check holds every value it makes to the plan as it traces."""
    return lower(fn, mesh, layout, check=True)


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Tensor))


def compare(got, want, rtol=None, what: str = "result") -> None:
    """AssertionError naming the leaf, dims and the largest difference where `got` differs
    from `want` (trees of Tensors): dims, order, dtype and values."""
    got_l, want_l = _leaves(got), _leaves(want)
    if len(got_l) != len(want_l):
        raise AssertionError(f"{what}: {len(got_l)} results, the reference has {len(want_l)}")
    for n, (g, w) in enumerate(zip(got_l, want_l, strict=True)):
        if g.dims != w.dims or g.shape != w.shape:
            raise AssertionError(f"{what} {n}: dims {g.sizes}, the reference has {w.sizes}")
        if g.dtype != w.dtype:
            raise AssertionError(f"{what} {n} {w.dims}: dtype {g.dtype}, reference {w.dtype}")
        r, a = tolerance(w.dtype) if rtol is None else (rtol, rtol)
        gv, wv = np.asarray(g.data), np.asarray(w.data)
        # NaN, inf: equal (flattened: a 0-d int or bool result has no [:0])
        finite = wv[np.isfinite(wv)] if is_inexact(wv.dtype) else wv.reshape(-1)[:0]
        scale = float(np.max(np.abs(finite), initial=0.0))
        close = np.isclose(gv, wv, rtol=r, atol=a * max(scale, 1.0), equal_nan=True)
        if not close.all() and not np.all(close | _both_subnormal(gv, wv)):
            diff = np.max(np.abs(gv.astype(np.float64) - wv.astype(np.float64)))
            raise AssertionError(
                f"{what} {n} {w.sizes}: differs from the reference by up to "
                f"{diff:.3g} (rtol {r}, atol {a} x {max(scale, 1.0):.3g})"
            )


def _both_subnormal(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Where both are below the real float dtype's smallest normal number: a subnormal
    result and zero are alike, since compiled XLA code on CPU (and GPUs, TPUs) may flush
    subnormals to zero, which NumPy's reference keeps (bfloat16's mean of 0 and its
    smallest normal 1.2e-38 is 5.9e-39 in NumPy, 0 lowered)."""
    if not is_inexact(want.dtype) or want.dtype.kind == "c":
        return np.zeros(want.shape, bool)
    tiny = float(ml_dtypes.finfo(want.dtype).tiny)
    return (np.abs(got.astype(np.float64)) < tiny) & (np.abs(want.astype(np.float64)) < tiny)


def assert_same_as_reference(fn, mesh, layout, *inputs, rtol: float | None = None) -> None:
    """`fn(*inputs)` lowered onto `mesh` under `layout` equals its NumPy reference (dims,
    order, dtype, and values within a tolerance fit for the dtype, or `rtol`)."""
    layout = layout if isinstance(layout, Layout) else Layout(layout)
    want = nm.reference(nm.trace(fn, *inputs))(*inputs)
    got = lowered(fn, mesh, layout)(*inputs)
    CASES["lowered"] += 1
    compare(got, want, rtol, f"on {mesh} under {layout!r}: result")


def snippet(fn, mesh, layout) -> str:
    """Code that reproduces one case, given the same `fn` and `inputs`."""
    name = getattr(fn, "__name__", "fn")
    return (
        "from lowering import Layout, Mesh\n"
        "from namedmesh.testing import assert_same_as_reference\n"
        f"assert_same_as_reference({name}, Mesh({mesh.sizes!r}), {layout!r}, *inputs)"
    )


def check_layouts(
    fn, *inputs, meshes=None, layouts=None, max_examples: int = 100, rtol: float | None = None
) -> int:
    """Check `fn(*inputs)` lowered under many meshes and layouts against its reference.

    `meshes` and `layouts` are lists to choose from; by default meshes of up to all the
    devices and layouts over `fn`'s dims are drawn. Layouts that do not fit the inputs
    (a size its axes do not divide) are skipped. On a mismatch, raises AssertionError
    with the smallest mesh and layout found and a snippet to reproduce it; otherwise
    returns the number of cases run.
    """
    from hypothesis import HealthCheck, assume, given, settings
    from hypothesis import strategies as st

    graph = nm.trace(fn, *inputs)
    dim_names = list(
        dict.fromkeys(
            [d for v in graph.inputs for d in v.dims]
            + [d for e in graph.eqns for v in e.outputs for d in v.dims]
        )
    )
    mesh_st = st.sampled_from(list(meshes)) if meshes else strategies.meshes()
    failure: dict = {}
    ran = [0]

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def run(data):
        mesh = data.draw(mesh_st, label="mesh")
        if layouts:
            layout = data.draw(st.sampled_from(list(layouts)), label="layout")
            layout = layout if isinstance(layout, Layout) else Layout(layout)
        else:
            layout = data.draw(strategies.layouts(dim_names, mesh), label="layout")
        try:
            assert_same_as_reference(fn, mesh, layout, *inputs, rtol=rtol)
        except nm.LayoutError:
            assume(False)
        except Exception as e:
            failure.update(mesh=mesh, layout=layout, error=e)
            raise
        ran[0] += 1

    try:
        run()
    except Exception as e:
        if not failure:
            raise
        raise AssertionError(
            f"{getattr(fn, '__name__', 'fn')} differs from its reference on "
            f"{failure['mesh']} under {failure['layout']!r} (the smallest case found):\n"
            f"  {failure['error']}\nReproduce with:\n"
            + snippet(fn, failure["mesh"], failure["layout"])
        ) from e
    return ran[0]


__all__ = [
    "CASES",
    "assert_same_as_reference",
    "check_layouts",
    "compare",
    "snippet",
    "strategies",
    "tolerance",
]
