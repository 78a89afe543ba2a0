"""namedmesh/contract.py: a two-operand einsum as one dot_general in XLA:CPU's fastest
operand order, with gradients written the same way; values and gradients against NumPy,
on one device and lowered with a split summed dim (a psum) and a replicated operand
(whose gradient is summed over the devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh
from lowering.hlo import dots, movement, moves
from namedmesh.contract import contract, left_first
from namedmesh.testing import lowered

SIZES = {"t": 8, "i": 4, "o": 5, "b": 2, "h": 2, "q": 4, "k": 6, "d": 3, "x": 2, "j": 3}
CASES = [  # (a dims, b dims, out): batch dims, summed rows, results in any order
    ("b t i", "b t o", "i o"),  # a weight's gradient, summed over two dims (merged)
    ("t b i", "b t o", "o i"),  # two summed dims in another order in each: not merged
    ("t i", "i o", "t o"),
    ("b h q k", "b h q d", "b h k d"),  # the larger operand summed over its rows
    ("b q h d", "b k h d", "b h q k"),  # batch dims not leading, the result reordered
    ("x i j", "j k", "k x i"),
]


def _sp(dims: str) -> str:
    return dims.replace(" ", "")


def _data(dims: str, seed: int) -> np.ndarray:
    shape = [SIZES[d] for d in dims.split()]
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def test_cases_put_either_operand_on_the_left():
    sizes = tuple(sorted(SIZES.items()))
    orders = {left_first(*(tuple(s.split()) for s in case), sizes) for case in CASES}
    assert orders == {True, False}


def _value_and_vjp(f, w):
    """(f(a, b), the gradients of sum(f(a, b) * w)) as one function: one compiled program."""

    def both(a, b):
        y, pull = jax.vjp(f, a, b)
        return (y, *pull(w))

    return both


@pytest.mark.parametrize(("a_dims", "b_dims", "out"), CASES)
def test_values_and_gradients_equal_numpy(a_dims, b_dims, out):
    a, b, w = _data(a_dims, 0), _data(b_dims, 1), _data(out, 2)
    dims = tuple(a_dims.split()), tuple(b_dims.split()), tuple(out.split())
    y, ga, gb = jax.jit(_value_and_vjp(lambda a, b: contract(a, b, *dims), w))(a, b)
    spec = f"{_sp(a_dims)},{_sp(b_dims)}->{_sp(out)}"
    a64, b64, w64 = (v.astype(np.float64) for v in (a, b, w))
    np.testing.assert_allclose(np.asarray(y), np.einsum(spec, a64, b64), rtol=1e-5, atol=1e-5)
    want_a = np.einsum(f"{_sp(out)},{_sp(b_dims)}->{_sp(a_dims)}", w64, b64)
    want_b = np.einsum(f"{_sp(a_dims)},{_sp(out)}->{_sp(b_dims)}", a64, w64)
    np.testing.assert_allclose(np.asarray(ga), want_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gb), want_b, rtol=1e-5, atol=1e-5)


def test_weight_gradient_reads_its_operands_without_a_transposed_copy():
    """A weight's gradient summed over batch and length, x[b, q, d] and the cotangent
    g[b, q, vocab] -> w[d, vocab]: jax's own gradient copies g transposed to [vocab, t]
    and XLA's dot canonicaliser copied x to [d, t] (two summed dims); nm.einsum's
    gradient reads both in place (each reshaped to [t, .], a bitcast). The oracle is
    the compiled HLO: no transpose or copy of either value's elements."""
    x = nm.tensor(_data("b q d", 3).repeat(11, 2)[:, :, :32], "batch length d")  # d: 32
    w = nm.tensor(np.ones((32, 1024), np.float32), "d vocab")
    loss = lambda x, w: jnp.sum(jnp.sin(nm.einsum(x, w).data))
    hlo = jax.jit(jax.grad(loss, (0, 1))).lower(x, w).compile().as_text()
    assert "f32[1024,2,4]" not in hlo and "f32[1024,8]" not in hlo
    # w's gradient sums over (batch, length): as one merged dim XLA:CPU reads x as it is,
    # [8, 32], where two summed dims made it copy x transposed to [32, 8] first
    assert movement(hlo)["transpose"] == (0, 0)
    activations = {4 * 2 * 4 * 32, 4 * 2 * 4 * 1024}  # x's and g's bytes
    copied = [m for m in moves(hlo) if m.kind in ("transpose", "copy") and m.nbytes in activations]
    assert not copied, copied
    assert any(d.lhs == (8, 32) and d.lhs_contracting == (0,) for d in dots(hlo)), dots(hlo)


def test_summed_dims_apart_in_one_operand_are_brought_together_summed_first():
    """A key's gradient from a rotated query q[b, l, g, d] and the logits' cotangent
    s[b, g, l, k], summed over (g, l): q is transposed to [b, (g, l), d] by its dot plan
    (summed first: its free size d is small), so the dot has one summed dim and reads
    both operands in place, not XLA's copy of q to [b, d, (g, l)] (half the rate)."""
    q, s = _data("b q x d", 11), _data("b x q k", 12)  # (2, 4, 2, 3), (2, 2, 4, 6)
    f = jax.jit(lambda q, s: contract(q, s, ("b", "l", "g", "d"), ("b", "g", "l", "k"),
                                      ("b", "k", "d")))  # fmt: skip
    want = np.einsum("blgd,bglk->bkd", q.astype(np.float64), s.astype(np.float64))
    np.testing.assert_allclose(np.asarray(f(q, s)), want, rtol=1e-5, atol=1e-5)
    (dot,) = dots(f.lower(q, s).compile().as_text())
    assert len(dot.lhs_contracting) == len(dot.rhs_contracting) == 1, dot
    summed_first = {(2, 8, 3): (1,), (2, 8, 6): (1,)}  # [b, g*l, d] and [b, g*l, k]
    assert {dot.lhs: dot.lhs_contracting, dot.rhs: dot.rhs_contracting} == summed_first, dot
    # under grad the forward dot reads the copy it saves for the backward, still summed first
    loss = lambda q, s: jnp.sum(f(q, s) ** 2)
    text = jax.jit(jax.grad(loss, (0, 1))).lower(q, s).compile().as_text()
    assert any(d.lhs == (2, 8, 3) and d.lhs_contracting == (1,) for d in dots(text)), dots(text)


