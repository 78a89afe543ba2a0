"""Weights written as transformers' `save_pretrained` writes them: in a dtype of choice,
and above a size in shards (model-00001-of-00003.safetensors ...) listed by
model.safetensors.index.json, which transformers (and models.io.hub.load) read."""

from __future__ import annotations

import re

import numpy as np

from namedmesh.errors import NamedMeshError

DTYPES = ("float32", "bfloat16", "float16")
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD = "5GB"  # transformers' save_pretrained's default (before v5)
# transformers' units: KB, MB, GB are powers of 10, KiB, MiB, GiB powers of 2
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(text: str | int) -> int:
    """ "5GB" -> 5_000_000_000, "200MiB" -> 200 * 2**20, 1000 -> 1000 bytes; ValueError
    (naming --max-shard-size) for anything else or a size below 1 byte."""
    if isinstance(text, int):
        size = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
        unit = m and m.group(2).upper()
        if not m or unit not in _UNITS:
            raise ValueError(
                f"--max-shard-size {text!r}: expected a size such as 5GB, 200MB, 1GiB or bytes"
            )
        size = int(float(m.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"--max-shard-size {text!r}: must be at least 1 byte")
    return size


class DtypeRangeError(NamedMeshError, ValueError):
    """A weight that the export's --dtype cannot hold: float16 tops out at 65504, and a
    larger value would be written as infinity."""


def cast(arrays: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Floating arrays in `dtype` (bfloat16 as ml_dtypes', which safetensors writes);
    integer ones as they are. DtypeRangeError naming the first tensor whose finite
    values the cast would turn into infinities."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: must be one of {', '.join(DTYPES)}")
    import ml_dtypes

    to = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    floating = lambda a: np.issubdtype(a.dtype, np.floating) or a.dtype == ml_dtypes.bfloat16
    out = {}
    for k, a in arrays.items():
        with np.errstate(over="ignore"):  # said below, by name
            out[k] = np.ascontiguousarray(a.astype(to) if floating(a) else a)
        if floating(a) and (np.isinf(out[k]) & np.isfinite(a)).any():
            big = float(np.abs(a[np.isfinite(a)]).max())
            raise DtypeRangeError(
                f"--dtype {dtype}: tensor {k!r} holds {big:.6g}, beyond what {dtype} holds "
                f"(it would be written as infinity); export it as bfloat16 or float32"
            )
    return out


def plan(arrays: dict[str, np.ndarray], max_bytes: int) -> list[list[str]]:
    """The names of each shard, in order: tensors added to a shard while it stays within
    `max_bytes`; a tensor larger than that alone in a shard of its own (as transformers)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, a in arrays.items():
        if shards[-1] and size + a.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += a.nbytes
    return shards


def file_names(count: int) -> list[str]:
    """model.safetensors for one shard, else model-0000i-of-0000n.safetensors."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def index(arrays: dict[str, np.ndarray], shards: list[list[str]]) -> dict:
    """model.safetensors.index.json's content: the total size and each tensor's file."""
    names = file_names(len(shards))
    where = {t: f for f, shard in zip(names, shards, strict=True) for t in shard}
    total = sum(a.nbytes for a in arrays.values())
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(where.items()))}
