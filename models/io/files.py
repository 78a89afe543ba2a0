"""Files written so that a kill, a full disk or a read-only folder never leaves one half
written: every write goes to a temporary name beside the target, is flushed to disk,
then renamed over it (a rename within a folder is atomic on POSIX), and a folder is
replaced whole. A log of JSON lines is appended; a torn last line (a kill or a full disk
in the middle of an append) is dropped with a warning when it is read.

A kill leaves at most a temporary beside the target, named for the host and process
that wrote it (`.NAME.HOST-PID.XXXX.tmp`), and, between replace_folder's two renames,
the previous folder as `.NAME.old`. The next write of NAME sweeps both: this host's
temporaries whose process is gone are removed, and a lone `.NAME.old` is put back."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from namedmesh.errors import NamedMeshError


class FileWriteError(NamedMeshError, OSError):
    """A file or folder that could not be written (full disk, read-only folder); what
    was there before is left as it was."""


class FileReadError(NamedMeshError, ValueError):
    """A file that is damaged: not the JSON (lines) it should hold."""


def _fail(path: Path, e: OSError) -> FileWriteError:
    return FileWriteError(f"cannot write {path}: {e.strerror or e}; it is left as it was")


def write_atomic(path, content: str | bytes) -> None:
    """Write `content` to `path` through a temporary file and a rename."""
    write_with(path, lambda tmp: Path(tmp).write_bytes(_bytes(content)))


def write_json(path, value, indent: int | None = 1) -> None:
    write_atomic(path, json.dumps(value, indent=indent))


def write_with(path, writer: Callable[[str], object]) -> None:
    """`writer(temporary path)` writes the file (a library's own `save(path)`), then the
    file is renamed to `path`. FileWriteError when it cannot be written."""
    path = Path(path)
    sweep(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_prefix(path), suffix=".tmp")
    except OSError as e:
        raise _fail(path, e) from None
    os.close(fd)
    try:
        _as_created(Path(tmp), 0o666)
        writer(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise _fail(path, e) from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _prefix(path: Path) -> str:
    """The name of `path`'s temporaries up to their random part: the host and process
    writing, so that a later write can tell a killed writer's leftovers from a live one's."""
    return f".{path.name}.{socket.gethostname()}-{os.getpid()}."


def _dead_writer(leftover: Path, target: Path) -> bool:
    """Whether `leftover` is a temporary of `target` written on this host by a process
    that no longer runs (one written elsewhere, or by an older version, is left alone)."""
    middle = leftover.name[len(target.name) + 2 : -len(".tmp")]
    writer = middle.rpartition(".")[0]
    host, _, pid = writer.rpartition("-")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def sweep(path) -> None:
    """Clear what a killed write of `path` left beside it: this host's temporaries whose
    writer is gone, and the previous folder `.NAME.old` when NAME itself is missing (a
    kill between replace_folder's two renames), which is put back with a line on
    stderr. Nothing else is touched."""
    path = Path(path)
    if not path.name or not path.parent.is_dir():  # "" and "/" are no write's folder
        return
    for leftover in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        if not _dead_writer(leftover, path):
            continue
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)
    old = path.with_name(f".{path.name}.old")
    if old.is_dir() and not path.exists():
        os.replace(old, path)
        print(f"{path}: put back its previous contents, left as {old.name} by a write that "
              "was killed", file=sys.stderr)  # fmt: skip
    elif old.is_dir():
        shutil.rmtree(old, ignore_errors=True)


def _as_created(path: Path, mode: int) -> None:
    """Give a temporary file or folder the permissions `open`/`mkdir` would have given
    (tempfile makes them private to their owner)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(mode & ~umask)


def _bytes(content: str | bytes) -> bytes:
    return content.encode("utf-8") if isinstance(content, str) else content


def replace_folder(path, writer: Callable[[Path], object]) -> None:
    """`writer(temporary folder)` fills a new folder, which then replaces `path` whole:
    nothing of the old folder survives, and if writing fails the old one is intact. A
    link is followed: the folder it names is replaced, the link kept (renaming the link
    itself would leave it a folder and its target as it was)."""
    path = Path(path).resolve()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep(path)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=_prefix(path), suffix=".tmp"))
        _as_created(tmp, 0o777)
    except OSError as e:
        raise _fail(path, e) from None
    old = path.with_name(f".{path.name}.old")
    try:
        writer(tmp)
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)  # two renames: the new folder is complete before either
        os.replace(tmp, path)
    except BaseException as e:  # Ctrl-C between the renames too: the old folder back
        if old.exists() and not path.exists():
            os.replace(old, path)
        if isinstance(e, OSError):
            raise _fail(path, e) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def read_jsonl(path, valid: Callable[[object], bool] | None = None) -> list[dict]:
    """The records of a JSON-lines file ([] when it does not exist). A last line that is
    not JSON (torn by a kill or a full disk) is dropped with a warning on stderr. A
    damaged line before it is a FileReadError naming the line; with `valid` (what a
    record must satisfy), damaged lines, and records that are not `valid`, are dropped
    instead, with one warning on stderr naming the file and the lines."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    out, dropped = [], []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                print(f"warning: {path}: dropped a torn last line {line[:60]!r}", file=sys.stderr)
            elif valid is None:
                raise FileReadError(f"{path}: line {i + 1} is not JSON: {line[:60]!r}") from None
            else:
                dropped.append(i + 1)
            continue
        if valid is None or valid(record):
            out.append(record)
        else:
            dropped.append(i + 1)
    if dropped:
        many = f" and {len(dropped) - 5} more" if len(dropped) > 5 else ""
        print(f"warning: {path}: dropped damaged line(s) {', '.join(map(str, dropped[:5]))}"
              f"{many} (not a record of the expected form)", file=sys.stderr)  # fmt: skip
    return out


def rewrite_jsonl(path, records: list[dict]) -> None:
    """Replace a JSON-lines file by `records`, atomically."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


