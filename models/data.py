"""Text, tokenizers and batches. The default corpus is the CPython documentation text
that every Python ships (`pydoc_data.topics`, about 460 KB of English); `load_text`
takes any text file or folder of text files instead. The last tenth of the text is
the validation split. A training batch depends only on (seed, step), so a resumed
run sees the same data in the same order."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from models import files, objectives

VALIDATION_FRACTION = 0.1


class DataError(ValueError):
    """Bad data path, empty corpus, or a corpus too short for the sequence length."""


def load_text(path: str | None = None) -> str:
    """The default corpus, or the text of a file, or of every file under a folder
    (sorted by path, read as UTF-8 with undecodable bytes replaced)."""
    if path is None:
        from pydoc_data.topics import topics

        return "".join(topics[k] for k in sorted(topics))
    p = Path(path)
    if not p.exists():
        raise DataError(f"--data {path}: no such file or folder")
    found = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    text = "".join(_text(f, path) for f in found)
    if not text:
        raise DataError(f"--data {path}: no text found")
    return text


def _text(file: Path, flag: str) -> str:
    """A file's text; DataError for a binary file (one holding a NUL byte, as no text
    does), naming it and the byte."""
    raw = file.read_bytes()
    nul = raw.find(b"\0")
    if nul >= 0:
        raise DataError(
            f"--data {flag}: {file} is not text (a NUL byte at offset {nul}); "
            "give a UTF-8 text file or a folder of them"
        )
    return raw.decode("utf-8", errors="replace")


def split(text: str) -> tuple[str, str]:
    """(train, validation): the validation split is the last tenth of the text."""
    cut = int(len(text) * (1 - VALIDATION_FRACTION))
    return text[:cut], text[cut:]


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, one token per byte."""

    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        files.write_json(Path(directory) / "tokenizer.json", {"kind": "byte"}, indent=None)


class BPETokenizer:
    """A byte-level BPE trained with the `tokenizers` package on the training split."""

    kind = "bpe"

    def __init__(self, tok):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()

    @classmethod
    def train(cls, text: str, vocab_size: int = 1024) -> BPETokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        chunks = [text[i : i + 4096] for i in range(0, len(text), 4096)]
        tok.train_from_iterator(chunks, trainer=trainer)
        return cls(tok)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])

    def save(self, directory: Path) -> None:
        files.write_with(Path(directory) / "tokenizer.json", self.tok.save)


def load_tokenizer(directory: str | Path):
    """The tokenizer saved with a checkpoint (`save`)."""
    return load_tokenizer_file(Path(directory) / "tokenizer.json")


def load_tokenizer_file(path: str | Path):
    """A tokenizer from a `tokenizer.json` file: ours (`{"kind": "byte"}`) or one the
    `tokenizers` package wrote (a BPE, trained here or elsewhere). DataError for a file
    that is missing or not a tokenizer."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer file {path} does not exist")
    try:
        spec = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"tokenizer file {path} is not JSON: {e}") from None
    if spec.get("kind") == "byte":
        return ByteTokenizer()
    from tokenizers import Tokenizer

    try:
        return BPETokenizer(Tokenizer.from_file(str(path)))
    except Exception as e:  # the tokenizers package raises its own exception type
        raise DataError(f"{path} is not a tokenizer.json that `tokenizers` reads: {e}") from None


def padded_vocab(n: int, objective: str = "lm", multiple: int = 128) -> int:
    """The model's vocabulary: the tokenizer's and the objective's special tokens,
    rounded up so that mesh axes divide it."""
    return math.ceil((n + objectives.special_tokens(objective)) / multiple) * multiple


class Corpus:
    """Token ids of the train and validation splits, and the batches of an objective
    (models/objectives.py) cut from them."""

    def __init__(self, text: str, tokenizer, length: int, objective: str = "lm"):
        train, valid = split(text)
        self.tokenizer = tokenizer
        self.train = tokenizer.encode(train)
        self.valid = tokenizer.encode(valid)
        self.valid_bytes = len(valid.encode("utf-8"))
        self.length, self.objective = length, objective
        self.window = objectives.window_length(objective, length)
        for name, ids in (("train", self.train), ("validation", self.valid)):
            if len(ids) < self.window + 1:
                raise DataError(
                    f"the {name} split has {len(ids)} tokens, fewer than a sequence of "
                    f"{self.window}; use a longer text or a shorter --length"
                )

    def batch(self, step: int, batch: int, seed: int) -> dict[str, np.ndarray]:
        """Training examples for `step`: offsets (and masks) drawn from (seed, step) alone."""
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, len(self.train) - self.window, size=batch)
        return self._examples(self.train, starts, rng)

    def validation_batches(self, batch: int, max_batches: int | None = None):
        """Consecutive windows covering the validation split (the last batch padded with
        zero-weight rows); the same every time."""
        starts = np.arange(0, len(self.valid) - self.window, self.length)
        if max_batches is not None:
            starts = starts[: max_batches * batch]
        for i in range(0, len(starts), batch):
            chunk = starts[i : i + batch]
            out = self._examples(self.valid, np.resize(chunk, batch), np.random.default_rng(i))
            out["weights"][len(chunk) :] = 0.0
            yield out

    def _examples(self, ids, starts, rng) -> dict[str, np.ndarray]:
        windows = ids[starts[:, None] + np.arange(self.window)[None, :]].astype(np.int32)
        return objectives.make(self.objective, windows, self.tokenizer.vocab_size, rng)

    def bytes_per_token(self) -> float:
        """Validation bytes per validation token (1 for the byte tokenizer)."""
        return self.valid_bytes / max(len(self.valid), 1)
