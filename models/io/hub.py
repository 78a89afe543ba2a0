"""Checkpoints in the Hugging Face layout: load the folders of the families in
models/families/ (GPT-2, Llama 1-3.x, Mistral, Qwen2, Qwen3, Phi-3, GPT-NeoX, OPT, Gemma 1-3,
Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, T5, BERT, RoBERTa, DistilBERT) into the zoo's
named parameters, run them under any layout, save them back.

    model = hub.load("path/to/gpt2")                    # config.json, *.safetensors
    logits = model.logits(ids)                          # Tensor (batch, length, vocab)
    model = hub.load(path, mesh=Mesh({"x": 8}), layout="heads:x;d_ff:x")
    hub.save(model, "out")                              # transformers loads it back

Each family's module has one table (`TABLES`): a zoo parameter path, the tensor
name (with `{i}` for the layer of a stacked parameter, `{e}` for the expert of a
parameter stacked from per-expert tensors), the file tensor's axes as
groups of the zoo's named dims (`"(heads d_kv) d_model"`: a torch Linear weight, out
before in, whose out axis is heads and d_kv merged), and for fused tensors (GPT-2's
c_attn, Phi-3's qkv_proj of unequal parts, GPT-NeoX's per-head `(heads * d_kv)`)
which part of an axis. Loading, placement and saving are the same code for
every family: with a mesh, each device's shard is read as a slice of the file
(safetensors' get_slice): of each file axis, the rows that cover the shard's span of
the axis' first dim, so a layout that splits layers, heads, kv_heads, d_ff, vocab or
d_model reads each shard's own bytes and no device holds more than its shard.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import jax
import numpy as np

import namedmesh as nm
from lowering import Layout, Mesh, lower
from lowering.layout import partition_spec
from models import transformer, zoo
from models.architecture import Config
from models.families import FAMILIES
from models.families.common import (
    STACKED,
    DamagedFileError,
    Entry,
    HubError,
    MissingFileError,
    Options,
    UnsupportedModelError,
    WeightDtypeError,
    WeightShapeError,
)
from models.io import folder_tokens
from models.io.files import FileReadError, FileWriteError, read_json, replace_folder, sweep
from namedmesh.errors import NamedMeshError

__all__ = ["Entry", "FAMILIES", "HubError", "MissingFileError", "UnsupportedModelError"]
__all__ += ["WeightShapeError", "load", "save", "config_of", "tensors", "HubModel"]
__all__ += ["DamagedFileError", "SaveError", "WeightDtypeError", "writer"]


class SaveError(HubError):
    """An export that could not be written; the folder holds what it held before."""


# Families (their configs and tables) live in models/families/, one module each; the
# errors, Entry and the registry are re-exported here for hub's callers.
TABLES = {k: f.table for k, f in FAMILIES.items()}
DECODERS = tuple(k for k, f in FAMILIES.items() if f.model == "lm")  # generate, fine-tune


def shapes_of(family: str, cfg: Config) -> dict:
    """The zoo's parameter shapes of a family's model under cfg."""
    return zoo.MODELS[FAMILIES[family].model].shapes(cfg)


# --- reading tensors ---------------------------------------------------------------
class Weights:
    """The tensors of a folder's model.safetensors, or of the shards that
    model.safetensors.index.json lists, opened lazily and read by slices."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self._open, self._files, self.index = safe_open, {}, None
        index = folder / "model.safetensors.index.json"
        # model.safetensors first, as transformers reads a folder holding both
        if index.exists() and not (folder / "model.safetensors").exists():
            self.index = index
            weight_map = read_json(index, "the index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise DamagedFileError(f"{index}: no weight_map object (tensor -> shard file)")
            self.where = {k: folder / str(v) for k, v in weight_map.items()}
            missing = sorted({str(p) for p in self.where.values() if not p.exists()})
            if missing:
                raise MissingFileError(f"{index} lists shard(s) that are missing: {missing}")
        elif (folder / "model.safetensors").exists():
            path = folder / "model.safetensors"
            with _opened(safe_open, path) as f:
                self.where = {k: path for k in f.keys()}
        else:
            raise MissingFileError(
                f"{folder}: no model.safetensors or model.safetensors.index.json "
                "(only safetensors weights are read; convert pytorch_model.bin first)"
            )

    def slice(self, name: str):
        """The tensor `name` as an object with get_shape() and [slices] -> NumPy."""
        if name not in self.where:
            raise MissingFileError(f"the weights have no tensor {name!r}")
        path = self.where[name]
        if path not in self._files:
            opened = _opened(self._open, path)
            self._files[path] = opened, set(opened.keys())
        opened, held = self._files[path]
        if name not in held:  # safetensors would raise its own error
            raise DamagedFileError(
                f"{self.index}: maps tensor {name!r} to {path.name}, which does not hold it"
            )
        found = opened.get_slice(name)
        return _BFloat16Slice(path, name) if found.get_dtype() == "BF16" else found


def _opened(safe_open, path: Path):
    """safe_open(path); DamagedFileError for a file safetensors refuses (truncated,
    a damaged header)."""
    try:
        return safe_open(path, "numpy")
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
        raise DamagedFileError(f"{path} is not a readable safetensors file: {e}") from None


class _BFloat16Slice:
    """A bfloat16 tensor of a safetensors file, which safetensors' NumPy reader refuses:
    memory-mapped at its offset in the file (the format is an 8-byte header length, a
    JSON header, then the data), so a slice reads only its own bytes."""

    def __init__(self, path: Path, name: str):
        import ml_dtypes

        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            entry = json.loads(f.read(n))[name]
        self.shape = tuple(entry["shape"])
        self.array = np.memmap(
            path, ml_dtypes.bfloat16, "r", 8 + n + entry["data_offsets"][0], self.shape
        )

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index) -> np.ndarray:
        return np.asarray(self.array[index])


