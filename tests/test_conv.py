"""nm.conv and nm.pool against naive loops written here (and jax.lax for "SAME" sizes).

Each case runs four ways: eagerly on NumPy, under `jax.jit` with jax inputs, and traced
then run by `nm.reference` (NumPy) and `nm.interpret` (jax).
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import namedmesh as nm
from namedmesh import ShapeError

RNG = np.random.default_rng(1)


# --- helpers -------------------------------------------------------------------------
def rand(dims: str, *shape, dtype=np.float32) -> nm.Tensor:
    if np.dtype(dtype).kind in "iu":
        return nm.tensor(RNG.integers(-20, 20, size=shape).astype(dtype), dims)
    return nm.tensor(RNG.standard_normal(shape).astype(dtype), dims)


def to_jax(t: nm.Tensor) -> nm.Tensor:
    return nm.Tensor(jnp.asarray(t.data), t.dims)


def run_paths(fn, *inputs) -> dict[str, nm.Tensor]:
    """`fn(*inputs)` eagerly, under jax.jit (jax inputs), via nm.reference and nm.interpret."""
    eager = fn(*inputs)
    assert isinstance(eager.data, np.ndarray)
    jitted = jax.jit(fn)(*(to_jax(t) for t in inputs))
    assert isinstance(jitted.data, jax.Array) and not isinstance(jitted.data, np.ndarray)
    graph = nm.trace(fn, *inputs)
    return {
        "eager": eager,
        "jit": jitted,
        "reference": nm.reference(graph)(*inputs),
        "interpret": nm.interpret(graph)(*inputs),
    }


def check(fn, inputs, want: np.ndarray, dims: tuple[str, ...], dtype=np.float32):
    for path, r in run_paths(fn, *inputs).items():
        assert r.dims == dims, f"{path}: dims {r.dims}, expected {dims}"
        assert r.dtype == np.dtype(dtype), f"{path}: dtype {r.dtype}"
        got = np.asarray(r)
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=path)


def same_pads(n: int, k: int, s: int, d: int) -> tuple[int, int]:
    """TF / jax.lax "SAME": out = ceil(n / s), the extra padding mostly at the end."""
    out = -(-n // s)
    total = max((out - 1) * s + (k - 1) * d + 1 - n, 0)
    return total // 2, total - total // 2


def naive_conv(x, k, spatial, out_dims, stride=None, dilation=None, pads=None) -> np.ndarray:
    """out[o] = sum over the kernel dims not in `out_dims` (channels and windows) of
    x[..., pos * stride + win * dilation - lo, ...] * k[...], zero outside x."""
    xa, ka = np.asarray(x, np.float64), np.asarray(k, np.float64)
    xs, ks = x.sizes, k.sizes
    stride = {d: (stride or {}).get(d, 1) for d in spatial}
    dilation = {d: (dilation or {}).get(d, 1) for d in spatial}
    pads = {d: (pads or {}).get(d, (0, 0)) for d in spatial}
    out_sizes = {}
    for d in out_dims:
        if d in spatial:
            span = dilation[d] * (ks[spatial[d]] - 1) + 1
            out_sizes[d] = (xs[d] + sum(pads[d]) - span) // stride[d] + 1
        else:
            out_sizes[d] = xs[d] if d in xs else ks[d]
    summed = [d for d in k.dims if d not in out_dims]
    out = np.zeros([out_sizes[d] for d in out_dims])
    for oi in itertools.product(*(range(out_sizes[d]) for d in out_dims)):
        o = dict(zip(out_dims, oi, strict=True))
        acc = 0.0
        for si in itertools.product(*(range(ks[d]) for d in summed)):
            s = dict(zip(summed, si, strict=True))
            xi = []
            for d in x.dims:
                if d in spatial:
                    p = o[d] * stride[d] + s[spatial[d]] * dilation[d] - pads[d][0]
                    if not 0 <= p < xs[d]:
                        break
                    xi.append(p)
                else:
                    xi.append(o[d] if d in o else s[d])
            else:
                ki = tuple(o[d] if d in o else s[d] for d in k.dims)
                acc += xa[tuple(xi)] * ka[ki]
        out[oi] = acc
    return out


def naive_pool(x, window, stride, pads, kind) -> np.ndarray:
    """Max (padding ignored) or mean (padding counted as zeros) over each window."""
    xa = np.asarray(x, np.float64)
    xs = x.sizes
    out_sizes = [
        (xs[d] + sum(pads.get(d, (0, 0))) - window[d]) // stride[d] + 1 if d in window else xs[d]
        for d in x.dims
    ]
    out = np.zeros(out_sizes)
    for oi in itertools.product(*(range(n) for n in out_sizes)):
        o = dict(zip(x.dims, oi, strict=True))
        vals, count = [], 0
        for wi in itertools.product(*(range(window[d]) for d in window)):
            w = dict(zip(window, wi, strict=True))
            count += 1
            pos = [
                o[d] * stride[d] + w[d] - pads.get(d, (0, 0))[0] if d in window else o[d]
                for d in x.dims
            ]
            if all(0 <= p < xs[d] for p, d in zip(pos, x.dims, strict=True)):
                vals.append(xa[tuple(pos)])
        out[oi] = max(vals) if kind == "max" else sum(vals) / count
    return out


# --- conv 1-D -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "stride, dilation, padding",
    [
        (1, 1, "VALID"),
        (2, 1, "VALID"),
        (1, 2, "VALID"),
        (3, 2, "VALID"),
        (1, 1, {"t": (2, 1)}),
        (2, 2, {"t": (0, 3)}),
        (1, 1, "SAME"),
        (2, 1, "SAME"),
        (3, 1, "SAME"),
        (2, 2, "SAME"),
    ],
)
def test_conv_1d(stride, dilation, padding):
    n, kw = 9, 3
    x = rand("b t c", 2, n, 3)
    k = rand("kt c o", kw, 3, 4)
    if padding == "SAME":
        pads = {"t": same_pads(n, kw, stride, dilation)}
    elif padding == "VALID":
        pads = {}
    else:
        pads = padding
    want = naive_conv(x, k, {"t": "kt"}, ("b", "t", "o"), {"t": stride}, {"t": dilation}, pads)
    if padding == "SAME":
        assert want.shape[1] == math.ceil(n / stride)

    def fn(a, b):
        return nm.conv(a, b, {"t": "kt"}, stride=stride, padding=padding, dilation=dilation)

    check(fn, [x, k], want, ("b", "t", "o"))


@pytest.mark.parametrize(
    "n, kw, stride, dilation",
    [(7, 3, 1, 1), (8, 4, 2, 1), (10, 3, 3, 2), (5, 2, 4, 3), (6, 1, 2, 1), (4, 5, 1, 1)],
)
def test_conv_same_sizes_match_jax_lax(n, kw, stride, dilation):
    """Padding "SAME" gives ceil(n / stride) outputs and the values of jax.lax's "SAME"."""
    x = rand("b t c", 1, n, 2)
    k = rand("kt c o", kw, 2, 3)
    got = nm.conv(x, k, {"t": "kt"}, stride=stride, padding="SAME", dilation=dilation)
    assert got.sizes == {"b": 1, "t": math.ceil(n / stride), "o": 3}
    lhs = jnp.transpose(jnp.asarray(x.data), (0, 2, 1))  # N C W
    rhs = jnp.transpose(jnp.asarray(k.data), (2, 1, 0))  # O I W
    y = jax.lax.conv_general_dilated(lhs, rhs, (stride,), "SAME", rhs_dilation=(dilation,))
    np.testing.assert_allclose(
        np.asarray(got), np.transpose(np.asarray(y), (0, 2, 1)), rtol=1e-4, atol=1e-5
    )


