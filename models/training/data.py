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

from models.errors import DataError as DataError  # re-exported: its home was here
from models.io import files
from models.training import datasets, objectives

VALIDATION_FRACTION = 0.1


def load_text(path: str | None = None, flag: str = "--data", text_field: str = "text"):
    """The default corpus (None), or what `path` holds: text (a `str`) or token ids
    (`models.training.datasets.Tokens`, memory-mapped), as models/training/datasets.py reads each
    kind of
    file; DataError naming `flag` and the file at fault. (Chat data: models/training/corpora.py.)"""
    if path is None:
        from pydoc_data.topics import topics

        return "".join(topics[k] for k in sorted(topics))
    return datasets.read(path, flag, text_field)


def split(text):
    """(train, validation): the validation split is the last tenth of the text (or of
    the token ids, as views of their memory map)."""
    if not isinstance(text, str):
        return text.split(VALIDATION_FRACTION)
    cut = int(len(text) * (1 - VALIDATION_FRACTION))
    return text[:cut], text[cut:]


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, one token per byte."""

    kind = "byte"
    vocab_size = 256

    def encode(self, text: str, specials: bool = True) -> np.ndarray:
        """The text's bytes (`specials`: as BPETokenizer's; bytes have none)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def byte_count(self, ids) -> int:
        """The bytes `ids` stand for: one each (their text, `decode`, would count 3 for
        each byte that is no UTF-8, the replacement character's)."""
        ids = np.asarray(ids)
        return int(np.count_nonzero((ids >= 0) & (ids < 256)))

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

    def encode(self, text: str, specials: bool = True) -> np.ndarray:
        """The text's ids; with `specials`, inside the special tokens the tokenizer's
        post-processor adds (a Llama folder's <s>); without, as a chat template's text
        is tokenized (the template writes them)."""
        return np.asarray(self.tok.encode(text, add_special_tokens=specials).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])

    def byte_count(self, ids) -> int:
        """The UTF-8 bytes of the text of `ids`."""
        return len(self.decode(ids).encode("utf-8"))

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
    if path.is_dir():
        hint = path / "tokenizer.json"
        raise DataError(
            f"tokenizer file {path} is a folder: pass the file, --tokenizer {hint}"
            if hint.is_file()
            else f"tokenizer file {path} is a folder without a tokenizer.json"
        )
    if not path.is_file():
        raise DataError(f"tokenizer file {path} does not exist")
    try:
        spec = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"tokenizer file {path} is not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise DataError(f"tokenizer file {path} holds a {type(spec).__name__}, not a tokenizer")
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
    (models/training/objectives.py) cut from them."""

    def __init__(self, text, tokenizer, length: int, objective: str = "lm", valid=None):
        """`text` (and `valid`): a str, or `models.training.datasets.Tokens` used as they are (a
        memory map, checked against the tokenizer's vocabulary); without `valid` the
        validation split is the last tenth of `text`."""
        train, held_out = split(text) if valid is None else (text, valid)
        self.tokenizer = tokenizer
        self.train = _ids(train, tokenizer, "--data")
        self.valid = _ids(held_out, tokenizer, "--data" if valid is None else "--val-data")
        self.valid_bytes = byte_length(held_out, tokenizer)
        self.length, self.objective = length, objective
        self.window = objectives.window_length(objective, length)
        self._check_sizes(text, valid)

    def _check_sizes(self, text, valid) -> None:
        """DataError naming the split too short: the train split for one training window
        in it, the validation split for one whole window; `eval` (which passes
        its data as both splits and trains on none) for one next-token target."""
        if valid is not text and len(self.train) < self.window:
            raise DataError(
                f"the train split has {len(self.train)} tokens; a training window takes "
                f"{self.window}: use a longer text or a shorter --length"
            )
        lm = self.objective == "lm" and valid is text  # eval's next-token windows
        if len(self.valid) >= (least := 2 if lm else self.window):
            return
        what = "--data" if valid is text else "--val-data"
        if valid is None:
            what = "--data's validation split (its last tenth)"
        raise DataError(
            f"{what} has {len(self.valid)} token(s), fewer than the {least} "
            f"{'a next-token prediction' if lm else 'one window'} needs"
            f"{'' if lm else ': use a longer text or a shorter --length'}"
        )

    def batch(self, step: int, batch: int, seed: int, rows=None) -> dict[str, np.ndarray]:
        """Training examples for `step`: offsets (and masks) drawn from (seed, step) alone,
        each window's start any of the train split's, its last (a window ending on the
        split's last token) too.
        With `rows` (the rows this process's devices hold), only those windows are read
        from the data; the other rows are zeros that no device of this process receives."""
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, len(self.train) - self.window + 1, size=batch)
        return self._examples(self.train, starts, rng, rows)

    def validation_starts(self) -> np.ndarray:
        """Where `validation_batches`' windows start: every --length tokens, so that
        each window's first input is the previous one's last target. Next-token windows
        run while a target is left (the last may end past the data: its missing targets
        weigh 0), so every token after the first is scored once; other objectives' windows
        lie whole in the data."""
        last = len(self.valid) - (1 if self.objective == "lm" else self.window - 1)
        return np.arange(0, max(last, 0), self.length)

    def validation_batches(self, batch: int, max_batches: int | None = None):
        """Consecutive windows covering the validation split (`validation_starts`; the
        last batch padded with zero-weight rows); the same every time."""
        starts = self.validation_starts()
        if max_batches is not None:
            starts = starts[: max_batches * batch]
        for i in range(0, len(starts), batch):
            chunk = starts[i : i + batch]
            out = self._examples(self.valid, np.resize(chunk, batch), np.random.default_rng(i))
            out["weights"][len(chunk) :] = 0.0
            yield out

    def _examples(self, ids, starts, rng, rows=None) -> dict[str, np.ndarray]:
        """The objective's batch of windows at `starts` (of `rows` alone; the rest zeros);
        a window past the end of `ids` is padded with 0, its targets there weighing 0."""
        rows = np.arange(len(starts)) if rows is None else np.asarray(rows, dtype=np.int64)
        at = starts[rows, None] + np.arange(self.window)[None, :]
        inside = at < len(ids)
        windows = np.zeros((len(starts), self.window), np.int32)
        windows[rows] = np.where(inside, ids[np.minimum(at, len(ids) - 1)], 0)
        out = objectives.make(self.objective, windows, self.tokenizer.vocab_size, rng)
        if not inside.all():  # lm windows alone end past the data (validation_starts)
            out["weights"][rows] *= inside[:, 1:]
        return out

    def validation_windows(self) -> int:
        """The windows `validation_batches` covers: one per --length tokens."""
        return len(self.validation_starts())

    def bytes_per_token(self, windows: int | None = None) -> float:
        """Validation bytes per validation token (1 for the byte tokenizer); with
        `windows` fewer than all (eval's --max-batches), of the tokens the first
        `windows` score (of a token file, of their first SAMPLE_TOKENS), whose bytes
        per token may be another than the whole split's."""
        if windows is None or windows >= self.validation_windows():
            return self.valid_bytes / max(len(self.valid), 1)
        end = self.validation_starts()[windows - 1] + self.window
        scored = np.asarray(self.valid[1:end][:SAMPLE_TOKENS])
        return self.tokenizer.byte_count(scored) / len(scored)


SAMPLE_TOKENS = 1 << 20  # token ids decoded to measure the bytes per token of a token file


def _ids(part, tokenizer, flag: str) -> np.ndarray:
    """Token ids of a split: text encoded, token files checked and kept as they are."""
    if isinstance(part, str):
        return tokenizer.encode(part)
    part.check_vocab(tokenizer.vocab_size, flag)
    return part.ids


def byte_length(part, tokenizer) -> float:
    """UTF-8 bytes of a split: of the text; of a token file, its tokens times the bytes
    per token of its first SAMPLE_TOKENS ids decoded (all of them when it is shorter)."""
    if isinstance(part, str):
        return len(part.encode("utf-8"))
    sample = np.asarray(part.ids[:SAMPLE_TOKENS])
    if not len(sample):
        return 0
    return tokenizer.byte_count(sample) * len(part) / len(sample)
