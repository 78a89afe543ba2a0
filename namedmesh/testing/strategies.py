"""Hypothesis strategies: named dims, meshes, layouts, constraints and random programs.

`programs()` draws a `Program`: random input tensors over a few shared dims and a
list of steps, each applying one registered primitive (read from the registry: a
primitive's `example`, declared beside its definition, says how; elementwise ops need
none) to tensors made by earlier steps.
A Program is data, so hypothesis shrinks it to a short one, and prints as code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

import namedmesh as nm
from lowering import Layout, Mesh
from namedmesh.testing.edge_steps import EDGE_DTYPES, EDGE_KINDS, EDGE_SIZES, EDGE_STEPS, edge_input
from namedmesh.testing.registry_steps import (
    arity,
    bound_by,
    drawn_kinds,
    not_bound_by,
    not_drawn,
    public_op,
    step_of,
)

NAMES = ("p", "q", "r", "s")
SIZES = (2, 4, 8, 1, 3, 6)  # mostly divisible; 3 and 6 are not, by most mesh axes
# Einsum chains and elementwise combinations: where the collectives are; programs() draws
# one of these in about one step of four (the registry's ~90 kinds would dilute them)
EINSUM_KINDS = ("einsum", "add", "multiply", "subtract", "maximum")
MESH_AXES = ("m0", "m1", "m2")


def dims(names=NAMES, sizes=SIZES) -> st.SearchStrategy[dict[str, int]]:
    """Sizes by dim name; some sizes are not divisible by typical mesh axes."""
    return st.fixed_dictionaries({n: st.sampled_from(sizes) for n in names})


def meshes(max_devices: int | None = None, max_axes: int = 3):
    """Meshes of 1 to `max_devices` devices (default: all) over 1 to `max_axes` axes of
    sizes 1, 2, 4 or 8."""
    import jax

    limit = max_devices or len(jax.devices())

    @st.composite
    def draw(draw_):
        n = draw_(st.integers(1, max_axes))
        sizes = {}
        for name in MESH_AXES[:n]:
            room = limit // int(np.prod(list(sizes.values()) or [1]))
            sizes[name] = draw_(st.sampled_from([s for s in (2, 4, 1, 8) if s <= room]))
        return Mesh(sizes)

    return draw()


_mostly = st.integers(0, 3).map(bool)  # True 3 times in 4; shrinks to False
_rarely = st.integers(0, 3).map(lambda n: n == 3)  # True 1 time in 4; shrinks to False


def layouts(dim_names, mesh, allow_strict: bool = True, sizes=None, shared: bool = False):
    """Ordered rules over `dim_names`: a dim over one or two axes, a rule reusing the
    previous rule's axes (a conflict: the earlier dim of a tensor takes them), and
    `strict` on or off; `shared` marks it as naming dims a program may lack. With
    `sizes` (dim -> size), axes that divide a dim's size are
    preferred, so that fewer layouts are invalid for the inputs."""
    axes = list(mesh.sizes)

    def fits(d, chosen):
        n = 1
        for a in chosen:
            n *= mesh.sizes[a]
        return sizes is None or sizes[d] % n == 0

    @st.composite
    def draw(draw_):
        order = draw_(st.permutations(list(dim_names)))
        rules = []
        for d in order:
            if not draw_(_mostly):  # shrinks to no rule for the dim
                continue
            if rules and not draw_(st.integers(0, 2).map(bool)):  # 1 in 3: reuse
                chosen = rules[-1][1]
            else:
                options = st.lists(st.sampled_from(axes), min_size=1, max_size=2, unique=True)
                chosen = tuple(draw_(options))
                if not fits(d, chosen) and draw_(_mostly):
                    chosen = tuple(a for a in chosen if fits(d, (a,)))[:1] or chosen
            rules.append((d, tuple(chosen)))
        return Layout(rules, strict=allow_strict and draw_(st.booleans()), shared=shared)

    return draw()


@dataclass(frozen=True)
class Program:
    """A random program: `program(*program.example_inputs())` runs it eagerly."""

    sizes: tuple[tuple[str, int], ...]
    inputs: tuple[tuple[str, ...], ...]
    steps: tuple[tuple[str, int, int, int], ...]
    seed: int
    constraints: tuple[tuple[int, str], ...] = field(default=())
    dtypes: tuple[str, ...] = field(default=())  # each input's, where not float32

    def example_inputs(self) -> list[nm.Tensor]:
        r = np.random.default_rng(self.seed)
        sizes = dict(self.sizes)
        xs = [r.normal(size=[sizes[d] for d in dims]).astype(np.float32) for dims in self.inputs]
        dtypes = self.dtypes or ("float32",) * len(xs)
        pairs = zip(xs, dtypes, self.inputs, strict=True)
        return [nm.tensor(edge_input(x, t), dims) for x, t, dims in pairs]

    def __call__(self, *xs: nm.Tensor) -> nm.Tensor:
        return self.values(*xs)[-1]

    def values(self, *xs: nm.Tensor) -> list[nm.Tensor]:
        """Every value the program makes, inputs first."""
        pool = list(xs)
        pinned = dict(self.constraints)
        for n, step in enumerate(self.steps):
            out = _apply(pool, *step)
            if n in pinned:
                out = nm.constrain(out, pinned[n])
            pool.append(out)
        return pool

    def with_constraints(self, constraints) -> Program:
        return Program(self.sizes, self.inputs, self.steps, self.seed, tuple(constraints),
                       self.dtypes)  # fmt: skip

    def __repr__(self) -> str:
        dtypes = f", dtypes={self.dtypes!r}" if self.dtypes else ""
        return (
            f"Program(sizes={self.sizes!r}, inputs={self.inputs!r}, steps={self.steps!r}, "
            f"seed={self.seed}, constraints={self.constraints!r}{dtypes})"
        )


def _compatible(a: nm.Tensor, b: nm.Tensor) -> bool:
    return all(a.sizes[d] == b.sizes[d] for d in set(a.dims) & set(b.dims))


def _apply(pool, kind, i, j, k):
    """One step: primitive `kind`'s example on pool[i], pool[j] (when sizes agree) and a
    dim of pool[i] chosen by k (see `Primitive.example`), its result made float32."""
    a, b = pool[i % len(pool)], pool[j % len(pool)]
    if not _compatible(a, b):
        b = a
    example = EDGE_STEPS.get(kind) or step_of(kind)
    d = a.dims[k % len(a.dims)] if a.dims else None
    out = example(a, b, d, k) if example and (a.dims or kind == "scalar") else None
    if out is None:  # a 0-d tensor, or a dim the op has no example for
        return nm.logical_not(a) if a.dtype == np.dtype(bool) else -a
    return out if out.dtype == np.float32 else nm.astype(out, np.float32)


@st.composite
def programs(
    draw, names=NAMES, sizes=SIZES, max_inputs: int = 3, max_steps: int = 6, kinds=None,
    edge: bool = False,
) -> Program:  # fmt: skip
    """A random Program over the dims `names` (see the module docstring); its steps'
    kinds are `kinds` (primitive names), by default every one of `drawn_kinds()`, with
    EINSUM_KINDS about one step in four. An `edge` program's dims may be empty or of
    size 1 (EDGE_SIZES, unless `sizes` is given), its inputs 0-d and of other dtypes
    than float32 (one in four), and its steps scalars and constants (edge_steps.py)."""
    sz = draw(dims(names, EDGE_SIZES if edge and sizes is SIZES else sizes))
    n_inputs = draw(st.integers(1, max_inputs))
    inputs = tuple(
        tuple(draw(st.permutations(list(names)))[: draw(st.integers(0 if edge else 1, 3))])
        for _ in range(n_inputs)
    )
    dtypes = ()
    if edge:
        other = st.sampled_from(EDGE_DTYPES[1:])
        dtypes = tuple(draw(other) if draw(_rarely) else "float32" for _ in inputs)
        # the registry's kinds, with scalars and constants one step in eight and einsum
        # chains one in five: constants meet the collectives
        kinds = kinds or (*drawn_kinds(), *EDGE_KINDS * 8, *EINSUM_KINDS * 5)
    choices = st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(0, 50))
    if kinds is not None:
        steps = draw(st.lists(st.tuples(st.sampled_from(kinds), choices), min_size=1,
                              max_size=max_steps))  # fmt: skip
    else:  # the registry's kinds in a drawn order: hypothesis draws a permutation's head
        # about evenly (66 of 87 in 200 programs, 83 in 400), sampled_from's repeats a favoured few
        # (56, 77); 1 step in 4 (0, where it shrinks to) an einsum chain's
        order = draw(st.permutations(drawn_kinds()))
        picks = draw(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(EINSUM_KINDS),
                                        choices), min_size=1, max_size=max_steps))  # fmt: skip
        steps = [(order[n] if pick else chain, c) for n, (pick, chain, c) in enumerate(picks)]
    steps = tuple((kind, *c) for kind, c in steps)
    seed = draw(st.integers(0, 2**31 - 1))
    return Program(tuple(sz.items()), inputs, steps, seed, dtypes=dtypes)


def constraints(program: Program, mesh):
    """Constraints pinning a few of the program's values to strict-valid layouts."""

    @st.composite
    def draw(draw_):
        try:
            values = program.values(*program.example_inputs())[len(program.inputs) :]
        except nm.NamedMeshError:  # an edge program an op refuses: nothing to pin
            return ()
        out = []
        for n in sorted(draw_(st.sets(st.integers(0, len(values) - 1), max_size=2))):
            v = values[n]
            axes = draw_(st.permutations(list(mesh.sizes)))
            pairs = [
                (d, a)
                for d, a in zip(v.dims, axes, strict=False)
                if draw_(st.booleans()) and v.sizes[d] % mesh.sizes[a] == 0
            ]
            out.append((n, ";".join(f"{d}:{a}" for d, a in pairs)))
        return tuple(out)

    return draw()