# --- conv 2-D ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "stride, dilation, padding",
    [
        (1, 1, "VALID"),
        ({"h": 2}, 1, "VALID"),
        ({"h": 2, "w": 3}, {"w": 2}, "VALID"),
        (1, 1, "SAME"),
        (2, {"h": 2}, "SAME"),
        ({"w": 2}, 1, {"h": (1, 0), "w": (2, 2)}),
        (1, 2, {"w": (1, 1)}),
    ],
)
def test_conv_2d(stride, dilation, padding):
    h, w, kh, kw = 6, 7, 3, 2
    x = rand("b h w c", 2, h, w, 2)
    k = rand("kh kw c o", kh, kw, 2, 3)
    st = stride if isinstance(stride, dict) else {"h": stride, "w": stride}
    dl = dilation if isinstance(dilation, dict) else {"h": dilation, "w": dilation}
    if padding == "SAME":
        pads = {
            "h": same_pads(h, kh, st.get("h", 1), dl.get("h", 1)),
            "w": same_pads(w, kw, st.get("w", 1), dl.get("w", 1)),
        }
    elif padding == "VALID":
        pads = {}
    else:
        pads = padding
    want = naive_conv(x, k, {"h": "kh", "w": "kw"}, ("b", "h", "w", "o"), st, dl, pads)
    if padding == "SAME":
        assert want.shape[1:3] == (math.ceil(h / st.get("h", 1)), math.ceil(w / st.get("w", 1)))

    def fn(a, b):
        return nm.conv(
            a, b, {"h": "kh", "w": "kw"}, stride=stride, padding=padding, dilation=dilation
        )

    check(fn, [x, k], want, ("b", "h", "w", "o"))