LOWERED = [  # (program's dims, layout): a summed dim split (psum); a replicated operand
    (("b t i", "b t o", "i o"), "t:x;i:y"),  # two summed dims merged, one of them split
    (("b q h d", "b k h d", "b h q k"), "h:x;q:y"),
    (("t i", "i o", "t o"), "t:x,y"),
]


@pytest.mark.parametrize(("case", "layout"), LOWERED)
def test_lowered_values_and_gradients_equal_numpy(case, layout):
    a_dims, b_dims, out = case
    a = nm.tensor(_data(a_dims, 4), a_dims)
    b = nm.tensor(_data(b_dims, 5), b_dims)
    w = _data(out, 6)
    f = lowered(lambda a, b: nm.einsum(a, b, out=out), Mesh({"x": 2, "y": 2}), layout)
    y = f(a, b)
    spec = f"{_sp(a_dims)},{_sp(b_dims)}->{_sp(out)}"
    a64, b64, w64 = (np.asarray(v.data, np.float64) if hasattr(v, "data") else v for v in (a, b, w))
    np.testing.assert_allclose(np.asarray(y.data), np.einsum(spec, a64, b64), rtol=1e-5, atol=1e-5)
    ga, gb = jax.grad(lambda a, b: jnp.sum(f(a, b).data * w), (0, 1))(a, b)
    want_a = np.einsum(f"{_sp(out)},{_sp(b_dims)}->{_sp(a_dims)}", w64, b64)
    want_b = np.einsum(f"{_sp(a_dims)},{_sp(out)}->{_sp(b_dims)}", a64, w64)
    np.testing.assert_allclose(np.asarray(ga.data), want_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gb.data), want_b, rtol=1e-5, atol=1e-5)


def test_operand_invariant_over_a_mesh_axis_gets_its_gradient_summed_over_it():
    """In shard_map, a varying over `x` and b invariant: b's gradient is invariant too,
    the devices' parts summed (custom_vjp refuses a varying one)."""
    devices = np.array(jax.devices()[:2])
    mesh = jax.sharding.Mesh(devices, ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec
    a, b = _data("t i", 7), _data("i o", 8)

    def body(a, b):
        return jax.lax.psum(
            jnp.sum(jnp.sin(contract(a, b, ("t", "i"), ("i", "o"), ("t", "o")))), "x"
        )

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec("x"), spec()), out_specs=spec()))
    ga, gb = jax.grad(f, (0, 1))(a, b)
    cos = np.cos(a.astype(np.float64) @ b)
    np.testing.assert_allclose(np.asarray(ga), cos @ b.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gb), a.T @ cos, rtol=1e-5, atol=1e-5)


def test_tied_embedding_gradient_is_the_dot_in_the_order_chosen():
    """An embedding's gradient [vocab, d] from x[t, d] and the cotangent [t, vocab]: the
    dot gives [d, vocab] (x, the smaller, transposed) and the result is transposed after,
    not folded by XLA into the dot with the [t, vocab] cotangent transposed."""
    x = nm.tensor(np.ones((64, 32), np.float32), "length d")
    e = nm.tensor(np.ones((1024, 32), np.float32), "vocab d")
    loss = lambda e: jnp.sum(jnp.sin(nm.einsum(x, e, out="length vocab").data))
    hlo = jax.jit(jax.grad(loss)).lower(e).compile().as_text()
    dots = [line for line in hlo.splitlines() if " dot(" in line]
    assert any("f32[32,1024]" in line.split("dot(")[0] for line in dots), dots


def test_forward_mode_runs_inside_jax_gradients():
    """contract's custom vjp has no forward mode: jax.jvp of an nm.einsum fails outside
    nm.jax_gradients() and, inside it, jax.hessian equals the NumPy oracle (the Hessian
    of sum((x w)^2) in w is 2 x^T x per output column)."""
    x = _data("t i", 9)
    w0 = _data("i o", 10)
    loss = lambda w: jnp.sum(nm.einsum(nm.tensor(x, "t i"), nm.tensor(w, "i o")).data ** 2)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(loss, (w0,), (w0,))
    with nm.jax_gradients():  # traced inside: one compiled program, not op by op
        h, tangent = jax.jit(lambda w: (jax.hessian(loss)(w), jax.jvp(loss, (w,), (w,))[1]))(w0)
        h = np.asarray(h)
    gram = 2 * x.astype(np.float64).T @ x
    want = np.einsum("ij,ok->iojk", gram, np.eye(w0.shape[1]))
    np.testing.assert_allclose(h, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(float(tangent), 2 * np.sum((x @ w0) * (x @ w0)), rtol=1e-4)