def _groups(axes: str, head_dims: dict[str, str]) -> list[tuple[str, ...]]:
    """'(Q d_kv) d_model' -> [('heads', 'd_kv'), ('d_model',)], Q and KV substituted."""
    out = []
    for m in re.finditer(r"\(([^)]*)\)|(\S+)", axes):
        words = (m.group(2) if m.group(1) is None else m.group(1)).split()
        out.append(tuple(d for w in words for d in head_dims.get(w, w).split()))
    return out


@dataclass
class FileTensor:
    """A zoo parameter as found in the file: its entry, its axes as groups of dims,
    and the dims and sizes of the zoo parameter (with `layers`, then `experts`, first
    where the file holds one tensor per layer or expert: `stack`)."""

    entry: Entry
    groups: list[tuple[str, ...]]
    dims: tuple[str, ...]
    sizes: dict[str, int]

    @property
    def stack(self) -> tuple[str, ...]:
        """The leading dims whose index is in the file tensor's name, one file tensor
        per index: `layers` ({i}) of a stacked parameter, and `experts` ({e}) of a row
        that stacks per-expert tensors (Mixtral's experts.{e}.w1.weight)."""
        stack = []
        for d in self.dims:  # leading dims only (`tensors` checks the table's names)
            if d not in STACKED or STACKED[d] not in self.entry.name:
                break
            stack.append(d)
        return tuple(stack)

    def name(self, index: tuple[int, ...]) -> str:
        """The file tensor's name at `index` (one int per dim of `stack`)."""
        keys = {STACKED[d][1:-1]: i for d, i in zip(self.stack, index, strict=True)}
        keys["i"] = keys.get("i", 0) + self.entry.first
        return self.entry.name.format(**keys)

    def names(self) -> list[str]:
        """Every file tensor this parameter is read from, in `stack` order."""
        return [self.name(ix) for ix in np.ndindex(*(self.sizes[d] for d in self.stack))]

    def size(self, dim: str) -> int:
        """A dim's size; `*` is the fused parts' (Entry.part's count)."""
        return self.entry.part[2] if dim == "*" else self.sizes[dim]

    def _offset(self, axis: int) -> int:
        """Where this part starts along `axis` of the file tensor: 0 when the axis is
        not fused or its parts sit inside its group (`*`)."""
        part, group = self.entry.part, self.groups[axis]
        if not part or part[0] != axis or "*" in group:
            return 0
        _, index, count = part
        if isinstance(count, tuple):
            return sum(count[:index])
        return index * math.prod(self.sizes[d] for d in group)

    def file_shape(self) -> tuple[int, ...]:
        shape = [math.prod(self.size(d) for d in g) for g in self.groups]
        if self.entry.part and "*" not in self.groups[self.entry.part[0]]:
            axis, _, count = self.entry.part
            shape[axis] = sum(count) if isinstance(count, tuple) else shape[axis] * count
        return tuple(shape)

    def read(self, weights: Weights, index: tuple) -> np.ndarray:
        """The block `index` (slices over self.dims) of the zoo parameter, read slice
        by slice from the file."""
        spans = [s.indices(self.sizes[d])[:2] for s, d in zip(index, self.dims, strict=True)]
        n = len(self.stack)
        ranges = [range(*span) for span in spans[:n]]
        blocks = [self._read_one(weights, self.name(ix), spans[n:]) for ix in product(*ranges)]
        if not n:
            return blocks[0]
        return np.stack(blocks).reshape(*(len(r) for r in ranges), *blocks[0].shape)

    def _read_one(self, weights: Weights, name: str, spans) -> np.ndarray:
        layer_dims = self.dims[len(self.stack) :]
        span = dict(zip(layer_dims, spans, strict=True))
        if self.entry.part:  # a part inside its group (`*`) is a span of one
            span["*"] = (self.entry.part[1], self.entry.part[1] + 1)
        src, inner = [], []
        for axis, group in enumerate(self.groups):
            if not group:  # "()": an axis of size 1 the zoo does not keep (a gate's Linear)
                src.append(slice(None))
                inner.append([(1, 0)])
                continue
            # Read the rows covering the first dim's span, whole in the group's other dims.
            lo, hi = span[group[0]]
            step = math.prod(self.size(d) for d in group[1:])
            offset = self._offset(axis)
            src.append(slice(offset + lo * step, offset + hi * step))
            inner.append(
                [(hi - lo, slice(None))] + [(self.size(d), slice(*span[d])) for d in group[1:]]
            )
        block = np.asarray(weights.slice(name)[tuple(src)])
        if block.dtype.kind == "f" or block.dtype.name == "bfloat16":
            block = block.astype(np.float32)  # the zoo computes from float32 parameters
        block = block.reshape([n for axis in inner for n, _ in axis])
        block = block[tuple(s for axis in inner for _, s in axis)]
        flat = [d for g in self.groups for d in g]
        if "*" in flat:  # the part's span of one
            block = block.squeeze(flat.index("*"))
            flat.remove("*")
        return block.transpose([flat.index(d) for d in layer_dims])

    def write(self, value: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """Put the value of the zoo parameter (dims self.dims) into the file tensors
        `out`: one per index of its `stack` dims."""
        n = len(self.stack)
        for ix in np.ndindex(*value.shape[:n]):
            self._write_one(value[ix], out, self.name(ix))

    def _write_one(self, value: np.ndarray, out: dict[str, np.ndarray], name: str) -> None:
        layer_dims = self.dims[len(self.stack) :]
        flat = [d for g in self.groups for d in g]
        block = value.transpose([layer_dims.index(d) for d in flat if d != "*"])
        if not self.entry.part:
            out[name] = block.reshape(self.file_shape())
            return
        axis, i, _ = self.entry.part
        whole = out.setdefault(name, np.zeros(self.file_shape(), block.dtype))
        if "*" in flat:  # this part's place inside the group: index i of `*`
            index = [slice(None)] * len(flat)
            index[flat.index("*")] = i
            whole.reshape([self.size(d) for d in flat])[tuple(index)] = block
            return
        block = block.reshape([math.prod(self.sizes[d] for d in g) for g in self.groups])
        start = self._offset(axis)
        index = [slice(None)] * block.ndim
        index[axis] = slice(start, start + block.shape[axis])
        whole[tuple(index)] = block


def _leaves(shapes, prefix=""):
    if isinstance(shapes, transformer.Param):
        yield prefix, shapes
        return
    for k, v in shapes.items():
        yield from _leaves(v, f"{prefix}/{k}" if prefix else k)


def _head_dims(cfg: Config) -> dict[str, str]:
    if cfg.kv_heads:
        return {"Q": "kv_heads q_per_kv", "KV": "kv_heads"}
    return {"Q": "heads", "KV": "heads"}


def tensors(family: str, cfg: Config, prefix: str = "") -> dict[str, FileTensor]:
    """Every zoo parameter of the family's model under `cfg`, by path, with the row of
    the family's table that says where it is in the files."""
    fam = FAMILIES[family]
    rows = {e.path: e for e in fam.table(cfg, prefix)}
    out = {}
    for path, p in _leaves(shapes_of(family, cfg)):
        if path not in rows:
            raise UnsupportedModelError(
                f"the {family} table has no row for the zoo parameter {path!r} (an option the "
                "family does not have)"
            )
        groups = _groups(rows[path].axes, _head_dims(cfg))
        t = FileTensor(rows[path], groups, tuple(p.sizes), p.sizes)
        if unplaced := [k for d, k in STACKED.items() if k in t.entry.name and d not in t.stack]:
            raise UnsupportedModelError(
                f"the {family} table's row {t.entry.name!r} indexes {unplaced} but the zoo "
                f"parameter {path!r} (dims {t.dims}) does not lead with their dims"
            )
        out[path] = t
    return out


def _set(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split("/")
    for k in parents:
        tree = tree.setdefault(k, {})
    tree[leaf] = value


def _get(tree: dict, path: str):
    for k in path.split("/"):
        tree = tree[k]
    return tree


# --- the model ---------------------------------------------------------------------
@dataclass
class HubModel:
    """A loaded checkpoint: `config` (the zoo's Config), `params` (nested dict of named
    Tensors), `tokenizer` (a tokenizers.Tokenizer or None), the `family` and the folder's
    config.json (`hf_config`), and the mesh and layout it was placed with."""

    family: str
    config: Config
    params: dict
    tokenizer: object
    hf_config: dict
    mesh: Mesh | None = None
    layout: Layout | None = None

    def logits(self, input_ids, attention_mask=None, token_type_ids=None, decoder_input_ids=None):
        """Logits (batch, length, vocab): next-token logits of a decoder (GPT-2, Llama),
        masked-LM logits of BERT, or for T5 the decoder's logits over decoder_input_ids
        given the encoder's input_ids. Inputs are int arrays (batch, length) or Tensors;
        attention_mask (1 real, 0 padding) masks the keys of input_ids."""
        ids = _ints(input_ids)
        batch = {"inputs": ids}
        if attention_mask is not None:
            batch["weights"] = nm.tensor(np.asarray(_data(attention_mask), np.float32), ids.dims)
        if token_type_ids is not None:
            batch["token_types"] = _ints(token_type_ids)
        if decoder_input_ids is not None:
            batch["decoder_inputs"] = _ints(decoder_input_ids)
        needs = zoo.MODELS[FAMILIES[self.family].model].needs
        if missing := [f for f in needs if f not in batch]:
            raise HubError(f"{self.family}'s logits need {missing} (decoder_input_ids)")
        return _program(self.config, self.family, self.mesh, self.layout)(self.params, batch)


_PROGRAMS: dict = {}


def _program(cfg: Config, family: str, mesh: Mesh | None, layout: Layout | None):
    """`forward` jitted (or lowered on mesh under layout), one per model shape: models
    of the same config share their compiled programs."""
    key = (cfg, family, id(mesh), str(layout))
    if key not in _PROGRAMS:
        fn = lambda p, b: forward(p, b, cfg, family)
        _PROGRAMS[key] = (mesh, jax.jit(fn) if mesh is None else lower(fn, mesh, layout))
    return _PROGRAMS[key][1]


def forward(params: dict, batch: dict, cfg: Config, family: str) -> nm.Tensor:
    """The logits of a family's model for a batch of Tensors: inputs, and optionally
    weights (padding mask), token_types, decoder_inputs (encoder-decoders)."""
    return zoo.MODELS[FAMILIES[family].model].logits(params, batch, cfg)


def _data(x):
    return x.data if isinstance(x, nm.Tensor) else x


def _ints(x) -> nm.Tensor:
    if isinstance(x, nm.Tensor):
        return x
    return nm.tensor(np.asarray(x, np.int32), ("batch", "length"))


def read_config(folder: Path) -> tuple[str, dict]:
    """(family, config.json as a dict); typed errors for a missing file or family."""
    path = folder / "config.json"
    if not path.exists():
        sweep(folder)  # a write of the folder killed between its renames: put it back
    if not path.exists():
        raise MissingFileError(f"{folder}: no config.json (is it a Hugging Face model folder?)")
    try:
        hf = read_json(path, "config.json")
    except FileReadError as e:
        raise DamagedFileError(str(e)) from None
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise UnsupportedModelError(
            f"{path}: model_type {family!r} is not supported; supported: {', '.join(FAMILIES)}"
        )
    return family, hf


def _prefix(family: str, weights: Weights) -> str:
    fam = FAMILIES[family]
    for p in fam.prefixes:
        if p + fam.probe in weights.where:
            return p
    raise MissingFileError(
        f"the weights hold no {' or '.join(p + fam.probe for p in fam.prefixes)}: not a "
        f"{family} checkpoint of a supported head "
        f"({', '.join(sorted({f.heads for f in FAMILIES.values()}))})"
    )


def load(path, mesh: Mesh | None = None, layout: Layout | str | None = None) -> HubModel:
    """The model in a Hugging Face folder (config.json, model.safetensors or a sharded
    model.safetensors.index.json, a tokenizer when present: models/io/folder_tokens.py).
    With a `mesh`, each parameter is laid out by `layout` (rules on the zoo's dims) and
    every device's shard is read from the file as a slice, so the model need not fit one
    device; without, parameters are whole on the default device. Raises MissingFileError,
    UnsupportedModelError, WeightShapeError (all HubError)."""
    folder = Path(path)
    family, hf = read_config(folder)
    weights = Weights(folder)
    source = Source(folder, family, hf, weights, _prefix(family, weights))
    cfg = family_config(family, hf, set(weights.where), folder)
    return load_params(source, cfg, mesh, layout)


def family_config(family: str, hf: dict, names: set[str], folder="") -> Config:
    """The family's Config of config.json `hf`; UnsupportedModelError naming every key
    (and its value) the family did not read: an option the zoo would ignore;
    DamagedFileError for a key missing or a value of the wrong type."""
    options = Options(hf, FAMILIES[family].defaults)
    try:
        cfg = FAMILIES[family].config(options, names)
    except KeyError as e:
        raise DamagedFileError(f"{folder}/config.json lacks the key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, HubError | NamedMeshError):
            raise
        raise DamagedFileError(f"{folder}/config.json: a value of the wrong type ({e})") from None
    if unread := options.unread():
        raise UnsupportedModelError(
            f"config.json of a {family} model: option(s) {unread} are not implemented by "
            f"models/families/{family}.py"
        )
    return cfg.replace(family=family)


def _check_all_read(family: str, files: dict, source: Source, cfg: Config) -> None:
    """UnsupportedModelError naming the weights' tensors the family does not read (a
    relabelled folder: Qwen2's q/k/v biases under model_type llama), besides the
    buffers its `ignored` patterns name and those its `unused(cfg)` name (a
    WeightShapeError for one of those that should be empty and is not)."""
    weights = source.weights
    read = {name for t in files.values() for name in t.names()} | _tied_head(files, source, cfg)
    ignored = [re.compile(p) for p in FAMILIES[family].ignored]
    unused = [(re.compile(p), empty) for p, empty in FAMILIES[family].unused(cfg)]
    unread = []
    for k in sorted(set(weights.where) - read):
        if any(p.match(k) for p in ignored):
            continue
        hit = [empty for p, empty in unused if p.match(k)]
        if not hit:
            unread.append(k)
        elif hit[0] and math.prod(shape := weights.slice(k).get_shape()):
            raise WeightShapeError(
                f"tensor {k!r} has shape {tuple(shape)} in the weights, but config.json "
                "implies it is empty (a width of 0)"
            )
    if unread:
        shown = ", ".join(unread[:8]) + (f" and {len(unread) - 8} more" if len(unread) > 8 else "")
        raise UnsupportedModelError(
            f"the weights hold tensor(s) a {family} model does not read: {shown} (a different "
            "family, or an option its config.json does not declare)"
        )


def _tied_head(files: dict, source: Source, cfg: Config) -> set[str]:
    """The name of the untied softmax (lm_head.weight) that weights of a model whose
    config.json ties it to the embedding hold anyway, when it equals the embedding, as
    some savers write it: read as the tied model transformers makes of it. One of other
    values is an UnsupportedModelError naming it (transformers would untie the two
    against config.json's word: which model is meant is not for us to guess)."""
    embed, weights = files.get("embed"), source.weights
    if not cfg.shared_embedding or embed is None:
        return set()
    whole = lambda t: t.read(weights, tuple(slice(None) for _ in t.dims))
    try:
        untied = tensors(source.family, cfg.replace(shared_embedding=False), source.prefix)
    except (HubError, NamedMeshError):  # a family that has no untied head (GPT-2): the
        # lm_head.weight its savers write is [vocab, d_model], the embedding's own layout
        name = "lm_head.weight"
        if name not in weights.where or weights.slice(name).get_shape() != list(
            weights.slice(embed.entry.name).get_shape()
        ):
            return set()
        a, b = weights.slice(name)[...], weights.slice(embed.entry.name)[...]
        fix = f"a {source.family} model has no softmax of its own to read it as"
    else:
        extra = [t for p, t in untied.items() if p not in files]
        if len(extra) != 1 or set(extra[0].dims) != set(embed.dims):
            return set()
        head, name = extra[0], extra[0].entry.name
        if name not in weights.where or tuple(weights.slice(name).get_shape()) != head.file_shape():
            return set()
        a = whole(head).transpose([head.dims.index(d) for d in embed.dims])
        b = whole(embed)
        fix = "set tie_word_embeddings to false in config.json to read it as its own softmax"
    if not np.array_equal(a, b):
        raise UnsupportedModelError(
            f"config.json ties the softmax to the embedding (tie_word_embeddings), but the "
            f"weights hold {name!r} of other values than {embed.entry.name!r}: {fix}"
        )
    return {name}


def config_of(path) -> tuple[str, Config]:
    """(family, the zoo's Config) of a Hugging Face folder, reading no weights (or of a
    run's copy of its base, `copy_base`, whose tensors.json names the weights)."""
    folder = Path(path)
    family, hf = read_config(folder)
    if (folder / "tensors.json").exists():
        names = set(json.loads((folder / "tensors.json").read_text()))
    else:
        names = set(Weights(folder).where)
    return family, family_config(family, hf, names, folder)


BASE = "base"  # a fine-tune's copy of its base folder, in the run's folder
# what a run keeps of its base: everything but the weights
BASE_FILES = folder_tokens.READS  # config.json among them


def copy_base(path, dest) -> str:
    """Copy a Hugging Face folder's config, tokenizer and special-token files (not its
    weights) to `dest`, with tensors.json naming its weights' tensors, so a fine-tune
    no longer needs its base folder (a run's copy of one is copied as it is); returns
    the family. The copy is made in a fresh folder put in place whole
    (models/io/files.py), never half."""
    import shutil

    folder = Path(path)
    family, _ = read_config(folder)

    def write(new: Path) -> None:
        for name in BASE_FILES:
            if (folder / name).exists():
                shutil.copyfile(folder / name, new / name)
        if (folder / "tensors.json").exists():  # a run's copy: no weights, their names
            shutil.copyfile(folder / "tensors.json", new / "tensors.json")
        else:
            (new / "tensors.json").write_text(json.dumps(sorted(Weights(folder).where)))

    try:
        replace_folder(dest, write)
    except FileWriteError as e:
        raise SaveError(str(e)) from None
    return family


@dataclass(frozen=True)
class Source:
    """A Hugging Face folder as `load` reads it: its path, family (config.json's
    model_type), config.json, weights and the prefix of its head's weight names."""

    folder: Path
    family: str
    hf: dict
    weights: Weights
    prefix: str


def load_params(source: Source, cfg: Config, mesh: Mesh | None, layout) -> HubModel:
    """`load` once the family and Config are known: cfg may differ from the folder's
    in what does not change a parameter's shape (length, batch, dropout)."""
    family, weights = source.family, source.weights
    if mesh is not None:
        layout = layout if isinstance(layout, Layout) else Layout(layout or "")
    params = {}
    files = tensors(family, cfg, source.prefix)
    _check_all_read(family, files, source, cfg)
    for p, t in files.items():
        _check_shape(t, weights, p)
        _set(params, p, nm.tensor(_place(t, weights, mesh, layout, p), t.dims))
    tokens = folder_tokens.read(source.folder, family)
    return HubModel(family, cfg, params, tokens, source.hf, mesh, layout)


# safetensors' dtypes a weight is read from (NumPy's float dtypes, and bfloat16)
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def _check_shape(t: FileTensor, weights: Weights, path: str) -> None:
    """WeightShapeError or WeightDtypeError for a file tensor of the parameter that is
    not of the shape config.json implies or not floating point (an int or bool tensor
    would be read as weights, silently)."""
    want = t.file_shape()
    for name in t.names():
        found = weights.slice(name)
        got = tuple(found.get_shape())
        if got != want:
            raise WeightShapeError(
                f"tensor {name!r} has shape {got} in the weights, but config.json implies "
                f"{want} (zoo parameter {path!r}, dims {t.dims})"
            )
        dtype = "BF16" if isinstance(found, _BFloat16Slice) else found.get_dtype()
        if dtype not in FLOAT_DTYPES:
            raise WeightDtypeError(
                f"tensor {name!r} of {weights.where[name].name} is {dtype}, not a floating-point "
                f"weight ({', '.join(FLOAT_DTYPES)}; zoo parameter {path!r})"
            )


def _place(t: FileTensor, weights: Weights, mesh, layout, path: str) -> jax.Array:
    shape = tuple(t.sizes[d] for d in t.dims)
    if mesh is None:
        return jax.numpy.asarray(t.read(weights, tuple(slice(None) for _ in shape)))
    lay = layout.of(t.dims, shape, mesh, f"parameter {path!r}", transformer.STACK_DIMS)
    sharding = jax.sharding.NamedSharding(mesh.jax_mesh, partition_spec(lay))
    return jax.make_array_from_callback(shape, sharding, lambda index: t.read(weights, index))


def tokenizer_of(path):
    """The folder's tokenizer (models/io/folder_tokens.py: tokenizer.json, vocab.json +
    merges.txt or tokenizer.model) as a tokenizers.Tokenizer, or None."""
    return folder_tokens.read(path, read_config(Path(path))[0])


def save(model: HubModel, path, dtype: str = "float32", max_shard_size=None) -> None:
    """Write `model` as a Hugging Face folder: config.json (the loaded one), the
    parameters under the family's names in `dtype` (float32, bfloat16, float16), in
    model.safetensors or, above `max_shard_size` ("5GB", "200MB", bytes; None:
    shards.DEFAULT_MAX_SHARD), in shards listed by model.safetensors.index.json, as
    save_pretrained writes them; and tokenizer.json when the model has a tokenizer.
    transformers' from_pretrained loads it back. The folder is written whole beside
    `path` and then replaces it, so nothing of an export that was there survives (no
    stale shard or index) and a failed write (full disk, read-only folder) leaves it
    intact: SaveError."""
    try:
        # the folder a link names is replaced, not the link
        replace_folder(Path(path).resolve(), writer(model, dtype, max_shard_size))
    except FileWriteError as e:
        raise SaveError(str(e)) from None


def writer(model: HubModel, dtype: str = "float32", max_shard_size=None):
    """The function that writes `model`'s files (what `save` writes) into a folder it
    is given: for a caller that adds files of its own before the folder is put in
    place (models/cli/export.py). ValueError for a dtype or size `save` does not take."""
    from safetensors.numpy import save_file

    from models.io import shards

    limit = shards.parse_size(max_shard_size or shards.DEFAULT_MAX_SHARD)
    prefix = FAMILIES[model.family].prefixes[0]
    out: dict[str, np.ndarray] = {}
    for p, t in tensors(model.family, model.config, prefix).items():
        t.write(np.asarray(jax.device_get(_get(model.params, p).transpose(*t.dims).data)), out)
    out = shards.cast(out, dtype)
    parts = shards.plan(out, limit)
    config = {k: v for k, v in model.hf_config.items() if k != "torch_dtype"} | {"dtype": dtype}

    def write(folder: Path) -> None:
        for name, part in zip(shards.file_names(len(parts)), parts, strict=True):
            try:
                save_file({k: out[k] for k in part}, folder / name, {"format": "pt"})
            except Exception as e:  # safetensors' own SafetensorError wraps the OS's
                raise e if isinstance(e, OSError) else OSError(str(e)) from None
        if len(parts) > 1:
            (folder / shards.INDEX).write_text(json.dumps(shards.index(out, parts), indent=2))
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        if model.tokenizer is not None:
            model.tokenizer.save(str(folder / "tokenizer.json"))

    return write
