"""The 64-bit policy (docs/lowering.md): with jax_enable_x64 on, 64-bit programs lowered
equal NumPy in 64 bits; with it off, a DtypeError names the 64-bit value before anything
compiles (issue 13, item 7)."""

import jax
import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, lower

MESH = Mesh({"rows": 2, "cols": 4})
R = np.random.default_rng(7)
BIG = np.array([2**40, 3, -(2**50), 7, 2**62, 0, 1, -1], np.int64)
A = R.normal(size=(8, 4))  # float64
W = R.normal(size=(4, 8))


def test_int64_plus_one_as_the_issue_reports_it_is_refused_with_x64_off():
    inc = lower(lambda t: t + 1, MESH, "batch:cols")
    with pytest.raises(nm.DtypeError, match=r"input 0 \(batch: 8\) is int64"):
        inc(nm.tensor(BIG, "batch"))
    with pytest.raises(nm.DtypeError, match="jax_enable_x64"):
        inc.plan(nm.tensor(BIG, "batch"))


@pytest.mark.parametrize(
    "fn, args, named",
    [
        (lambda a: a * 2, [nm.tensor(A, "batch d")], r"input 0 \(batch: 8, d: 4\) is float64"),
        (lambda a: a + nm.tensor(A, "batch d"), [nm.tensor(A.astype(np.float32), "batch d")],
         r"a constant \(batch: 8, d: 4\) is float64"),
        (lambda a: nm.astype(a, np.float64), [nm.tensor(A.astype(np.float32), "batch d")],
         r"the result of convert \(batch: 8, d: 4\) is float64"),
        (lambda c, i: nm.where(c > 0, c, i), [nm.tensor(np.arange(8, dtype=np.uint32), "batch"),
         nm.tensor(np.arange(8, dtype=np.int8), "batch")], "the result of where .* is int64"),
    ],
)  # fmt: skip
def test_every_64_bit_value_is_named_with_x64_off(fn, args, named):
    with pytest.raises(nm.DtypeError, match=named):
        lower(fn, MESH, "batch:cols")(*args)


def test_64_bit_programs_equal_numpy_with_x64_on():
    idx = np.array([-8, 0, 3, 7, 2, 5, 1, -1], np.int64)

    def fn(big, a, w, idx):
        h = nm.einsum(a, w, out="batch f")
        return [
            big + 1,
            big * 3 - big,
            nm.max(big, "batch"),
            nm.cumsum(big, "batch"),
            nm.shift(big, "batch", 1, fill=-5),
            h,
            nm.sum(h, "batch"),
            nm.argmax(h, "batch"),
            nm.gather(h, "batch", nm.rename(idx, {"batch": "i"})),
        ]

    clip = np.clip(np.where(idx < 0, idx + 8, idx), 0, 7)
    h = A @ W
    want = [
        BIG + 1,
        BIG * 3 - BIG,
        BIG.max(),
        np.cumsum(BIG),
        np.concatenate([[-5], BIG[:-1]]),
        h,
        h.sum(0),
        h.argmax(0).astype(np.int32),
        h[clip],
    ]
    with jax.enable_x64(True):
        args = [nm.tensor(BIG, "batch"), nm.tensor(A, "batch d"), nm.tensor(W, "d f")]
        args.append(nm.tensor(idx, "batch"))
        for rule in ["batch:cols,rows", "d:cols;f:rows"]:
            got = lower(fn, MESH, rule)(*args)
            for n, (g, w) in enumerate(zip(got, want, strict=True)):
                assert g.dtype == w.dtype, (rule, n, g.dtype, w.dtype)
                if w.dtype.kind == "f":
                    np.testing.assert_allclose(np.asarray(g.data), w, rtol=1e-12, err_msg=rule)
                else:
                    np.testing.assert_array_equal(np.asarray(g.data), w, err_msg=f"{rule} {n}")


def test_a_program_planned_with_x64_on_is_checked_again_with_it_off():
    inc = lower(lambda t: t + 1, MESH, "batch:cols")
    x = nm.tensor(BIG, "batch")
    with jax.enable_x64(True):
        assert np.array_equal(np.asarray(inc(x).data), BIG + 1)
    with pytest.raises(nm.DtypeError):
        inc(x)
