"""auto_layout's pruned search against brute force: on programs and meshes small enough
to plan every layout, the search's choice is no slower (planned step time at the TPU v2
table's rates) than the best of all layouts within the memory limit.

The oracle enumerates its layouts itself (every way to give each mesh axis to at most
two dims, in any order of precedence) and costs each by `lower.graph_report`, the
model's own cost, on the program traced once; nothing of the search's pruning,
candidates or canonical forms is used. Limits are taken from the brute-force table's
memories, so that they bind: the fastest layouts are over them."""

import functools
import itertools
import math

import pytest

import namedmesh as nm
from lowering import Layout, Mesh, auto_layout
from lowering.lower import argument_inputs, graph_report, input_names
from lowering.rates import hardware
from namedmesh.errors import NamedMeshError

A = nm.abstract
TPU = hardware("tpu_v2")


def mlp(x, w1, w2):
    return nm.einsum(nm.relu(nm.einsum(x, w1)), w2, out="batch d_model")


def mlp_inputs(b, d, h):
    return A({"batch": b, "d_model": d}), A({"d_model": d, "d_ff": h}), A({"d_ff": h, "d_model": d})


def attention(x, wq, wk, wv, wo):
    q = nm.einsum(x, wq)
    k = nm.rename(nm.einsum(x, wk), seq="kseq")
    v = nm.rename(nm.einsum(x, wv), seq="kseq")
    att = nm.softmax(nm.einsum(q, k, out="batch heads seq kseq") * 0.125, "kseq")
    out = nm.einsum(nm.einsum(att, v, out="batch seq heads d_head"), wo, out="batch seq d_model")
    return x + out


def attention_inputs(b, s, d, heads, dh):
    proj = {"d_model": d, "heads": heads, "d_head": dh}
    wo = {"heads": heads, "d_head": dh, "d_model": d}
    return A({"batch": b, "seq": s, "d_model": d}), A(proj), A(proj), A(proj), A(wo)


def layouts(dims: list[str], axes: list[str]):
    """Every Layout giving each of `axes` to at most two of `dims`: per axis an ordered
    choice of holders (the first keeps the axis where a value holds both), joined into
    one rule order where the axes' orders agree."""
    holders = [t for k in range(3) for t in itertools.permutations(dims, k)]
    seen = set()
    for choice in itertools.product(holders, repeat=len(axes)):
        before = {(t[0], t[1]) for t in choice if len(t) == 2}
        order, rest = [], list(dict.fromkeys(d for t in choice for d in t))
        while rest:
            free = [d for d in rest if not any((e, d) in before for e in rest)]
            if not free:
                break  # the axes' orders disagree: no rule order gives this choice
            order.append(free[0])
            rest.remove(free[0])
        rules = tuple(
            (d, tuple(a for a, t in zip(axes, choice, strict=True) if d in t)) for d in order
        )
        if not rest and rules not in seen:
            seen.add(rules)
            yield Layout(list(rules))


@functools.cache
def brute_force(name: str, sizes: tuple, shape: tuple) -> list[tuple[float, int, Layout]]:
    """(planned seconds, peak memory, layout) of every valid layout of the enumeration."""
    fn, inputs, wrt = program(name, shape)
    mesh = Mesh(dict(sizes), devices="abstract")
    graph = nm.trace(fn, *inputs)
    grads, names = argument_inputs(graph, inputs, wrt), input_names(inputs)
    dims = list(dict.fromkeys(d for v in graph.values() for d in v.dims))
    table = []
    for layout in layouts(dims, [a for a, n in sizes if n > 1]):
        try:
            rep = graph_report(graph, mesh, layout, grads, names)
        except NamedMeshError:  # a split the sizes do not allow
            continue
        table.append((TPU.seconds(rep), rep.peak_memory, layout))
    return table


def program(name: str, shape: tuple):
    if name == "mlp":
        return mlp, mlp_inputs(*shape), (1, 2)
    return attention, attention_inputs(*shape), (1, 2, 3, 4)


CASES = [  # each one a case some version of the search missed
    ("mlp", (("x", 2), ("y", 4)), (64, 4096, 4096)),
    ("mlp", (("x", 2), ("y", 2)), (16, 4096, 256)),
    ("mlp", (("x", 8), ("y", 2)), (8192, 4096, 256)),
    ("mlp", (("a", 2), ("b", 2), ("c", 2)), (4096, 1024, 4096)),
    ("mlp", (("a", 2), ("b", 4), ("c", 2)), (8192, 64, 4096)),  # which dim takes b: a swap
    ("mlp", (("a", 2), ("b", 2), ("c", 2)), (16, 1024, 256)),  # d_model gives c up to d_ff
    ("attention", (("x", 2), ("y", 4)), (2, 4096, 256, 4, 32)),  # keys split: kseq
]


@pytest.mark.parametrize("name, sizes, shape", CASES)
@pytest.mark.parametrize("quantile", [None, 0.02, 0.05, 0.1, 0.3])
def test_search_finds_the_brute_force_optimum_within_the_limit(name, sizes, shape, quantile):
    table = brute_force(name, sizes, shape)
    memories = sorted({m for _, m, _ in table})
    limit = math.inf if quantile is None else memories[int(quantile * (len(memories) - 1))]
    best_time, _, best = min((r for r in table if r[1] <= limit), key=lambda r: r[0])
    fn, inputs, wrt = program(name, shape)
    mesh = Mesh(dict(sizes), devices="abstract")
    layout, found = auto_layout(
        fn, mesh, *inputs, grad_argnums=wrt, rates="tpu_v2", memory_limit=limit
    )
    chosen = found[0]
    assert chosen.layout == layout and chosen.memory <= limit
    assert chosen.time <= best_time * (1 + 1e-9), (
        f"chose {layout} at {chosen.time * 1e3:.4g} ms; {best} plans at {best_time * 1e3:.4g} ms"
    )


