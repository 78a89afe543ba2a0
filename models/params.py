"""A model's parameters before they have values: each a `Param` (its dims and sizes, and
how it starts), and the values they start with (`init`, from a seed and each one's path)
or abstract Tensors to trace and plan with (`abstract`). Apart from models/layers/common.py and
models/transformer.py so that LoRA's fresh adapters (models/layers/lora.py) are drawn as a
fresh run's parameters are without importing the model that imports LoRA (issue 42).
`models.layers.common.Param`, `models.transformer.init` and `.abstract` re-export them."""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

import namedmesh as nm


class Param(NamedTuple):
    """A parameter's dims and sizes, and how it starts: "ones", "zeros", or a normal
    with this standard deviation."""

    sizes: dict
    init: str | float


def init(shapes, seed: int) -> dict:
    """Initial values for `shapes` (a nested dict of Params), as jax arrays: each
    parameter's values depend only on the seed and its path, never on a layout."""
    key = nm.tensor(jax.numpy.asarray(nm.random.key(seed).data), ("key",))

    def value(path, p):
        if p.init in ("ones", "zeros"):
            return nm.full(p.sizes, 1.0 if p.init == "ones" else 0.0, np.float32)
        sub = nm.random.fold_in(key, _path_hash(path))
        return nm.random.normal(sub, p.sizes) * np.float32(p.init)

    return _build(shapes, value)


def abstract(shapes) -> dict:
    """`shapes` as abstract Tensors: enough to trace, plan and report, no memory used."""
    return _build(shapes, lambda path, p: nm.abstract(p.sizes))


def _build(shapes, value, prefix=""):
    if isinstance(shapes, Param):
        t = value(prefix, shapes)
        if not isinstance(t.data, jax.Array | jax.ShapeDtypeStruct):
            t = nm.tensor(jax.numpy.asarray(t.data), t.dims)
        return t
    return {k: _build(v, value, f"{prefix}/{k}" if prefix else k) for k, v in shapes.items()}


def _path_hash(path: str) -> int:
    h = 0
    for c in path.encode():
        h = (h * 131 + c) % (2**31 - 1)
    return h