@st.composite
def cases(draw, max_steps: int = 6, kinds=None, edge: bool = False):
    """(program, mesh, layout): a random program (an `edge` one: see `programs`),
    sometimes with constraints on its values, a mesh, and a layout over the program's
    dims."""
    program = draw(programs(max_steps=max_steps, kinds=kinds, edge=edge))
    mesh = draw(meshes())
    if draw(st.booleans()):
        program = program.with_constraints(draw(constraints(program, mesh)))
    # over every name the program may use: a step may leave one out (a shared layout)
    names = [n for n, _ in program.sizes]
    layout = draw(layouts(names, mesh, sizes=dict(program.sizes), shared=True))
    return program, mesh, layout


@st.composite
def einsums(draw, sizes=(2, 4, 8), max_inputs: int = 2) -> Program:
    """A Program of one einsum of its inputs (the last with the first), all dims of one
    size, seed 0: few choices, so that a counterexample shrinks in few steps (each of
    which lowers and runs a case)."""
    n = draw(st.sampled_from(sizes))
    inputs = tuple(
        tuple(draw(st.permutations(list(NAMES)))[: draw(st.integers(1, 3))])
        for _ in range(draw(st.integers(1, max_inputs)))
    )
    k = draw(st.integers(0, 15))  # which of the union's dims the result keeps
    return Program(tuple((d, n) for d in NAMES), inputs, (("einsum", 0, -1, k),), 0)


