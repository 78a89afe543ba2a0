"""lowering.hlo.movement: the data movement of compiled HLO, counted against a hand-made
module whose every byte is worked out by hand. (docs/lowering.md's example holds it to
nm.scan's loop, whose stacked residuals unrolling removes.)"""

import re

import jax
import numpy as np

import namedmesh as nm
from lowering import Mesh, lower
from lowering.hlo import Dot, dots, movement, moves
from models.architecture import Config
from models.layers import common, kernels

# A loop of 3 iterations over a zero-filled f32[3,8] buffer (96 bytes): each iteration
# reads a row (32 bytes) and writes the negated row (32 bytes) in a fusion; after it a
# transpose of the buffer and a dot, which is arithmetic and not counted.
HAND = """HloModule m

%cond (c: (s32[], f32[3,8], f32[1,8])) -> pred[] {
  %c = (s32[], f32[3,8]{1,0}, f32[1,8]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%ci, %three), direction=LT
}

%fused_update (a: f32[3,8], b: f32[1,8], i: s32[]) -> f32[3,8] {
  %a = f32[3,8]{1,0} parameter(0)
  %b = f32[1,8]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %neg = f32[1,8]{1,0} negate(%b)
  %zero = s32[] constant(0)
  ROOT %dus = f32[3,8]{1,0} dynamic-update-slice(%a, %neg, %i, %zero)
}

%body (p: (s32[], f32[3,8], f32[1,8])) -> (s32[], f32[3,8], f32[1,8]) {
  %p = (s32[], f32[3,8]{1,0}, f32[1,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %buf = f32[3,8]{1,0} get-tuple-element(%p), index=1
  %row = f32[1,8]{1,0} get-tuple-element(%p), index=2
  %z = s32[] constant(0)
  %read = f32[1,8]{1,0} dynamic-slice(%buf, %i, %z), dynamic_slice_sizes={1,8}
  %new = f32[3,8]{1,0} fusion(%buf, %row, %i), kind=kLoop, calls=%fused_update
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[3,8]{1,0}, f32[1,8]{1,0}) tuple(%next, %new, %read)
}

ENTRY %main (x: f32[1,8]) -> f32[8,3] {
  %x = f32[1,8]{1,0} parameter(0)
  %zero = f32[] constant(0)
  %fill = f32[3,8]{1,0} broadcast(%zero), dimensions={}
  %fill2 = f32[3,8]{1,0} copy(%fill)
  %start = s32[] constant(0)
  %init = (s32[], f32[3,8]{1,0}, f32[1,8]{1,0}) tuple(%start, %fill2, %x)
  %loop = (s32[], f32[3,8]{1,0}, f32[1,8]{1,0}) while(%init), condition=%cond, body=%body,
  backend_config={"known_trip_count":{"n":"3"}}
  %out = f32[3,8]{1,0} get-tuple-element(%loop), index=1
  %dot = f32[3,3]{1,0} dot(%out, %out), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  ROOT %tr = f32[8,3]{0,1} transpose(%out), dimensions={1,0}
}
"""  # noqa: E501


def test_movement_counts_a_hand_made_module_by_kind_and_iteration():
    assert movement(HAND) == {
        "fill": (2, 2 * 96),  # the broadcast and its copy
        "stack": (3, 3 * 32),  # the row written, once per iteration
        "unstack": (3, 3 * 32),  # the row read, once per iteration
        "transpose": (1, 96),
        "copy": (0, 0),
    }