def test_conv_2d_dims_in_any_order():
    """Spatial dims listed in another order than x has them; kernel dims shuffled."""
    x = rand("w b c h", 5, 2, 3, 6)
    k = rand("o kw c kh", 2, 2, 3, 3)
    sp = {"h": "kh", "w": "kw"}
    want = naive_conv(x, k, sp, ("w", "b", "h", "o"), {"h": 2}, None, {"w": (1, 0)})
    check(
        lambda a, b: nm.conv(a, b, sp, stride={"h": 2}, padding={"w": (1, 0)}),
        [x, k],
        want,
        ("w", "b", "h", "o"),
    )


def test_conv_multiple_batch_dims():
    x = rand("n h m c", 2, 7, 3, 2)
    k = rand("kh c o", 3, 2, 4)
    want = naive_conv(
        x, k, {"h": "kh"}, ("n", "h", "m", "o"), {"h": 2}, None, {"h": same_pads(7, 3, 2, 1)}
    )
    check(
        lambda a, b: nm.conv(a, b, {"h": "kh"}, stride=2, padding="SAME"),
        [x, k],
        want,
        ("n", "h", "m", "o"),
    )


def test_conv_no_batch_dim():
    x = rand("h w c", 5, 6, 2)
    k = rand("kh kw c o", 2, 3, 2, 3)
    want = naive_conv(x, k, {"h": "kh", "w": "kw"}, ("h", "w", "o"))
    check(lambda a, b: nm.conv(a, b, {"h": "kh", "w": "kw"}), [x, k], want, ("h", "w", "o"))


def test_conv_no_channel_and_no_feature_dims():
    x = rand("b t", 3, 8)
    k = rand("kt", 3)
    want = naive_conv(x, k, {"t": "kt"}, ("b", "t"), None, {"t": 2})
    check(lambda a, b: nm.conv(a, b, {"t": "kt"}, dilation=2), [x, k], want, ("b", "t"))
    # and a bare signal with a bare kernel
    x1 = rand("t", 8)
    want = naive_conv(x1, k, {"t": "kt"}, ("t",), {"t": 2}, None, {"t": (1, 1)})
    check(
        lambda a, b: nm.conv(a, b, {"t": "kt"}, stride=2, padding={"t": (1, 1)}),
        [x1, k],
        want,
        ("t",),
    )


def test_conv_several_output_feature_dims_and_channel_dims():
    x = rand("b h c1 c2", 2, 6, 2, 3)
    k = rand("o1 kh c2 c1 o2", 2, 3, 3, 2, 2)
    want = naive_conv(x, k, {"h": "kh"}, ("b", "h", "o1", "o2"), {"h": 1}, None, {"h": (1, 1)})
    check(
        lambda a, b: nm.conv(a, b, {"h": "kh"}, padding={"h": (1, 1)}),
        [x, k],
        want,
        ("b", "h", "o1", "o2"),
    )


def test_conv_matches_a_numpy_cross_correlation():
    """1-D, one channel: np.correlate is the textbook cross-correlation."""
    x = rand("t", 10)
    k = rand("kt", 4)
    got = nm.conv(x, k, {"t": "kt"})
    np.testing.assert_allclose(
        np.asarray(got),
        np.correlate(np.asarray(x), np.asarray(k), mode="valid"),
        rtol=1e-5,
        atol=1e-6,
    )
    got = nm.conv(x, k, {"t": "kt"}, padding={"t": (3, 3)})
    np.testing.assert_allclose(
        np.asarray(got),
        np.correlate(np.asarray(x), np.asarray(k), mode="full"),
        rtol=1e-5,
        atol=1e-6,
    )


