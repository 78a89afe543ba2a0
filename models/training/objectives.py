"""Training objectives: how a batch of token windows becomes a model's inputs and targets.

- `lm`: next-token prediction; inputs are the window, targets the window shifted by one.
- `mlm` (BERT): 15% of positions are predicted; of those 80% become MASK, 10% a random
  token, 10% stay; targets are the original tokens, weights 1 at predicted positions.
- `span` (T5's span corruption): 15% of tokens in spans of mean length 3 are dropped
  from the encoder's inputs, each span replaced by a sentinel; the decoder predicts
  each sentinel followed by its span.

Special tokens sit above the tokenizer's vocabulary: MASK, BOS, then the sentinels.
Every batch is a dict of (batch, length) arrays; `FIELDS` names them and their dtypes.
"""

from __future__ import annotations

import numpy as np

import namedmesh as nm

MAX_SENTINELS = 64
_I, _F = np.int32, np.float32
FIELDS = {
    "lm": {"inputs": _I, "targets": _I, "weights": _F},
    "mlm": {"inputs": _I, "targets": _I, "weights": _F},
    "span": {
        "inputs": _I,
        "input_weights": _F,
        "decoder_inputs": _I,
        "targets": _I,
        "weights": _F,
    },
}


ID_FIELDS = ("inputs", "targets", "decoder_inputs")  # token ids: each below the vocab


def check_batch(batch: dict, objective: str, vocab: int) -> None:
    """DataError naming the field at fault in a batch of arrays given to train or
    evaluate on: one of the objective's FIELDS missing, a field not of inputs' 2-D
    (batch, length) shape, or a token id outside the model's vocabulary 0 ... vocab - 1
    (the embedding's gather would clamp it, and the loss of a target past it would be
    computed against no row: a silent wrong answer)."""
    from models.errors import DataError

    missing = [k for k in FIELDS[objective] if k not in batch]
    if missing:
        raise DataError(
            f"the batch has no {', '.join(missing)}: the {objective} objective's batch "
            f"holds {', '.join(FIELDS[objective])} (it has {', '.join(batch) or 'nothing'})"
        )
    shape = np.shape(batch["inputs"])
    for k, v in batch.items():
        if np.ndim(v) != 2 or np.shape(v) != shape:
            raise DataError(
                f"the batch's {k} has the shape {np.shape(v)}; every field of a batch is "
                f"(batch, length), as inputs' {shape}"
            )
    for k in ID_FIELDS:
        ids = np.asarray(batch.get(k, ()))
        if not ids.size:
            continue
        lo, hi = ids.min(), ids.max()
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise DataError(
                f"the batch's {k} hold the id {bad}, outside the model's vocabulary "
                f"0 ... {vocab - 1} (Config.vocab {vocab})"
            )


def abstract_batch(objective: str, batch: int, length: int) -> dict:
    """The objective's batch as abstract Tensors (shapes only): enough to plan with."""
    sizes = {"batch": batch, "length": length}
    return {k: nm.abstract(sizes, dtype) for k, dtype in FIELDS[objective].items()}


def special_tokens(objective: str) -> int:
    """How many ids above the tokenizer's vocabulary the objective uses."""
    return {"lm": 0, "mlm": 1, "span": 2 + MAX_SENTINELS}[objective]


def window_length(objective: str, length: int) -> int:
    """Tokens of text cut for one example of `length` positions."""
    return length + 1 if objective == "lm" else length


def make(objective: str, windows: np.ndarray, base: int, rng: np.random.Generator) -> dict:
    """The batch of `objective` from token windows (batch, window_length); `base` is
    the tokenizer's vocabulary size (the first special id)."""
    if objective == "lm":
        ones = np.ones(windows[:, 1:].shape, _F)
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:], "weights": ones}
    if objective == "mlm":
        return masked_lm(windows, base, rng)
    if objective == "span":
        rows = [span_corruption(w, base, rng) for w in windows]
        return {k: np.stack([r[k] for r in rows]) for k in FIELDS["span"]}
    raise ValueError(f"unknown objective {objective!r}; known: {', '.join(FIELDS)}")


def masked_lm(windows: np.ndarray, base: int, rng, rate: float = 0.15) -> dict:
    chosen = rng.random(windows.shape) < rate
    chosen[np.arange(len(windows)), rng.integers(0, windows.shape[1], len(windows))] = True
    how = rng.random(windows.shape)
    inputs = np.where(chosen & (how < 0.8), base, windows)
    random = chosen & (how >= 0.8) & (how < 0.9)
    inputs = np.where(random, rng.integers(0, base, windows.shape), inputs)
    targets = windows.astype(_I)
    return {"inputs": inputs.astype(_I), "targets": targets, "weights": chosen.astype(_F)}


def _parts(rng, total: int, n: int) -> np.ndarray:
    """n random positive lengths that sum to `total`."""
    cuts = np.sort(rng.choice(np.arange(1, total), n - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]]))


def span_corruption(ids: np.ndarray, base: int, rng, density=0.15, mean_span=3.0) -> dict:
    """One example: inputs are `ids` with each noise span replaced by its sentinel,
    targets are sentinel, span, sentinel, span, ...; both padded to len(ids)."""
    n = len(ids)
    noise = max(1, round(n * density))
    spans = min(MAX_SENTINELS, max(1, round(noise / mean_span)), n - noise)
    noise_lens, keep_lens = _parts(rng, noise, spans), _parts(rng, n - noise, spans)
    inputs, targets, at = [], [], 0
    for i, (keep, drop) in enumerate(zip(keep_lens, noise_lens, strict=True)):
        sentinel = base + 2 + i
        inputs += [*ids[at : at + keep], sentinel]
        targets += [sentinel, *ids[at + keep : at + keep + drop]]
        at += keep + drop
    bos = base + 1
    pad = lambda xs: np.array(xs + [0] * (n - len(xs)), _I)
    return {
        "inputs": pad(inputs),
        "input_weights": (np.arange(n) < len(inputs)).astype(_F),
        "decoder_inputs": pad(([bos] + targets)[:n]),
        "targets": pad(targets),
        "weights": (np.arange(n) < len(targets)).astype(_F),
    }
