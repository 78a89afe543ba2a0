"""LoRA (Hu et al. 2021, as PEFT computes it): a projection W of the zoo gains two
adapters, A (W's input dims + `lora`) and B (`lora` + W's output dims), and computes
x W + alpha/r * dropout(x) A B. B starts at zero, so an adapted model starts equal to
its base; only the adapters train (models/training/trainable.py freezes the rest).

The rank is the named dim `lora`: a layout may map it like any other (none does by
default). The adapters sit beside their weight in the parameter tree (`q_lora_a`,
`q_lora_b` beside `q`); the projections of models/layers/common.py add their update where
they find them (`update`). The scale alpha/r and the adapters' dropout are not stored:
`bind` applies them to the parameters the loss sees, so a checkpoint holds plain
arrays and a run's record (run.json) holds the flags. Generation, evaluation and a
default export read a LoRA run merged (`merged`: W + alpha/r A B); `--adapter-only`
writes the adapters as PEFT does (models/peft.py).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import namedmesh as nm
from models.params import init
from models.training.trainable import join
from namedmesh.errors import ParameterError

# The projections --lora-targets names (PEFT's names for Llama's modules, less _proj)
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
DEFAULT_TARGETS = ("q", "v")  # PEFT's default for Llama-like models
DEFAULT_ALPHA = 8.0  # PEFT's LoraConfig default: the scale is alpha / rank
# The parameter dicts whose projections models/layers/common.py computes (and so adapts):
# multi-head self- and cross-attention, a dense FFN and a MoE's shared FFN.
ATTENTION, FFN = ("attn", "cross"), ("ffn", "shared")
SUFFIXES = ("_lora_a", "_lora_b")


class LoraError(ParameterError):
    """A LoRA flag the model cannot take: an unknown target, a target the model lacks."""


class Lora(NamedTuple):
    """The adapters of a run: rank r, alpha (the update is scaled by alpha / r), the
    dropout on their input while training, and the projections they adapt."""

    rank: int
    alpha: float = DEFAULT_ALPHA
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def parse_targets(text: str) -> tuple[str, ...]:
    """ "q,k,v" -> ("q", "k", "v"); LoraError naming the flag, the value and the valid
    names for an unknown or repeated one."""
    names = tuple(s.strip() for s in text.split(","))
    for name in names:
        if name not in TARGETS:
            raise LoraError(
                f"--lora-targets {text}: unknown projection {name!r}; the valid names are "
                f"{', '.join(TARGETS)}"
            )
    if len(set(names)) < len(names):
        raise LoraError(f"--lora-targets {text}: a projection named twice")
    return names


def of_flags(flags) -> Lora | None:
    """The Lora of a run's flags (an argparse Namespace, or run.json's dict): None
    without --lora-rank."""
    get = flags.get if isinstance(flags, dict) else lambda k: getattr(flags, k, None)
    if not get("lora_rank"):
        return None
    alpha, dropout, targets = get("lora_alpha"), get("lora_dropout"), get("lora_targets")
    return Lora(
        get("lora_rank"),
        DEFAULT_ALPHA if alpha is None else alpha,
        dropout or 0.0,
        DEFAULT_TARGETS if targets is None else parse_targets(targets),
    )


def zoo_names(p: dict) -> dict[str, str]:
    """--lora-targets' names -> the parameter names of one parameter dict: q, k, v, o
    of attention; gate (activated), up and down of a gated FFN (wi, wg, wo; Llama's
    gate_proj, up_proj, down_proj), up and down of a plain one (wi, wo)."""
    gated = "wg" in p
    names = {"q": "q", "k": "k", "v": "v", "o": "o", "down": "wo"}
    return names | ({"gate": "wi", "up": "wg"} if gated else {"up": "wi"})


def _input_dims(name: str, w) -> tuple[str, ...]:
    """The dims of W that x contracts (the rest, but `layers`, are its output's)."""
    if name in ("q", "k", "v", "wi", "wg"):
        return ("d_model",)
    if name == "wo":
        return ("d_ff",)
    return tuple(d for d in w.sizes if d not in ("layers", "d_model"))  # o: the heads'


def adapter_shapes(shapes: dict, cfg, lora: Lora) -> dict:
    """`shapes` (a model's nested dict of Params) with the adapters of `lora`'s targets
    beside each projection they adapt; LoraError naming a target the model has nowhere
    (MLA's attention and a MoE's experts are computed apart: not adapted)."""
    found: set[str] = set()
    out = _adapt(shapes, cfg, lora, "", found)
    missing = [t for t in lora.targets if t not in found]
    if missing:
        able: set[str] = set()  # what the model has of every target, to name them
        _adapt(shapes, cfg, lora._replace(targets=TARGETS), "", able)
        raise LoraError(
            f"--lora-targets {','.join(lora.targets)}: the model has no {', '.join(missing)} "
            f"projection that LoRA adapts (it adapts "
            f"{', '.join(t for t in TARGETS if t in able) or 'none'}; "
            "multi-head attention's q,k,v,o and a dense FFN's gate,up,down, not MLA's or a "
            "MoE's experts)"
        )
    return out


def _adapt(tree: dict, cfg, lora: Lora, where: str, found: set) -> dict:
    out = {k: _adapt(v, cfg, lora, k, found) if isinstance(v, dict) else v for k, v in tree.items()}
    mla = getattr(cfg, "attention_variant", "mha") != "mha"
    if (where in ATTENTION and not mla) or where in FFN:
        for target, name in zoo_names(tree).items():
            w = tree.get(name)
            if target in lora.targets and w is not None and "experts" not in w.sizes:
                out[name + "_lora_a"], out[name + "_lora_b"] = _adapters(name, w, lora.rank)
                found.add(target)
    return out


def _adapters(name: str, w, rank: int):
    """(A, B) Params for W: A over W's lead dims, input dims and `lora`, drawn with
    the variance of PEFT's kaiming-uniform (1 / (3 fan_in)); B over `lora` and W's
    output dims, zeros."""
    ins = _input_dims(name, w)
    lead = {d: n for d, n in w.sizes.items() if d == "layers"}
    fan_in = int(np.prod([w.sizes[d] for d in ins]))
    a = {**lead, **{d: w.sizes[d] for d in ins}, "lora": rank}
    b = {**lead, "lora": rank, **{d: n for d, n in w.sizes.items() if d not in a}}
    return w._replace(sizes=a, init=(3 * fan_in) ** -0.5), w._replace(sizes=b, init="zeros")


def is_adapter(path: str) -> bool:
    """Whether the parameter at `path` (`layers/attn/q_lora_a`) is an adapter."""
    return path.endswith(SUFFIXES)


def update(x: nm.Tensor, p: dict, name: str, out: tuple) -> nm.Tensor:
    """The adapters' part of projection `name`: dropout(x) A B (B already scaled by
    `bind`), with dims `out`. x's dims that A has are contracted; A's other dims (a
    stack's `layers`) are kept, as the weight's are."""
    a, b = p[name + "_lora_a"], p[name + "_lora_b"]
    if name + "_lora_key" in p:  # training with --lora-dropout: inverted dropout of x
        keep = p[name + "_lora_keep"]
        kept = nm.random.uniform(p[name + "_lora_key"], x.sizes) < nm.astype(keep, np.float32)
        x = nm.where(kept, x / keep, 0)
    dims = tuple(d for d in x.dims if d not in a.dims) + tuple(d for d in a.dims if d not in x.dims)
    return nm.einsum(nm.einsum(x, a, out=dims), b, out=out)


def bind(params: dict, lora: Lora, key=None) -> dict:
    """The parameters a loss computes with: every B times alpha / r (so gradients reach
    B scaled, as PEFT's do) and, with a dropout key and rate, a key per layer and
    projection for the adapters' dropout."""
    return _bind(params, lora, key, "")


def _bind(tree: dict, lora: Lora, key, path: str) -> dict:
    out = {}
    for k, v in tree.items():
        here = f"{path}/{k}" if path else k
        out[k] = _bind(v, lora, key, here) if isinstance(v, dict) else v
        if not k.endswith("_lora_b"):
            continue
        out[k] = v * np.float32(lora.scale)
        if key is not None and lora.dropout:
            name = k.removesuffix("_lora_b")
            out[name + "_lora_key"], out[name + "_lora_keep"] = _dropout_keys(v, lora, key, here)
    return out


def _dropout_keys(b, lora: Lora, key, path: str):
    """(keys, keep probability), each per layer where B has `layers`."""
    k = nm.random.fold_in(key, _hash(path))
    if "layers" not in b.dims:
        return k, nm.full({}, 1.0 - lora.dropout, np.float32)
    n = b.size_of("layers")
    keys = nm.stack([nm.random.fold_in(k, i) for i in range(n)], "layers")
    return keys, nm.full({"layers": n}, 1.0 - lora.dropout, np.float32)


def _hash(path: str) -> int:
    h = 0
    for c in path.encode():
        h = (h * 131 + c) % (2**31 - 1)
    return h


def merged(params: dict, lora: Lora) -> dict:
    """`params` with every adapted weight W replaced by W + alpha/r A B and the adapters
    dropped: a plain model of the base's shapes."""
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out[k] = merged(v, lora)
        elif not is_adapter(k):
            a, b = params.get(k + "_lora_a"), params.get(k + "_lora_b")
            if a is None:
                out[k] = v
            else:
                delta = nm.einsum(a, b, out=v.dims) * np.float32(lora.scale)
                out[k] = v + nm.astype(delta, v.dtype)
    return out


def adapted(model, lora: Lora | None, cfg):
    """The zoo Model `model` with `lora`'s adapters in its shapes and its loss computing
    through them (`bind`); `model` itself for None. LoraError, before anything is
    traced, for a target the model lacks."""
    if lora is None:
        return model
    adapter_shapes(model.shapes(cfg), cfg, lora)  # checked now, not at the first trace
    base_shapes, base_loss = model.shapes, model.loss
    return model._replace(
        shapes=lambda c: adapter_shapes(base_shapes(c), c, lora),
        loss=lambda p, b, c, k=None, stats=False: base_loss(bind(p, lora, k), b, c, k, stats),
    )


def completed(params: dict, shapes: dict, seed: int) -> dict:
    """`params` (a base model's, as loaded from a folder) with the adapters of `shapes`
    they lack, initialised as a fresh run's are (each from the seed and its path)."""
    import jax

    missing = _missing(params, shapes)
    if not missing:
        return params
    # one program for them all (eagerly, each draw compiles its own), the same values
    return join(params, jax.jit(lambda: init(missing, seed))())


def _missing(params: dict, shapes: dict) -> dict:
    out = {}
    for k, v in shapes.items():
        if k not in params:
            out[k] = v
        elif isinstance(v, dict):
            sub = _missing(params[k], v)
            if sub:
                out[k] = sub
    return out