def read_json(path, what: str = "file") -> dict:
    """A JSON object from `path`; FileReadError naming the file when it is not one."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FileReadError(f"{what} {path} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise FileReadError(f"{what} {path} holds a {type(value).__name__}, not a JSON object")
    return value


def visible_files(folder) -> list[Path]:
    """The files under `folder`, sorted by path, without hidden files or anything in a
    hidden folder. Linked folders are followed (Path.rglob skips them: a corpus of
    linked sub-folders was read without them); a link back to a folder being walked
    is not, so that a loop ends."""

    def walk(d: Path, above: frozenset) -> list[Path]:
        real = d.resolve()
        if real in above:  # a link to a folder above: a loop
            return []
        out = []
        for e in d.iterdir():
            if e.name.startswith("."):
                continue
            if e.is_dir():
                out += walk(e, above | {real})
            elif e.is_file():
                out.append(e)
        return out

    return sorted(walk(Path(folder), frozenset()))


EDGE = 1 << 20  # bytes of each end of a large file that its fingerprint reads


def fingerprint(path) -> dict:
    """{"bytes": size, "sha256": hex} of a file, or of a folder's files (hidden ones
    skipped, as the data readers skip them). The SHA-256 of a file up to 2 MiB is that
    of its bytes; a larger file's is that of its first and last MiB (cheap for any
    size; with "bytes", a change that keeps the size and both ends is not seen). A
    folder's hashes each file's relative path, size and hash in turn (`visible_files`,
    as the data readers read them)."""
    path = Path(path)
    if path.is_file():
        return {"bytes": path.stat().st_size, "sha256": _ends_hash(path)}
    found = visible_files(path)
    h = hashlib.sha256()
    for f in found:
        h.update(f"{f.relative_to(path)}\0{f.stat().st_size}\0{_ends_hash(f)}\n".encode())
    return {"bytes": sum(f.stat().st_size for f in found), "sha256": h.hexdigest()}


def _ends_hash(path: Path) -> str:
    size, h = path.stat().st_size, hashlib.sha256()
    with open(path, "rb") as r:
        if size <= 2 * EDGE:
            h.update(r.read())
        else:
            h.update(r.read(EDGE))
            r.seek(size - EDGE)
            h.update(r.read(EDGE))
    return h.hexdigest()
