"""`models.load(path)`: a Hugging Face folder or a training run as one object that
generates text and scores it, on the command line's functions (models/cli/generate.py).

    import models
    model = models.load("runs/tiny")             # or a Hugging Face folder
    model.generate("The assert", max_new_tokens=20, stop=["\\n"])   # -> str
    model.generate(["A", "B"], sampling=models.Sampling(0.8, top_p=0.9, seed=1))  # list of str
    model.logits("The assert")                   # -> (length, vocab) float32 array
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

import namedmesh as nm
from lowering import Layout, Mesh, lower
from models import zoo
from models.cli import generate
from models.inference.continuations import Continuations, check_stops
from models.inference.decoding import Decoder, pad_rows
from models.inference.sampling import Sampling
from models.io import files, hub
from namedmesh.errors import NamedMeshError, ParameterError


class LoadError(NamedMeshError, ValueError):
    """A path `models.load` cannot read as a model: the message names the path."""


def load(
    path: str | Path,
    mesh: Mesh | None = None,
    layout: Layout | str | None = None,
    step: int | None = None,
) -> Model:
    """The model of a Hugging Face folder (config.json, safetensors, a tokenizer) or of a
    training run's --out folder (its checkpoint at `step`, the latest by default), as
    `namedmesh generate` reads them; with a `mesh`, its programs are lowered under
    `layout` (a layout without a mesh is a ParameterError). LoadError naming the path
    for anything that is not such a model."""
    from models.cli.train import user_errors

    if mesh is None and layout:  # as generate's --layout without --mesh: never ignored
        raise ParameterError(f"layout={str(layout)!r} places the model on a mesh; pass mesh too")
    path = Path(path)
    try:
        params, cfg, tokenizer = generate.load(path, step)
        name = model_name(path)
        folder = generate.base_folder(path)
        ends = generate.end_ids(None, tokenizer, folder, cfg.vocab)
        start = generate.decoder_start(path)
    except (*user_errors(), KeyError) as e:
        message = str(e).strip("'\"")
        raise LoadError(message if str(path) in message else f"{path}: {message}") from e
    if mesh is not None:  # on the host, for the lowered programs to lay out
        params = jax.device_get(params)
    return Model(params, cfg, Tokens(tokenizer, ends, start), name, mesh, layout)


def model_name(path: Path) -> str:
    """The zoo model (models/zoo.py) of a run (run.json's "model") or a folder (its
    family's)."""
    if (path / "run.json").exists():
        return files.read_json(path / "run.json", "the run's record")["model"]
    return hub.FAMILIES[hub.read_config(path)[0]].model


@dataclass(frozen=True)
class Tokens:
    """What a run or folder says of its tokens: its tokenizer, the end ids a row stops
    at (generation_config.json's) and an encoder-decoder's decoder start id (None for
    a decoder)."""

    tokenizer: object
    ends: Sequence[int]
    start: int | None


class Model:
    """A loaded model: `.generate` (text), `.logits` (scores), `.tokenizer` (the run's or
    folder's: `.encode(text)`, `.decode(ids)`), `.config` (the zoo's Config), `.params`
    and `.eos` (the end ids a row stops at: the folder's generation_config.json's)."""

    def __init__(self, params, cfg, tokens: Tokens, name: str, mesh, layout):
        self.params, self.config, self.tokenizer = params, cfg, tokens.tokenizer
        self.name, self.eos, self.start = name, list(tokens.ends), tokens.start
        self.mesh, self.layout = mesh, layout
        self._decoder: Decoder | None = None
        self._forward = None

    def __repr__(self) -> str:
        return f"<models.Model {self.name} vocab={self.config.vocab} layers={self.config.layers}>"

    def generate(
        self,
        prompts: str | Sequence[str],
        max_new_tokens: int = 64,
        sampling: Sampling | None = None,
        stop: str | Sequence[str] | None = None,
        details: bool = False,
    ) -> str | list[str] | dict | list[dict]:
        """The continuation of each prompt (without the prompt): a str for a str, a list
        for a list, decoded as one batch. Greedy, or drawn as `sampling`
        (models.Sampling: temperature, top_k, top_p, seed) says: from
        softmax(logits / temperature) within the top_k likeliest (0: all) and the top_p
        nucleus, by its seed. A row ends at an end id (`.eos`), at the first
        occurrence of a `stop` string (cut from its text), after `max_new_tokens` or when
        it fills the model's length (`config.length`, prompt included). With `details`,
        each prompt's `--jsonl` object instead of its text: prompt, text, tokens (the new
        ids, without an end id), finish_reason ("stop", "eos" or "length")."""
        one = isinstance(prompts, str)
        texts = [prompts] if one else list(prompts)
        if not all(isinstance(t, str) for t in texts):
            raise ParameterError(f"prompts must be a str or a list of str, got {prompts!r}")
        if sampling is not None and not isinstance(sampling, Sampling):
            raise ParameterError(
                f"sampling must be a models.Sampling(temperature, top_k, top_p, seed) or None "
                f"(greedy), got {sampling!r}"
            )
        cont = Continuations(self.tokenizer, len(texts), self.eos, check_stops(stop))
        dec = self.decoder()
        ids = generate.encode_prompts(texts, self.tokenizer, None, False)
        request = generate.Request(max_new_tokens, sampling, max_length=dec.slots)
        generate.continue_prompts(dec, ids, cont, request, self.start)
        out = [generate.record(t, cont, i) for i, t in enumerate(texts)] if details else cont.texts
        return out[0] if one else out

    def decoder(self) -> Decoder:
        """The `Decoder` of these parameters (made once: its compiled steps are kept)."""
        if self._decoder is None:
            self._decoder = Decoder(self.params, self.config, mesh=self.mesh, layout=self.layout)
        return self._decoder

    def logits(self, texts_or_ids) -> np.ndarray:
        """Next-token logits at every position, float32, vocab last: (length, vocab) for
        a text or a list of ids; (batch, length, vocab) for a list of texts or of id
        lists, right-padded to the longest, its padded positions NaN."""
        if self.start is not None:
            raise ParameterError(
                f"logits of an encoder-decoder ({self.name}) need decoder inputs: use "
                "models.io.hub.load(folder).logits(input_ids, decoder_input_ids=...)"
            )
        one = _single(texts_or_ids)
        rows = [texts_or_ids] if one else list(texts_or_ids)
        ids = [self.tokenizer.encode(r) if isinstance(r, str) else r for r in rows]
        most = self.config.learned_positions or 2**31  # rotary, relative: no table to end
        padded, lengths = pad_rows(ids, self.config.vocab, most, multiple=1)
        out = np.array(self._program()(self.params, {"inputs": _tokens(padded)}).transpose(
            "batch", "length", "vocab"
        ).data, np.float32)  # fmt: skip
        out[np.arange(padded.shape[1])[None, :] >= lengths[:, None]] = np.nan
        return out[0] if one else out

    def _program(self):
        if self._forward is None:
            model, cfg = zoo.get(self.name), self.config
            fn = lambda p, b: model.logits(p, b, cfg)  # noqa: E731
            self._forward = jax.jit(fn) if self.mesh is None else lower(fn, self.mesh, self.layout)
        return self._forward


def _single(x) -> bool:
    """Whether `x` is one text or one list of ids (not a batch of them)."""
    if isinstance(x, str):
        return True
    if isinstance(x, np.ndarray):
        return x.ndim == 1
    if not isinstance(x, Sequence) or not len(x):
        raise ParameterError(f"logits take a text, ids, or a non-empty list of them, got {x!r}")
    return not isinstance(x[0], str | Sequence | np.ndarray)


def _tokens(rows: np.ndarray) -> nm.Tensor:
    return nm.tensor(np.asarray(rows, np.int32), ("batch", "length"))