# A batched dot in a YNNPACK fusion inside a loop of 4 iterations, its left operand
# stored column-major ({0,1,2}); after the loop a plain dot with no layout written.
DOTS = """HloModule d

%fused_dot (p0: f32[2,8,16], p1: f32[2,16,4]) -> f32[2,8,4] {
  %p0 = f32[2,8,16]{0,1,2} parameter(0)
  %p1 = f32[2,16,4]{2,1,0} parameter(1)
  ROOT %d = f32[2,8,4]{2,1,0} dot(%p0, %p1), lhs_batch_dims={0}, lhs_contracting_dims={2},
  rhs_batch_dims={0}, rhs_contracting_dims={1}
}

%body (p: (f32[2,8,16], f32[2,16,4])) -> (f32[2,8,16], f32[2,16,4]) {
  %p = (f32[2,8,16]{0,1,2}, f32[2,16,4]{2,1,0}) parameter(0)
  %a = f32[2,8,16]{0,1,2} get-tuple-element(%p), index=0
  %b = f32[2,16,4]{2,1,0} get-tuple-element(%p), index=1
  %f = f32[2,8,4]{2,1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot,
  backend_config={"fusion_config":{"kind":"__ynn_fusion"}}
  ROOT %t = (f32[2,8,16]{0,1,2}, f32[2,16,4]{2,1,0}) tuple(%a, %b)
}

ENTRY %main (x: (f32[2,8,16], f32[2,16,4]), m: f32[3,5]) -> f32[5,5] {
  %x = (f32[2,8,16]{0,1,2}, f32[2,16,4]{2,1,0}) parameter(0)
  %loop = (f32[2,8,16]{0,1,2}, f32[2,16,4]{2,1,0}) while(%x), condition=%c, body=%body,
  backend_config={"known_trip_count":{"n":"4"}}
  %m = f32[3,5] parameter(1)
  ROOT %mm = f32[5,5] dot(%m, %m), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}
"""


def test_dots_of_a_hand_made_module_with_layouts_kernels_and_trip_counts():
    assert dots(DOTS) == [
        Dot((2, 8, 16), (2, 16, 4), (0, 1, 2), (2, 1, 0), (2,), (1,), (0,), (0,), "ynn", 4),
        Dot((3, 5), (3, 5), (1, 0), (1, 0), (0,), (0,), (), (), "xla", 1),
    ]


def test_movement_sizes_narrow_dtypes_by_their_bytes():
    """An 8-bit float's name holds digits and letters (f8e4m3fn): a byte an element."""
    text = """HloModule n

ENTRY %main (x: f8e4m3fn[2,3]) -> f8e4m3fn[3,2] {
  %x = f8e4m3fn[2,3]{1,0} parameter(0)
  ROOT %t = f8e4m3fn[3,2]{1,0} transpose(%x), dimensions={1,0}
}
"""
    assert movement(text)["transpose"] == (1, 6)


def test_attention_scores_written_in_their_dot_order_and_probabilities_saved_once():
    """The zoo's default attention (models.layers.kernels.full, causal, grouped heads) in a
    compiled training loop over layers: the logits go from their dot to the mask and
    softmax and back without a transposed copy, and the backward pass keeps one value
    of their size per layer (the probabilities), not also exp(logits - max). Sizes all
    differ (batch 5, kv_heads 2, q_per_kv 3, length 16), so the logits' shape names
    them; the oracle is the compiled HLO."""
    sizes = {
        "layers": 2,
        "batch": 5,
        "length": 16,
        "memory": 16,
        "kv_heads": 2,
        "q_per_kv": 3,
        "d_kv": 4,
    }
    r = np.random.default_rng(0)
    q = nm.tensor(r.normal(size=[sizes[d] for d in QDIMS]).astype(np.float32), QDIMS)
    kv = nm.tensor(r.normal(size=[sizes[d] for d in KDIMS]).astype(np.float32), KDIMS)
    causal = lambda queries, slots: nm.where(slots <= queries, 0.0, -1e9)
    opts = kernels.Options(bias_fn=causal, scale=0.5, causal=True)

    def loss(q, k, v):
        def layer(h, x):
            return kernels.full(h, x["k"], x["v"], opts), None

        out, _ = nm.scan(layer, q, {"k": k, "v": v}, "layers")
        return (out * out).sum().data

    args = (q, kv, kv * 0.5)
    found = moves(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text())
    logits = sorted((5, 2, 3, 16, 16))
    assert not [m for m in found if m.kind in ("transpose", "copy") and _dims(m.shape) == logits]
    saved = [m for m in found if m.kind == "stack" and _dims(m.shape) == logits]
    assert sum(m.times for m in saved) == sizes["layers"]