def _best_within(table, limit):
    return min((r for r in table if r[1] <= limit), key=lambda r: r[0])


@pytest.mark.parametrize("name, sizes, shape", CASES)
@pytest.mark.parametrize("quantile, seeded_at", [(0.05, None), (0.3, 0.02), (None, 0.05)])
def test_a_search_seeded_with_another_limits_optimum_finds_this_ones(
    name, sizes, shape, quantile, seeded_at
):
    """`seeds` (a joint search's lead pair's choice, lowering/joint.py): seeded with the
    brute-force optimum under another limit (a program that needs more or less memory
    chose it), the climb still ends on this limit's optimum; and where the seed is it,
    on fewer candidates than the climb from phase 1 alone."""
    table = brute_force(name, sizes, shape)
    memories = sorted({m for _, m, _ in table})
    at = lambda q: math.inf if q is None else memories[int(q * (len(memories) - 1))]
    limit, seed = at(quantile), _best_within(table, at(seeded_at))[2]
    best_time, _, best = _best_within(table, limit)
    fn, inputs, wrt = program(name, shape)
    mesh = Mesh(dict(sizes), devices="abstract")
    search = functools.partial(auto_layout, fn, mesh, *inputs, grad_argnums=wrt,
                               rates="tpu_v2", memory_limit=limit)  # fmt: skip
    layout, found = search(seeds=[seed])
    assert found[0].memory <= limit
    assert found[0].time <= best_time * (1 + 1e-9), (
        f"seeded with {seed}: chose {layout} at {found[0].time * 1e3:.4g} ms; {best} plans "
        f"at {best_time * 1e3:.4g} ms"
    )
    _, alone = search()
    _, at_best = search(seeds=[alone[0].layout])
    assert at_best[0].time == alone[0].time and len(at_best) <= len(alone)


def test_a_seed_on_an_axis_the_mesh_lacks_is_a_layout_error_one_not_dividing_is_mended():
    from namedmesh.errors import LayoutError

    fn, inputs, wrt = program("mlp", (6, 256, 256))
    mesh = Mesh({"x": 2, "y": 4}, devices="abstract")
    search = functools.partial(auto_layout, fn, mesh, *inputs, grad_argnums=wrt, rates="tpu_v2",
                               memory_limit=math.inf, beam=1)  # fmt: skip
    with pytest.raises(LayoutError, match="seed layout batch:z"):
        search(seeds=["batch:z"])
    rows = lambda table: [(str(c.layout), c.time, c.memory) for c in table]
    # batch 6 over x,y (8 ways) does not divide: the seed climbs as batch:x (6 % 2 == 0)
    _, mended = search(seeds=["batch:x;d_ff:y"])
    _, found = search(seeds=["batch:x,y;d_ff:y"])
    _, alone = search()
    assert rows(found) == rows(mended) != rows(alone)


@pytest.mark.parametrize("name, sizes, shape", CASES)
def test_a_failing_descent_stopped_at_a_plateau_still_finds_the_least_memory(name, sizes, shape):
    """`plateau` (a joint search's pairs): under a limit no layout meets, the descent by
    memory stops at a step gaining under 1%, on fewer candidates than the whole descent
    (plateau 0), its closest layout within 1% of the brute-force least memory (here the
    same); under a limit that binds, the brute-force optimum is still chosen."""
    from lowering.search import PLATEAU
    from namedmesh.errors import LayoutError

    table = brute_force(name, sizes, shape)
    least = min(m for _, m, _ in table)
    fn, inputs, wrt = program(name, shape)
    mesh = Mesh(dict(sizes), devices="abstract")
    search = functools.partial(auto_layout, fn, mesh, *inputs, grad_argnums=wrt,
                               rates="tpu_v2")  # fmt: skip
    tables = []
    for plateau in (0.0, PLATEAU):
        with pytest.raises(LayoutError) as e:
            search(memory_limit=least / 2, plateau=plateau)
        tables.append(e.value.search)
    whole, stopped = tables
    assert len(stopped) < len(whole)
    valid = [c.memory for c in stopped if not c.note.startswith("invalid")]
    assert least <= min(valid) <= least * 1.01
    memories = sorted({m for _, m, _ in table})
    limit = memories[int(0.02 * (len(memories) - 1))]
    _, found = search(memory_limit=limit, plateau=PLATEAU)
    assert found[0].time <= _best_within(table, limit)[0] * (1 + 1e-9)


@pytest.mark.parametrize("plateau", [-0.1, 1.0, float("nan"), "1%", True])
def test_a_plateau_not_a_fraction_is_a_parameter_error(plateau):
    from namedmesh.errors import ParameterError

    fn, inputs, wrt = program("mlp", (16, 256, 256))
    with pytest.raises(ParameterError, match="plateau must be a fraction"):
        auto_layout(fn, Mesh({"x": 2}, devices="abstract"), *inputs, grad_argnums=wrt,
                    rates="tpu_v2", plateau=plateau)  # fmt: skip
