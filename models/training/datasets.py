"""What `--data` and `--val-data` read: text or token ids, by the kind of file.

- text: a UTF-8 file, or a folder of them (hidden files and folders such as `.git`
  skipped, linked folders followed, sorted by path); a file that is not UTF-8 text (a
  NUL byte, or bytes that do not decode) is refused by name, never decoded with
  replacement characters;
- `.bin`: uint16 token ids, nanoGPT's `train.bin`; `.npy`: a 1-D array of integer ids.
  Both are memory-mapped: a batch reads its windows, never the whole file;
- `.jsonl`: JSON lines, each an object whose `text_field` (default "text") is a document;
- `.json`: as `datasets`' json loader reads it: an array of such objects, one object,
  or else JSON lines of them;
- `.parquet`: a Parquet file's `text_field` column (pyarrow, the `data` extra);
- a folder saved by `datasets` (`Dataset.save_to_disk`; the `data` extra): its
  `text_field` column.

A folder holds text, JSON lines and Parquet files; token files are passed one by one.
Suffixes are read in any case (`.JSONL` is `.jsonl`); a gzip file (`NAME.jsonl.gz`,
`NAME.txt.gz`) is read as its decompressed content of the inner suffix (token files and
Parquet are not: decompress them). A UTF-8 byte order mark at the start of a file is no
text (as Python's utf-8-sig reads it). Documents are joined with a newline, and so are
a folder's files (where one does not end in one already). `read` returns a `str` or
`Tokens`. Text of every kind is read whole and then tokenized; a corpus larger than
memory goes in as token ids.
"""

from __future__ import annotations

import codecs
import gzip
import json
import zlib
from pathlib import Path

import numpy as np

from models.errors import DataError
from models.io.files import visible_files

CHUNK = 1 << 22  # ids per streamed pass over a token file (16 MiB of int32)
SNIFF = 8192  # bytes read to tell a binary file from text


class Tokens:
    """A 1-D array of token ids (a read-only memory map of `path`) and where it came from."""

    def __init__(self, ids: np.ndarray, path: Path):
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise DataError(
                f"{path}: token ids must be a 1-D integer array, got {ids.dtype} {ids.shape}"
            )
        self.ids, self.path = ids, path

    def __len__(self) -> int:
        return len(self.ids)

    def split(self, fraction: float) -> tuple[Tokens, Tokens]:
        """(first part, last `fraction`): views of the map, nothing read."""
        cut = int(len(self.ids) * (1 - fraction))
        return Tokens(self.ids[:cut], self.path), Tokens(self.ids[cut:], self.path)

    def extremes(self) -> tuple[int, int]:
        """The smallest and largest id, in streamed chunks (memory bounded, one pass)."""
        if not len(self.ids):
            return 0, -1
        chunks = [self.ids[i : i + CHUNK] for i in range(0, len(self.ids), CHUNK)]
        return min(int(c.min()) for c in chunks), max(int(c.max()) for c in chunks)

    def max(self) -> int:
        """The largest id (-1 for no ids)."""
        return self.extremes()[1]

    def check_vocab(self, vocab_size: int, flag: str) -> None:
        """DataError naming the file if an id does not fit the tokenizer's vocabulary:
        one past its end, or a negative one (an id of no token, read as one from the
        end by NumPy's indexing)."""
        low, top = self.extremes()
        for bad, why in ((low, low < 0), (top, top >= vocab_size)):
            if why:
                raise DataError(
                    f"{flag} {self.path}: holds token id {bad}, but the tokenizer has "
                    f"{vocab_size} ids (0 to {vocab_size - 1}); pass the --tokenizer the ids "
                    "were made with"
                )


def _bin(path: Path, field: str) -> Tokens:
    if path.stat().st_size % 2:
        raise DataError(f"{path}: a .bin of uint16 ids has an even size, this has an odd one")
    if not path.stat().st_size:  # np.memmap cannot map an empty file
        raise DataError(f"{path}: an empty .bin, no token ids")
    return Tokens(np.memmap(path, dtype=np.uint16, mode="r"), path)


