"""Strategies for scans over a split dim: a layer stack whose `layers` a layout splits
over mesh axes, which lowering runs as a pipeline (lowering/pipeline.py), with the
batch cut into microbatches where the layout asks for them.

`stack_cases()` draws `(Stack, mesh, layout)`: a `Stack` is one `nm.scan` over
`layers` of a small body on the carry h[batch, d] and the scanned weights
w[layers, d, e], and the layout's first rule splits `layers` (so the stages are
exactly that rule's axes); the other rules split `batch`, `d` and `e` over any mesh
axes, the stage axes included. Sizes are powers of two no smaller than the axes that
split them, so no rule is indivisible: what can go wrong is the pipeline's own
business (`microbatches` that the per-stage batch or the body cannot take, a circular
schedule, drawn 1 in 4, that the stages or the body cannot run). A Stack is
data without its input values, so a case hypothesis replays compiles once.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

import namedmesh as nm
from lowering import Layout, Mesh

LAYERS = 4
# the body after z = h . w (+ 0.1 g): per example along batch ("residual"); mixing the
# examples ("softmax_batch"); beside a second carry that lacks batch ("side_carry");
# singular at zero, z / |z|, which a pipeline's bubble ticks compute on zeros ("unit");
# with a constant over batch made from no input, as the online softmax's initial
# statistics are ("constant": a loop constant that microbatches must cut)
STACK_BODIES = ("residual", "softmax_batch", "side_carry", "unit", "constant")
STACK_MESHES = ({"m0": 2}, {"m0": 4}, {"m0": 2, "m1": 2}, {"m0": 2, "m1": 4}, {"m0": 4, "m1": 2},
                {"m0": 2, "m1": 2, "m2": 2})  # fmt: skip


@dataclass(frozen=True)
class Stack:
    """`stack(h, w[, g])`: the scan's final carries, then its per-layer ys if `ys`."""

    batch: int
    width: int  # the size of d and of e
    body: str  # one of STACK_BODIES
    captured: tuple[str, ...]  # the dims of a captured input g: () for none
    ys: bool
    remat: str  # the scan's remat policy

    @property
    def mixes_examples(self) -> bool:
        """Whether the body is not per-example along batch (microbatches would change it)."""
        return self.body == "softmax_batch"

    @property
    def batchless_carry(self) -> bool:
        return self.body == "side_carry"

    def example_inputs(self, seed: int = 0) -> list[nm.Tensor]:
        r = np.random.default_rng(seed)
        n, b = self.width, self.batch
        sizes = {"batch": b, "d": n}
        xs = [
            nm.tensor(r.normal(size=(b, n)).astype(np.float32), ("batch", "d")),
            nm.tensor((r.normal(size=(LAYERS, n, n)) / n).astype(np.float32), ("layers", "d", "e")),
        ]
        if self.captured:
            shape = [sizes[d] for d in self.captured]
            xs.append(nm.tensor(r.normal(size=shape).astype(np.float32), self.captured))
        return xs

    def __call__(self, h: nm.Tensor, w: nm.Tensor, g: nm.Tensor | None = None) -> list:
        def layer(carry, w):
            z = nm.einsum(carry[0], w, out=("batch", "e")).rename(e="d")
            if g is not None:
                z = z + 0.1 * g
            if self.body == "softmax_batch":
                new = (nm.tanh(z) * nm.softmax(z, "batch"),)
            elif self.body == "side_carry":
                new = (nm.tanh(z + carry[1]), carry[1] + 0.1 * nm.sum(w, "e"))
            elif self.body == "unit":
                new = (carry[0] + z / nm.sqrt(nm.sum(z * z, "d")),)
            elif self.body == "constant":
                half = nm.full({"batch": self.batch, "d": self.width}, 0.5, np.float32)
                new = (carry[0] + nm.tanh(z) * half,)
            else:
                new = (carry[0] + nm.tanh(z - nm.mean(z, "d")),)
            return new, (z * 0.5 if self.ys else None)

        init = (h, 0.5 * nm.mean(h, "batch")) if self.batchless_carry else (h,)
        final, ys = nm.scan(layer, init, w, "layers", remat=self.remat)
        return [*final, ys] if self.ys else list(final)


def _axis_sets(mesh_sizes: dict[str, int], limit: int) -> list[tuple[str, ...]]:
    """Ordered tuples of distinct mesh axes whose sizes multiply to a divisor of `limit`
    (sizes are powers of two, so every sub-tuple divides it too)."""
    axes = list(mesh_sizes)
    out = []
    for k in (1, 2):
        for combo in itertools.permutations(axes, k):
            if limit % math.prod(mesh_sizes[a] for a in combo) == 0:
                out.append(combo)
    return out


@st.composite
def stack_cases(draw, bodies=STACK_BODIES):
    """(Stack, mesh, layout): see the module docstring, with a body of `bodies`.
    `microbatches` is left to the default, or set to 2, 4, 8 or 1 (which the per-stage
    batch may not divide)."""
    stack = Stack(
        batch=8,
        width=draw(st.sampled_from((2, 4))),
        # per-example twice as often as each other body: the one microbatches can cut
        body=draw(st.sampled_from(bodies[:1] + bodies)),
        captured=draw(st.sampled_from(((), ("batch", "d"), ("d",)))),
        ys=draw(st.booleans()),
        remat=draw(st.sampled_from(("none", "full", "dots"))),
    )
    sizes = draw(st.sampled_from(STACK_MESHES))
    rules = [("layers", draw(st.sampled_from(_axis_sets(sizes, LAYERS))))]
    for dim, n in (("batch", stack.batch), ("d", stack.width), ("e", stack.width)):
        fitting = _axis_sets(sizes, n)
        if fitting and draw(st.booleans()):
            rules.append((dim, draw(st.sampled_from(fitting))))
    m = draw(st.sampled_from((None, 2, 4, 8, 1)))
    options = {} if m is None else {"microbatches": m}
    if draw(st.integers(0, 3)) == 3:  # 1 in 4: the circular schedule, R = S rounds
        options["schedule"] = "circular"
    return stack, Mesh(sizes), Layout(rules, options=options)