def _summed_and_kept(program: Program) -> tuple[list[str], tuple[str, ...]]:
    """(the dims of `program`'s inputs its result lacks, sorted; the result's dims): of
    a one-step program, the dims its step sums and keeps."""
    out = program.values(*program.example_inputs())[-1].dims
    return sorted({d for dims in program.inputs for d in dims} - set(out)), out


@st.composite
def shared_axis_cases(draw):
    """(program, mesh, layout): a single einsum under a layout that puts two of its dims
    on one mesh axis, mostly a summed dim then a kept one: the cases where the
    contraction is reduce-scattered onto the kept dim. `cases()` draws one about once
    in 1,500 (measured)."""
    mesh = draw(meshes(max_axes=2))
    axis = draw(st.sampled_from(list(mesh.sizes)))
    program = draw(einsums(sizes=[n for n in (2, 4, 8) if n % mesh.sizes[axis] == 0]))
    summed, out = _summed_and_kept(program)
    if summed and out:  # a summed dim first, a kept one second: a reduce-scatter
        first, second = draw(st.sampled_from(summed)), draw(st.sampled_from(out))
    else:
        first, second = draw(st.permutations([n for n, _ in program.sizes]))[:2]
    return program, mesh, Layout([(first, (axis,)), (second, (axis,))], shared=True)