def _npy(path: Path, field: str) -> Tokens:
    try:
        return Tokens(np.load(path, mmap_mode="r", allow_pickle=False), path)
    except ValueError as e:
        raise DataError(f"{path}: not a .npy array of token ids ({e})") from None


def _text(path: Path, field: str) -> str:
    return text_file(path)


def suffix(path: Path) -> str:
    """The suffix that says how a file is read: lower-cased, a gzip file's inner one."""
    name = path.name.lower()
    return Path(name.removesuffix(".gz") if name.endswith(".gz") else name).suffix


def _bytes(path: Path) -> bytes:
    """A file's bytes, a gzip file's decompressed; DataError naming a damaged gzip file."""
    if not path.name.lower().endswith(".gz"):
        return path.read_bytes()
    try:
        return gzip.decompress(path.read_bytes())
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: not a readable gzip file ({e})") from None


def text_file(path: Path) -> str:
    """The text of a UTF-8 file (gzip's decompressed, a leading byte order mark left
    out); DataError naming it when it is binary (a NUL byte, or bytes that do not
    decode), never decoded with replacement characters."""
    raw = _bytes(path).removeprefix(codecs.BOM_UTF8)
    if b"\0" in raw[:SNIFF]:
        raise DataError(
            f"{path}: a binary file, not UTF-8 text; token ids go in a .bin (uint16) or .npy "
            "file, and a folder of text must not hold other files"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:  # where, so that one bad byte in a big file is found
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path}: a binary file or not UTF-8 text: byte 0x{raw[e.start]:02x} on line "
            f"{line} does not decode (text in another encoding: convert it, e.g. "
            "iconv -f latin1 -t utf-8)"
        ) from None


def _field(path: Path, field: str, columns) -> None:
    if field not in columns:
        raise DataError(f"{path}: no {field!r} field (has {', '.join(map(str, columns))})")


def _document(value, where: str, field: str) -> str:
    """A document's text; DataError naming `where` when the field holds no text (a
    null is not the text "None", nor a number its digits)."""
    if not isinstance(value, str):
        kind = "null" if value is None else f"a {type(value).__name__}"
        raise DataError(f"{where}: the {field!r} field is {kind}, not text")
    return encodable(value, f"{where}: the {field!r} field")