def test_conv_gradient_under_jax():
    """jax.grad through nm.conv equals the gradient of the loop formula (linear in x)."""
    x = rand("b t c", 1, 5, 2)
    k = rand("kt c o", 2, 2, 1)
    g = jax.grad(lambda a: nm.conv(a, to_jax(k), {"t": "kt"}, stride=2).sum().data)(to_jax(x))
    # d/dx[b, t, c] of sum_out = sum over outputs whose window covers t of k[t - 2*pos, c]
    want = np.zeros((1, 5, 2))
    ka = np.asarray(k)
    for pos in range(2):
        for kt in range(2):
            want[0, 2 * pos + kt, :] += ka[kt, :, 0]
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-6)


# --- pool ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["max", "mean"])
@pytest.mark.parametrize(
    "window, stride, padding",
    [
        ({"t": 2}, None, "VALID"),
        ({"t": 3}, 1, "VALID"),
        ({"t": 3}, 2, "VALID"),
        ({"t": 2}, 2, "SAME"),
        ({"t": 3}, 2, "SAME"),
        ({"t": 3}, None, "SAME"),
        ({"t": 2}, 1, {"t": (1, 1)}),
    ],
)
def test_pool_1d(window, stride, padding, kind):
    n = 7
    x = rand("b t c", 2, n, 3)
    st = window if stride is None else {d: stride for d in window}
    if padding == "SAME":
        pads = {"t": same_pads(n, window["t"], st["t"], 1)}
    elif padding == "VALID":
        pads = {}
    else:
        pads = padding
    want = naive_pool(x, window, st, pads, kind)
    if padding == "SAME":
        assert want.shape[1] == math.ceil(n / st["t"])
    check(
        lambda a: nm.pool(a, window, stride=stride, padding=padding, kind=kind),
        [x],
        want,
        ("b", "t", "c"),
    )


@pytest.mark.parametrize("kind", ["max", "mean"])
@pytest.mark.parametrize(
    "window, stride, padding",
    [
        ({"h": 2, "w": 2}, None, "VALID"),
        ({"w": 3, "h": 2}, {"h": 1, "w": 2}, "VALID"),
        ({"h": 3, "w": 2}, 2, "SAME"),
        ({"h": 2, "w": 3}, 1, {"h": (1, 0), "w": (1, 1)}),
        ({"w": 2}, None, "VALID"),
    ],
)
def test_pool_2d(window, stride, padding, kind):
    h, w = 5, 6
    x = rand("b h w", 2, h, w)
    if stride is None:
        st = dict(window)
    elif isinstance(stride, dict):
        st = stride
    else:
        st = {d: stride for d in window}
    sizes = {"h": h, "w": w}
    if padding == "SAME":
        pads = {d: same_pads(sizes[d], window[d], st[d], 1) for d in window}
    elif padding == "VALID":
        pads = {}
    else:
        pads = padding
    want = naive_pool(x, window, st, pads, kind)
    check(
        lambda a: nm.pool(a, window, stride=stride, padding=padding, kind=kind),
        [x],
        want,
        ("b", "h", "w"),
    )


def test_pool_max_all_negative_with_padding():
    """Padding never wins a max, even when every value is negative."""
    x = nm.tensor(-np.arange(1, 6, dtype=np.float32) - 10, "t")
    want = naive_pool(x, {"t": 3}, {"t": 1}, {"t": (1, 1)}, "max")
    assert (want < -10).all()
    check(lambda a: nm.pool(a, {"t": 3}, stride=1, padding={"t": (1, 1)}), [x], want, ("t",))


def test_pool_ints():
    x = rand("b t", 2, 6, dtype=np.int32)
    want = naive_pool(x, {"t": 2}, {"t": 2}, {"t": (1, 1)}, "max")
    check(
        lambda a: nm.pool(a, {"t": 2}, padding={"t": (1, 1)}),
        [x],
        want,
        ("b", "t"),
        dtype=np.int32,
    )
    want = naive_pool(x, {"t": 3}, {"t": 3}, {}, "mean")
    check(lambda a: nm.pool(a, {"t": 3}, kind="mean"), [x], want, ("b", "t"), dtype=np.float32)


# --- errors ------------------------------------------------------------------------------------
X = nm.tensor(np.zeros((2, 5, 3), np.float32), "b h c")
K = nm.tensor(np.zeros((3, 3, 4), np.float32), "kh c o")