@st.composite
def multi_axis_cases(draw):
    """(program, mesh, layout): a single einsum of one input, its dims of size 8, on a
    mesh of two axes of size > 1, with one dim (a summed one where there is one) over
    both axes in either order: the cases where a contraction's psum runs over several
    axes at once."""
    program = draw(einsums(sizes=(8,), max_inputs=1))
    two = lambda m: len(m.sizes) == 2 and min(m.sizes.values()) > 1
    mesh = draw(meshes(max_axes=2).filter(two))
    summed, _ = _summed_and_kept(program)
    dim = draw(st.sampled_from(summed or list(program.inputs[0])))
    axes = tuple(draw(st.permutations(list(mesh.sizes))))
    return program, mesh, Layout([(dim, axes)], shared=True)


def all_values(program: Program):
    """The program returning every value it makes (so none of its work is dead code)."""
    return lambda *xs: program.values(*xs)[len(program.inputs) :]


# Values and dtypes: the ops whose answer depends on ties, signed zeros, NaN, infinities
# and the ends of a dtype's range (max/min, argmax/argmin, top_k, softmax, logsumexp, a
# boolean or integer einsum, max pool), along a dim split over one or two mesh axes.
DTYPES = ("bool", "int8", "uint8", "int32", "float16", "bfloat16", "float32")
FLOATS = ("float16", "bfloat16", "float32")
VALUE_OPS = {  # op -> dtypes it takes
    "max": DTYPES,
    "min": DTYPES,
    "argmax": DTYPES,
    "argmin": DTYPES,
    "top_k": DTYPES,
    "softmax": FLOATS,
    "log_softmax": FLOATS,
    "logsumexp": FLOATS,
    "einsum": ("bool", "int8", "uint8", "int32"),  # exact: float sums depend on the order
    "pool": DTYPES,
}
GRADIENT_OPS = ("max", "min", "top_k", "softmax", "log_softmax", "logsumexp", "pool")
VALUE_MESHES = ({"m0": 4}, {"m0": 2, "m1": 2}, {"m0": 2, "m1": 4})


def np_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a name in DTYPES (bfloat16 is ml_dtypes', as jax's)."""
    import jax.numpy as jnp

    return np.dtype(jnp.bfloat16) if name == "bfloat16" else np.dtype(name)


def special_values(dtype: str) -> list:
    """The values on which an op's semantics can go wrong for `dtype`: the ends of its
    range and next to them, 0, 1, -1, and for floats -0.0, NaN, +-inf, the smallest
    normal, and integers past float32's exact range as floats can hold them."""
    if dtype == "bool":
        return [False, True]
    dt = np_dtype(dtype)
    if dtype in FLOATS:
        import jax.numpy as jnp

        info = jnp.finfo(dt)
        big = [float(info.max), float(info.min), float(info.max) / 2, float(info.tiny)]
        return [0.0, -0.0, 1.0, -1.0, 0.5, -3.5, np.nan, np.inf, -np.inf, *big]
    info = np.iinfo(dt)
    vals = [0, 1, 2, info.max, info.min, info.max - 1, info.min + 1, -1, 2**24 + 1, 2**30]
    return [v for v in vals if info.min <= v <= info.max]


