"""How a block puts its sublayers (attention, cross-attention, the MLP or experts) on
the residual stream: each composition is a function, not a flag of the shared block.

- pre (the zoo's, Llama's, GPT-2's): h + f(norm(h)) for each sublayer, a final norm
  after the stack;
- post (BERT's): norm(h + f(h)), no final norm;
- sandwich (Gemma 2 and 3): h + norm'(f(norm(h))), the sublayer's output normed too;
- parallel (GPT-NeoX, GPT-J): every sublayer reads the block's input,
  h + f1(norm1(h)) + f2(norm2(h)).

A sublayer's norms are parameters named after it: `<name>_norm` (and, sandwiched,
`<name>_post_norm`). A family declares its composition by name (Config.block); a new
one is a function here and a line in COMPOSITIONS. Nothing here imports the layers:
the block hands a composition its `norm(x, name)` and each sublayer's dropout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class Sublayer(NamedTuple):
    """One sublayer of a block: `name` prefixes its norms' parameters; `fn(x)` is
    (output, what else it returns: the router's statistics, a cache's new entries);
    `drop(y)` its output's dropout."""

    name: str
    fn: Callable
    drop: Callable


class Composition(NamedTuple):
    """`apply(h, sublayers, norm)` -> (h, {sublayer name: what its fn returned besides
    its output}); `norms`, the suffixes of each sublayer's norm parameters; `final_norm`,
    whether the stack ends with a norm."""

    apply: Callable
    norms: tuple[str, ...]
    final_norm: bool


def pre(h, sublayers, norm):
    extras = {}
    for s in sublayers:
        y, extras[s.name] = s.fn(norm(h, f"{s.name}_norm"))
        h = h + s.drop(y)
    return h, extras


def post(h, sublayers, norm):
    extras = {}
    for s in sublayers:
        y, extras[s.name] = s.fn(h)
        h = norm(h + s.drop(y), f"{s.name}_norm")
    return h, extras


def sandwich(h, sublayers, norm):
    extras = {}
    for s in sublayers:
        y, extras[s.name] = s.fn(norm(h, f"{s.name}_norm"))
        h = h + s.drop(norm(y, f"{s.name}_post_norm"))
    return h, extras


def parallel(h, sublayers, norm):
    extras, block_input = {}, h
    for s in sublayers:
        y, extras[s.name] = s.fn(norm(block_input, f"{s.name}_norm"))
        h = h + s.drop(y)
    return h, extras


COMPOSITIONS = {
    "pre": Composition(pre, ("_norm",), True),
    "post": Composition(post, ("_norm",), False),
    "sandwich": Composition(sandwich, ("_norm", "_post_norm"), True),
    "parallel": Composition(parallel, ("_norm",), True),
}