@pytest.mark.parametrize(
    "fn, match",
    [
        (
            lambda: nm.conv(X, K, {"h": "kw"}),
            r"conv window: dim\(s\) \['kw'\].*\('kh', 'c', 'o'\)",
        ),
        (lambda: nm.conv(X, K, {"w": "kh"}), r"conv spatial: dim\(s\) \['w'\].*\('b', 'h', 'c'\)"),
        (lambda: nm.conv(X, K, {}), "at least one"),
        (
            lambda: nm.conv(X, nm.tensor(np.zeros((6, 3)), "kh c"), {"h": "kh"}),
            r"span 6.*'h' of size 5",
        ),
        (
            lambda: nm.conv(X, K, {"h": "kh"}, dilation=3),
            r"span 7.*'h' of size 5",
        ),
        (
            lambda: nm.conv(
                X, nm.tensor(np.zeros((7, 3)), "kh c"), {"h": "kh"}, padding={"h": (1, 0)}
            ),
            r"span 7.*'h' of size 5 padded by \(1, 0\)",
        ),
        (
            lambda: nm.conv(X, nm.tensor(np.zeros((3, 2, 4)), "kh c o"), {"h": "kh"}),
            r"'c' has size 3 in x.*2 in the kernel",
        ),
        (lambda: nm.conv(X, K, {"h": "kh"}, padding="same"), "'same'"),
        (lambda: nm.conv(X, K, {"h": "kh"}, stride={"w": 2}), r"\['w'\].*spatial"),
        (lambda: nm.conv(X, K, {"h": "kh"}, padding={"w": (1, 1)}), r"\['w'\].*spatial"),
        (
            lambda: nm.conv(X, nm.tensor(np.zeros((3, 5)), "kh h"), {"h": "kh"}),
            r"'kh'.*'h'.*one operand",
        ),
        (
            lambda: nm.conv(nm.tensor(np.zeros((5, 3)), "h kh"), K, {"h": "kh"}),
            r"'kh'.*'h'.*one operand",
        ),
        (lambda: nm.pool(X, {"w": 2}), r"\['w'\].*\('b', 'h', 'c'\)"),
        (lambda: nm.pool(X, {}), "window names no dim"),
        (lambda: nm.pool(X, {"h": 2}, kind="sum"), "'sum'"),
        (lambda: nm.pool(X, {"h": 6}), r"span 6.*'h' of size 5"),
        (lambda: nm.pool(X, {"h": 2}, stride={"c": 1}), r"\['c'\].*spatial"),
        (lambda: nm.pool(X, {"h": 2}, padding="FULL"), "'FULL'"),
    ],
)
def test_errors(fn, match):
    with pytest.raises(ShapeError, match=match):
        fn()


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda: nm.conv(X, K, {"h": "kh"}, stride=0), r"stride.*'h'.*0"),
        (lambda: nm.conv(X, K, {"h": "kh"}, stride={"h": -1}), r"stride.*'h'.*-1"),
        (lambda: nm.conv(X, K, {"h": "kh"}, dilation=0), r"dilation.*'h'.*0"),
        (
            lambda: nm.conv(X, nm.tensor(np.zeros((0, 3)), "kh c"), {"h": "kh"}),
            r"window.*'kh'.*0",
        ),
        (lambda: nm.conv(X, K, {"h": "kh"}, padding={"h": (-1, 0)}), r"negative.*'h'"),
        (lambda: nm.conv(X, K, {"h": "kh"}, padding={"h": 1}), r"'h'.*\(lo, hi\)"),
        (lambda: nm.pool(X, {"h": 0}), r"window.*'h'.*0"),
        (lambda: nm.pool(X, {"h": 2}, stride=0), r"stride.*'h'.*0"),
        (lambda: nm.pool(X, {"h": 2}, padding={"h": (0, -1)}), r"negative.*'h'"),
    ],
)
def test_errors_for_non_positive_parameters(fn, match):
    with pytest.raises(ShapeError, match=match):
        fn()


def test_errors_at_trace_time_and_under_jit():
    k6 = nm.tensor(np.zeros((6, 3), np.float32), "kh c")
    with pytest.raises(ShapeError, match=r"span 6.*'h' of size 5"):
        nm.trace(lambda a, b: nm.conv(a, b, {"h": "kh"}), X, k6)
    with pytest.raises(ShapeError, match=r"span 6.*'h' of size 5"):
        jax.jit(lambda a, b: nm.conv(a, b, {"h": "kh"}))(to_jax(X), to_jax(k6))
    with pytest.raises(ShapeError, match="'sum'"):
        nm.trace(lambda a: nm.pool(a, {"h": 2}, kind="sum"), X)