def encodable(text: str, what: str) -> str:
    """`text`, or DataError naming `what` when it holds a lone UTF-16 surrogate (a JSON
    escape such as "\\ud83d", half of an emoji cut by a scraper), which no tokenizer
    can encode (UTF-8 has no such character: a raw error at tokenizing, else)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(
            f"{what} holds a lone surrogate \\u{ord(text[e.start]):04x} at character {e.start} "
            "(half of a UTF-16 pair), which is not text"
        ) from None
    return text


def _documents(values, where: str, field: str) -> str:
    """The documents of a column joined by newlines, each checked by `_document`."""
    return "\n".join(_document(v, f"{where} row {n}", field) for n, v in enumerate(values, 1))


def json_lines(text: str) -> list[str]:
    """The lines of a JSON lines text: split at "\n" alone (a "\r" before it is JSON's
    whitespace), never at what str.splitlines also takes for a break (U+2028, NEL, a
    form feed), which a JSON string holds as text."""
    return text.split("\n")


def _jsonl(path: Path, field: str) -> str:
    docs = []
    for n, line in enumerate(json_lines(_text(path, field)), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not a JSON line ({e.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{n}: a JSON line must be an object with a {field!r} field")
        _field(Path(f"{path}:{n}"), field, row)
        docs.append(_document(row[field], f"{path}:{n}", field))
    return "\n".join(docs)


def _json(path: Path, field: str) -> str:
    text = _text(path, field)
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as e:  # several values: JSON lines, each line's error named
        if text.lstrip().startswith("["):
            raise DataError(f"{path}: not a JSON array ({e.msg}, line {e.lineno})") from None
        return _jsonl(path, field)
    if isinstance(whole, dict):  # one object (on one line or several): one record
        whole = [whole]
    if not isinstance(whole, list):
        raise DataError(
            f"{path}: holds a JSON {type(whole).__name__}; a .json file of documents is an "
            f"array of objects with a {field!r} field, or JSON lines of them"
        )
    docs = []
    for n, row in enumerate(whole, 1):
        if not isinstance(row, dict):
            raise DataError(f"{path} row {n}: an item must be an object with a {field!r} field")
        if field not in row and "messages" in row:  # conversations: chat.py reads JSON lines
            raise DataError(
                f"{path} row {n}: a conversation (messages), no {field!r} field: chat data "
                "is a .jsonl file, one conversation a line (docs/chat.md)"
            )
        _field(Path(f"{path} row {n}"), field, row)
        docs.append(_document(row[field], f"{path} row {n}", field))
    return "\n".join(docs)


def _extra(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(
            f"reading this data needs {module.split('.')[0]}: pip install 'namedmesh[data]'"
        ) from None


def _parquet(path: Path, field: str) -> str:
    pq = _extra("pyarrow.parquet")
    try:
        schema = pq.read_schema(path)
        _field(path, field, schema.names)
        table = pq.read_table(path, columns=[field])
    except (_extra("pyarrow").ArrowException, OSError) as e:  # ArrowInvalid: not Parquet
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    return _documents(table.column(field).to_pylist(), str(path), field)


def _compressed(path: Path, field: str):
    raise DataError(
        f"{path}: a compressed {suffix(path)} file; decompress it (token ids are memory-mapped, "
        "Parquet compresses its own columns)"
    )


def _dataset(path: Path, field: str) -> str:
    ds = _extra("datasets").load_from_disk(str(path))
    if not hasattr(ds, "column_names") or isinstance(ds.column_names, dict):
        raise DataError(
            f"{path}: a dataset of several splits ({', '.join(ds)}); pass one split's folder, "
            f"e.g. {path / next(iter(ds))}"
        )
    _field(path, field, ds.column_names)
    return _documents(ds[field], str(path), field)


# file suffix -> reader(path, text_field) -> str | Tokens
READERS = {".bin": _bin, ".npy": _npy, ".jsonl": _jsonl, ".json": _json, ".parquet": _parquet}


TOKEN_SUFFIXES = (".bin", ".npy")


def reader(path: Path):
    """The reader of a file, by `suffix` (text for any other)."""
    kind = suffix(path)
    if path.name.lower().endswith(".gz") and kind in (*TOKEN_SUFFIXES, ".parquet"):
        return _compressed
    return READERS.get(kind, _text)


DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def _folder(folder: Path, field: str) -> str:
    if any((folder / m).is_file() for m in DATASET_MARKERS):
        return _dataset(folder, field)
    files = visible_files(folder)
    for f in files:
        if suffix(f) in TOKEN_SUFFIXES:
            raise DataError(f"{f}: token files are read one at a time; pass it as --data {f}")
    parts = [p for f in files if (p := reader(f)(f, field))]  # an empty file: no line
    # one file's last document and the next's first stay apart, as a file's documents do
    return "".join(p if p.endswith("\n") or i == len(parts) - 1 else p + "\n"
                   for i, p in enumerate(parts))  # fmt: skip


def read(path: str | Path, flag: str = "--data", text_field: str = "text") -> str | Tokens:
    """The text or token ids at `path` (see the module's docstring); DataError naming
    `flag` and the file for a path that is missing, empty or of the wrong kind."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{flag} {path}: no such file or folder")
    try:
        out = _folder(p, text_field) if p.is_dir() else reader(p)(p, text_field)
    except DataError as e:
        where = "" if str(e).startswith(str(p)) else f"{p}: "
        raise DataError(f"{flag} {where}{e}") from None
    if not len(out):
        raise DataError(f"{flag} {path}: no text or token ids found")
    return out