QDIMS = ("batch", "length", "kv_heads", "q_per_kv", "d_kv")
KDIMS = ("layers", "batch", "memory", "kv_heads", "d_kv")


def _dims(shape: str) -> list[int]:
    """The sizes of an HLO shape's dims other than 1, sorted."""
    sizes = re.match(r"\w+\[([\d,]*)\]", shape).group(1).split(",")
    return sorted(int(d) for d in sizes if d not in ("", "1"))


def test_rotated_q_and_k_reach_the_fused_kernel_in_one_move_each():
    """q and k rotated (models.layers.common.rotate) into nm.dot_product_attention's
    flash kernel (q batch, length, kv_heads, q_per_kv, d_kv as the zoo's projections
    write it), in a compiled gradient, the oracle its HLO: q, k and v go to the kernel's
    heads-first layout in one move each, never through a length-first order (before:
    transposed length-first, then copied heads-first again: no value of q's or k's size
    has the positions, the one dim of size 20, outermost); and the rotation's
    concat(-b, a) is not written out as its own array (before: a fusion of q's size and
    one of k's that negate and concatenate and multiply nothing). At a pass's positions
    (rotate_qk without positions, traced by `lower` as the zoo's layers are) the
    rotation's cos and sin are tables the program reads: no cosine or sine op is left
    (before: fused into each consumer of q and k, one per element, forward and
    backward)."""
    sizes = {"batch": 3, "length": 20, "memory": 20, "kv_heads": 2, "q_per_kv": 5, "d_kv": 4}
    r = np.random.default_rng(1)
    t = lambda dims: nm.tensor(r.normal(size=[sizes[d] for d in dims]).astype(np.float32), dims)

    def loss(q, k, v):
        q, k = common.rotate_qk(q, k, Config(), None, None)
        out = nm.dot_product_attention(q, k, v, scale=0.5, kernel="flash")
        return (out * out).sum()

    args = (t(QDIMS), t(KDIMS[1:]), t(KDIMS[1:]))
    lowered = lower(loss, Mesh({"one": 1}), "")  # as the zoo traces its layers
    text = jax.jit(jax.grad(lambda *a: lowered(*a).data, argnums=(0, 1, 2)))
    text = text.lower(*args).compile().as_text()
    q_size, k_size = 3 * 20 * 2 * 5 * 4, 3 * 20 * 2 * 4
    ours = [m for m in moves(text) if _elements(m.shape) in (q_size, k_size)]
    assert len(ours) >= 3  # q, k and v moved in at least (the oracle sees them)
    assert not [m.shape for m in ours if _outermost(m.shape) == 20], ours
    halves = [b for b in text.split("\n\n") if {"concatenate", "negate"} <= _ops(b)]
    assert halves and not [b.splitlines()[0] for b in halves if "multiply" not in _ops(b)]
    assert not {"cosine", "sine"} & _ops(text)


def _ops(computation: str) -> set[str]:
    """The opcodes of one computation of HLO text."""
    return set(re.findall(r"= \S+ ([a-z][\w-]*)\(", computation))


def _elements(shape: str) -> int:
    """The number of elements of an HLO shape."""
    return int(np.prod(_dims(shape)))


def _outermost(shape: str) -> int:
    """The size of an HLO shape's physically outermost dim (its layout's last entry)."""
    sizes, layout = re.match(r"\w+\[([\d,]*)\]\{([\d,]*)", shape).groups()
    return int(sizes.split(",")[int(layout.split(",")[-1])])