def value_arrays(shape: tuple[int, int], dtype: str):
    """[rows, n] arrays of `dtype`: each row drawn from a few `special_values` (so ties of
    the extreme, NaN, infinities and the dtype's ends are common, and shrink to zeros)."""
    pool = special_values(dtype)
    rows, n = shape

    @st.composite
    def draw(draw_):
        out = []
        for _ in range(rows):
            few = draw_(st.lists(st.sampled_from(pool), min_size=1, max_size=4))
            out.append(draw_(st.lists(st.sampled_from(few), min_size=n, max_size=n)))
        return np.array(out, dtype=np_dtype(dtype))

    return draw()


@dataclass(frozen=True, eq=False)
class ValueCase:
    """One op on one array (two for einsum) whose dim `d` is split by `layout` on `mesh`."""

    op: str
    dtype: str
    k: int
    x: np.ndarray
    y: np.ndarray
    mesh: dict
    layout: str

    def inputs(self) -> list[nm.Tensor]:
        xs = [nm.tensor(self.x, "r d")]
        return xs + [nm.tensor(self.y, "d s")] if self.op == "einsum" else xs

    def __repr__(self) -> str:
        y = f", y={self.y.tolist()!r}" if self.op == "einsum" else ""
        return (
            f"ValueCase({self.op}, {self.dtype}, k={self.k}, x={self.x.tolist()!r}{y}, "
            f"mesh={self.mesh}, layout={self.layout!r})"
        )


@functools.cache
def value_op(op: str, k: int = 1):
    """The function a ValueCase of `op` lowers: one op along `d` (one object per op and
    k, so that lowered programs are cached across cases)."""
    if op == "top_k":
        return lambda x: list(nm.top_k(x, "d", k, new_dim="k"))
    if op == "einsum":
        return lambda x, y: nm.einsum(x, y, out="r s")
    if op == "pool":  # SAME padding: the halo's fill reaches the ends of the split dim
        return lambda x: nm.pool(x, {"d": 3}, stride=1, padding="SAME")
    if op not in VALUE_OPS:
        raise ValueError(f"no value op {op!r}")
    return lambda x: getattr(nm, op)(x, "d")


@st.composite
def value_cases(draw, ops=tuple(VALUE_OPS), dtypes=DTYPES) -> ValueCase:
    """A ValueCase: an op of `ops`, a dtype it takes, special values, `d` split over one
    or two mesh axes in either order (sometimes `r` over another) on a mesh whose axes
    all have size > 1."""
    op = draw(st.sampled_from(ops))
    dtype = draw(st.sampled_from([d for d in dtypes if d in VALUE_OPS[op]]))
    mesh = draw(st.sampled_from(VALUE_MESHES))
    axes = draw(st.permutations(list(mesh)))
    n_d = draw(st.integers(1, len(axes)))
    d_axes, rest = axes[:n_d], axes[n_d:]
    split = int(np.prod([mesh[a] for a in d_axes]))
    n = 2 * split  # fixed shapes per layout: a case that shrinks its values is not compiled again
    rules = ["d:" + ",".join(d_axes)]
    if rest and draw(st.booleans()):
        rules.append(f"r:{rest[0]}")
    x = draw(value_arrays((4, n), dtype))
    y = draw(value_arrays((n, 2), dtype)) if op == "einsum" else x[:0]
    k = draw(st.integers(1, min(3, n // split))) if op == "top_k" else 1
    return ValueCase(op, dtype, k, x, y, mesh, ";".join(rules))


__all__ = [
    "NAMES",
    "SIZES",
    "EINSUM_KINDS",
    "drawn_kinds",
    "not_drawn",
    "step_of",
    "public_op",
    "arity",
    "bound_by",
    "not_bound_by",
    "dims",
    "meshes",
    "layouts",
    "constraints",
    "programs",
    "Program",
    "all_values",
    "DTYPES",
    "VALUE_OPS",
    "GRADIENT_OPS",
    "special_values",
    "value_arrays",
    "value_cases",
    "value_op",
    "ValueCase",
]

# Layout orders, index dtypes and 64-bit inputs (issue 13): namedmesh/testing/axis_strategies.py
from namedmesh.testing.axis_strategies import *  # noqa: E402, F403
from namedmesh.testing.axis_strategies import __all__ as _axis_all  # noqa: E402

__all__ += _axis_all
