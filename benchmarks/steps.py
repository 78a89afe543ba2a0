"""One training step (the gradients of a loss with respect to its parameters) of a
namedmesh program, built three ways for the benchmarks:

- `namedmesh_step`: `jax.grad` of `lower(loss, mesh, layout)`;
- `gspmd_step`: the same traced program run with each primitive's jax.numpy
  implementation under `jax.jit`, every input given its NamedSharding and every value
  a `with_sharding_constraint` to the layout namedmesh gives it, so that XLA's
  partitioner chooses only the collectives between the same layouts;
- a hand-written `jax.shard_map` (benchmarks/cases.py), where one exists.

Each returns (jitted gradient function, its placed arguments); the function takes
(params, x) and returns the gradients of params.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

import namedmesh as nm
from lowering import Layout, Mesh, lower
from lowering.distributed import place
from lowering.layout import partition_spec
from namedmesh.trace import evaluate


def namedmesh_step(loss, params: dict, x: nm.Tensor, mesh: dict, rules: str):
    f = lower(loss, Mesh(mesh), rules)
    grad = jax.jit(jax.grad(lambda p, x: f(p, x).data))
    return grad, place((params, x), Mesh(mesh), Layout(rules))


def gspmd_step(loss, params: dict, x: nm.Tensor, mesh: dict, rules: str):
    mesh_ = Mesh(mesh)
    # The layout namedmesh gives every value, read from its plan: where rules conflict,
    # the einsum and elementwise rules choose layouts that no up-front pass knows.
    graph, layouts = lower(loss, mesh_, rules).layouts(params, x)
    sharding = lambda lay: NamedSharding(mesh_.jax_mesh, partition_spec(lay))
    inputs = [layouts[v] for v in graph.inputs]

    def flat_loss(*arrays):
        constrain = lambda v, r: jax.lax.with_sharding_constraint(r, sharding(layouts[v]))
        return evaluate(graph, list(arrays), "jax", each=constrain)[0]

    leaves = jax.tree_util.tree_leaves((params, x), is_leaf=_is_tensor)
    n_params = len(leaves) - 1  # x is the last leaf
    shardings = [sharding(lay) for lay in inputs]

    def grad_fn(*arrays):
        g = jax.grad(flat_loss, argnums=tuple(range(n_params)))(*arrays)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), list(g))

    fn = jax.jit(grad_fn, in_shardings=shardings)
    args = [jax.device_put(np.asarray(t.data), s) for t, s in zip(leaves, shardings, strict=True)]
    return fn, args


def _is_tensor(x) -> bool:
    return isinstance(x, nm.Tensor)


def gradients(fn, args) -> list[np.ndarray]:
    """The step's gradients as NumPy arrays, in the order of the sorted parameter names."""
    out = fn(*args)
    leaves = jax.tree_util.tree_leaves(out, is_leaf=_is_tensor)
    return [np.asarray(getattr(t, "data", t)) for t in leaves]
