"""Checkpoints in the Hugging Face layout: load GPT-2, Llama, T5 (v1.0, v1.1) and BERT
folders into the zoo's named parameters, run them under any layout, save them back.

    model = hub.load("path/to/gpt2")                    # config.json, *.safetensors
    logits = model.logits(ids)                          # Tensor (batch, length, vocab)
    model = hub.load(path, mesh=Mesh({"x": 8}), layout="heads:x;d_ff:x")
    hub.save(model, "out")                              # transformers loads it back

Each family is one table (`TABLES`): a zoo parameter path, the Hugging Face tensor
name (with `{i}` for the layer of a stacked parameter), the file tensor's axes as
groups of the zoo's named dims (`"(heads d_kv) d_model"`: a torch Linear weight, out
before in, whose out axis is heads and d_kv merged), and for fused tensors (GPT-2's
c_attn) which part of an axis. Loading, placement and saving are the same code for
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
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

import namedmesh as nm
from lowering import Layout, Mesh, lower
from lowering.layout import partition_spec
from models import files, transformer
from models.checkpoint import CheckpointError
from models.config import Config
from namedmesh.errors import NamedMeshError


class HubError(CheckpointError):
    """A Hugging Face folder that cannot be loaded or a model that cannot be saved."""


class UnsupportedModelError(HubError):
    """A model family (config.json's model_type) or option the zoo does not implement."""


class MissingFileError(HubError):
    """A file (config.json, the weights) or a tensor the family needs is not there."""


class WeightShapeError(HubError):
    """A tensor of the weights whose shape is not the one config.json implies."""


class SaveError(HubError):
    """An export that could not be written; the folder holds what it held before."""


class DamagedFileError(HubError):
    """A config.json, index or safetensors file that is not what it should be: not
    JSON, truncated, a key missing or of the wrong type."""


class Entry(NamedTuple):
    """One row of a family's table: the zoo path, the file's tensor name (`{i}`: the
    layer), its axes as groups of zoo dims, and (axis, index, count) when the tensor
    fuses `count` zoo parameters along `axis` (this one is part `index`)."""

    path: str
    name: str
    axes: str
    part: tuple[int, int, int] | None = None


# Shorthands in the tables' axes: Q are the query head dims, KV the key/value head dims.
def _linear(path: str, name: str, out: str, inp: str, bias: bool) -> list[Entry]:
    """A torch Linear: weight (out, in), bias (out)."""
    rows = [Entry(path, f"{name}.weight", f"({out}) ({inp})")]
    return rows + ([Entry(f"{path}_bias", f"{name}.bias", f"({out})")] if bias else [])


def _norm(path: str, name: str, layer: bool, weight: str = "weight") -> list[Entry]:
    rows = [Entry(f"{path}/scale", f"{name}.{weight}", "d_model")]
    return rows + ([Entry(f"{path}/bias", f"{name}.bias", "d_model")] if layer else [])


def gpt2_table(cfg: Config, prefix: str) -> list[Entry]:
    h = f"{prefix}h.{{i}}."
    rows = [
        Entry("embed", f"{prefix}wte.weight", "vocab d_model"),
        Entry("pos", f"{prefix}wpe.weight", "length d_model"),
        *_norm("final_norm", f"{prefix}ln_f", True),
        *_norm("layers/attn_norm", f"{h}ln_1", True),
        *_norm("layers/ffn_norm", f"{h}ln_2", True),
        # Conv1D weights are (in, out); c_attn fuses q, k and v along out.
        Entry("layers/attn/o", f"{h}attn.c_proj.weight", "(Q d_kv) d_model"),
        Entry("layers/attn/o_bias", f"{h}attn.c_proj.bias", "d_model"),
        Entry("layers/ffn/wi", f"{h}mlp.c_fc.weight", "d_model d_ff"),
        Entry("layers/ffn/wi_bias", f"{h}mlp.c_fc.bias", "d_ff"),
        Entry("layers/ffn/wo", f"{h}mlp.c_proj.weight", "d_ff d_model"),
        Entry("layers/ffn/wo_bias", f"{h}mlp.c_proj.bias", "d_model"),
    ]
    for i, x in enumerate("qkv"):
        rows.append(
            Entry(f"layers/attn/{x}", f"{h}attn.c_attn.weight", "d_model (Q d_kv)", (1, i, 3))
        )
        rows.append(Entry(f"layers/attn/{x}_bias", f"{h}attn.c_attn.bias", "(Q d_kv)", (0, i, 3)))
    return rows


def llama_table(cfg: Config, prefix: str) -> list[Entry]:
    layer, b = f"{prefix}layers.{{i}}.", cfg.bias
    rows = [
        Entry("embed", f"{prefix}embed_tokens.weight", "vocab d_model"),
        *_norm("final_norm", f"{prefix}norm", False),
        *_norm("layers/attn_norm", f"{layer}input_layernorm", False),
        *_norm("layers/ffn_norm", f"{layer}post_attention_layernorm", False),
        *_linear("layers/attn/q", f"{layer}self_attn.q_proj", "Q d_kv", "d_model", b),
        *_linear("layers/attn/k", f"{layer}self_attn.k_proj", "KV d_kv", "d_model", b),
        *_linear("layers/attn/v", f"{layer}self_attn.v_proj", "KV d_kv", "d_model", b),
        *_linear("layers/attn/o", f"{layer}self_attn.o_proj", "d_model", "Q d_kv", b),
        *_linear("layers/ffn/wi", f"{layer}mlp.gate_proj", "d_ff", "d_model", b),
        *_linear("layers/ffn/wg", f"{layer}mlp.up_proj", "d_ff", "d_model", b),
        *_linear("layers/ffn/wo", f"{layer}mlp.down_proj", "d_model", "d_ff", b),
    ]
    return rows + (
        [] if cfg.shared_embedding else [Entry("softmax", "lm_head.weight", "vocab d_model")]
    )


def _t5_stack(cfg: Config, stack: str, path: str, cross: bool) -> list[Entry]:
    blk = f"{stack}.block.{{i}}.layer."
    ff = f"{blk}{2 if cross else 1}."
    rows = [
        *_norm(f"{path}/attn_norm", f"{blk}0.layer_norm", False),
        *(
            Entry(f"{path}/attn/{x}", f"{blk}0.SelfAttention.{x}.weight", f"({a} d_kv) d_model")
            for x, a in (("q", "Q"), ("k", "KV"), ("v", "KV"))
        ),
        Entry(f"{path}/attn/o", f"{blk}0.SelfAttention.o.weight", "d_model (Q d_kv)"),
        *_norm(f"{path}/ffn_norm", f"{ff}layer_norm", False),
        Entry(f"{path}/ffn/wo", f"{ff}DenseReluDense.wo.weight", "d_model d_ff"),
    ]
    if cfg.ffn.startswith("gated_"):
        rows.append(Entry(f"{path}/ffn/wi", f"{ff}DenseReluDense.wi_0.weight", "d_ff d_model"))
        rows.append(Entry(f"{path}/ffn/wg", f"{ff}DenseReluDense.wi_1.weight", "d_ff d_model"))
    else:
        rows.append(Entry(f"{path}/ffn/wi", f"{ff}DenseReluDense.wi.weight", "d_ff d_model"))
    if cross:
        rows += _norm(f"{path}/cross_norm", f"{blk}1.layer_norm", False)
        rows += [
            Entry(f"{path}/cross/{x}", f"{blk}1.EncDecAttention.{x}.weight", "(Q d_kv) d_model")
            for x in "qkv"
        ]
        rows.append(
            Entry(f"{path}/cross/o", f"{blk}1.EncDecAttention.o.weight", "d_model (Q d_kv)")
        )
    return rows


def t5_table(cfg: Config, prefix: str) -> list[Entry]:
    rel = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    rows = [
        Entry("embed", "shared.weight", "vocab d_model"),
        Entry("encoder_relative", f"encoder.{rel}", "buckets heads"),
        Entry("relative", f"decoder.{rel}", "buckets heads"),
        *_norm("encoder_norm", "encoder.final_layer_norm", False),
        *_norm("final_norm", "decoder.final_layer_norm", False),
        *_t5_stack(cfg, "encoder", "encoder", cross=False),
        *_t5_stack(cfg, "decoder", "layers", cross=True),
    ]
    return rows + (
        [] if cfg.shared_embedding else [Entry("softmax", "lm_head.weight", "vocab d_model")]
    )


def bert_table(cfg: Config, prefix: str) -> list[Entry]:
    e, layer = f"{prefix}embeddings.", f"{prefix}encoder.layer.{{i}}."
    return [
        Entry("embed", f"{e}word_embeddings.weight", "vocab d_model"),
        Entry("pos", f"{e}position_embeddings.weight", "length d_model"),
        Entry("type_embed", f"{e}token_type_embeddings.weight", "token_types d_model"),
        *_norm("embed_norm", f"{e}LayerNorm", True),
        *_linear("layers/attn/q", f"{layer}attention.self.query", "Q d_kv", "d_model", True),
        *_linear("layers/attn/k", f"{layer}attention.self.key", "KV d_kv", "d_model", True),
        *_linear("layers/attn/v", f"{layer}attention.self.value", "KV d_kv", "d_model", True),
        *_linear("layers/attn/o", f"{layer}attention.output.dense", "d_model", "Q d_kv", True),
        *_norm("layers/attn_norm", f"{layer}attention.output.LayerNorm", True),
        *_linear("layers/ffn/wi", f"{layer}intermediate.dense", "d_ff", "d_model", True),
        *_linear("layers/ffn/wo", f"{layer}output.dense", "d_model", "d_ff", True),
        *_norm("layers/ffn_norm", f"{layer}output.LayerNorm", True),
        *_linear("mlm/dense", "cls.predictions.transform.dense", "d_model_out", "d_model", False),
        Entry("mlm/dense_bias", "cls.predictions.transform.dense.bias", "d_model"),
        *_norm("mlm/norm", "cls.predictions.transform.LayerNorm", True),
        Entry("mlm/vocab_bias", "cls.predictions.bias", "vocab"),
    ]


# --- config.json -> Config --------------------------------------------------------
_ACT = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact", "relu": "relu"}
_ACT |= {"silu": "silu", "swish": "silu"}


def _act(hf: dict, key: str) -> str:
    name = hf.get(key, "gelu")
    if name not in _ACT:
        raise UnsupportedModelError(f"config.json: {key}={name!r} is not one of {sorted(_ACT)}")
    return _ACT[name]


def _require(hf: dict, key: str, allowed, default=None) -> None:
    if hf.get(key, default) not in allowed:
        raise UnsupportedModelError(
            f"config.json: {key}={hf.get(key)!r} is not supported (supported: {allowed})"
        )


def gpt2_config(hf: dict, names: set[str]) -> Config:
    _require(hf, "scale_attn_by_inverse_layer_idx", (False,), False)
    d, h = hf["n_embd"], hf["n_head"]
    return Config(
        vocab=hf["vocab_size"], d_model=d, heads=h, d_kv=d // h, d_ff=hf.get("n_inner") or 4 * d,
        layers=hf["n_layer"], length=hf["n_positions"], max_positions=hf["n_positions"],
        ffn=_act(hf, "activation_function"), norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        bias=True, scale_tied_logits=False,
        attention_scale=hf.get("scale_attn_weights", True),
    )  # fmt: skip


def llama_config(hf: dict, names: set[str]) -> Config:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise UnsupportedModelError(f"config.json: rope scaling {rope} (only 'default' rope)")
    if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
        raise UnsupportedModelError("config.json: attention_bias != mlp_bias is not supported")
    if _act(hf, "hidden_act") != "silu":
        raise UnsupportedModelError(f"config.json: hidden_act={hf['hidden_act']!r} (Llama: silu)")
    h = hf["num_attention_heads"]
    return Config(
        vocab=hf["vocab_size"], d_model=hf["hidden_size"], heads=h,
        kv_heads=hf.get("num_key_value_heads") or h,
        d_kv=hf.get("head_dim") or hf["hidden_size"] // h, d_ff=hf["intermediate_size"],
        layers=hf["num_hidden_layers"], length=hf.get("max_position_embeddings", 2048),
        ffn="gated_silu", norm="rms", norm_eps=hf.get("rms_norm_eps", 1e-6),
        bias=hf.get("attention_bias", False), positions="rotary",
        rotary_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        shared_embedding="lm_head.weight" not in names, scale_tied_logits=False,
    )  # fmt: skip


def t5_config(hf: dict, names: set[str]) -> Config:
    proj = hf.get("feed_forward_proj", "relu")
    gated = proj.startswith("gated-")
    act = _ACT.get(proj.removeprefix("gated-"))
    act = "gelu" if proj == "gated-gelu" else act  # transformers' gated-gelu is gelu_new
    if act is None:
        raise UnsupportedModelError(f"config.json: feed_forward_proj={proj!r}")
    scale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False)
    return Config(
        vocab=hf["vocab_size"], d_model=hf["d_model"], heads=hf["num_heads"], d_kv=hf["d_kv"],
        d_ff=hf["d_ff"], layers=hf.get("num_decoder_layers") or hf["num_layers"],
        encoder_layers=hf["num_layers"], length=hf.get("n_positions", 512),
        ffn=f"gated_{act}" if gated else act, norm="rms",
        norm_eps=hf.get("layer_norm_epsilon", 1e-6), attention_scale=False, positions="none",
        relative_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf.get("relative_attention_max_distance", 128),
        shared_embedding="lm_head.weight" not in names, scale_tied_logits=scale,
    )  # fmt: skip


def bert_config(hf: dict, names: set[str]) -> Config:
    _require(hf, "position_embedding_type", ("absolute",), "absolute")
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    return Config(
        vocab=hf["vocab_size"], d_model=d, heads=h, d_kv=d // h, d_ff=hf["intermediate_size"],
        layers=hf["num_hidden_layers"], length=hf["max_position_embeddings"],
        max_positions=hf["max_position_embeddings"], ffn=_act(hf, "hidden_act"),
        norm_eps=hf.get("layer_norm_eps", 1e-12), norm_position="post", bias=True,
        scale_tied_logits=False, type_vocab=hf.get("type_vocab_size", 2), embed_norm=True,
        mlm_head=True,
    )  # fmt: skip


class Family(NamedTuple):
    """How one model_type maps: its Config, its table, the zoo's shapes and the
    name prefix its files use (tried in order; "" for none)."""

    config: object
    table: object
    shapes: object
    prefixes: tuple[str, ...]
    probe: str  # a tensor name (after the prefix) every such checkpoint holds


FAMILIES = {
    "gpt2": Family(
        gpt2_config, gpt2_table, transformer.lm_shapes, ("transformer.", ""), "wte.weight"
    ),
    "llama": Family(
        llama_config, llama_table, transformer.lm_shapes, ("model.", ""), "embed_tokens.weight"
    ),
    "t5": Family(t5_config, t5_table, transformer.encdec_shapes, ("",), "shared.weight"),
    "bert": Family(
        bert_config,
        bert_table,
        transformer.lm_shapes,
        ("bert.",),
        "embeddings.word_embeddings.weight",
    ),
}
TABLES = {k: f.table for k, f in FAMILIES.items()}
DECODERS = ("gpt2", "llama")  # the families that generate and fine-tune as LMs


# --- reading tensors ---------------------------------------------------------------
class Weights:
    """The tensors of a folder's model.safetensors, or of the shards that
    model.safetensors.index.json lists, opened lazily and read by slices."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self._open, self._files = safe_open, {}
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = files.read_json(index, "the index").get("weight_map")
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
            self._files[path] = _opened(self._open, path)
        found = self._files[path].get_slice(name)
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
        words = (m.group(1) or m.group(2)).split()
        out.append(tuple(d for w in words for d in head_dims.get(w, w).split()))
    return out


@dataclass
class FileTensor:
    """A zoo parameter as found in the file: its entry, its axes as groups of dims,
    and the dims and sizes of the zoo parameter (with `layers` first when stacked)."""

    entry: Entry
    groups: list[tuple[str, ...]]
    dims: tuple[str, ...]
    sizes: dict[str, int]

    @property
    def stacked(self) -> bool:
        return self.dims[0] == "layers"

    def file_shape(self) -> tuple[int, ...]:
        shape = [math.prod(self.sizes[d] for d in g) for g in self.groups]
        if self.entry.part:
            axis, _, count = self.entry.part
            shape[axis] *= count
        return tuple(shape)

    def read(self, weights: Weights, index: tuple) -> np.ndarray:
        """The block `index` (slices over self.dims) of the zoo parameter, read slice
        by slice from the file."""
        spans = [s.indices(self.sizes[d])[:2] for s, d in zip(index, self.dims, strict=True)]
        if not self.stacked:
            return self._read_one(weights, self.entry.name, spans)
        (lo, hi), rest = spans[0], spans[1:]
        return np.stack(
            [self._read_one(weights, self.entry.name.format(i=i), rest) for i in range(lo, hi)]
        )

    def _read_one(self, weights: Weights, name: str, spans) -> np.ndarray:
        layer_dims = self.dims[1:] if self.stacked else self.dims
        span = dict(zip(layer_dims, spans, strict=True))
        src, inner = [], []
        for axis, group in enumerate(self.groups):
            # Read the rows covering the first dim's span, whole in the group's other dims.
            lo, hi = span[group[0]]
            step = math.prod(self.sizes[d] for d in group[1:])
            offset = 0
            if self.entry.part and self.entry.part[0] == axis:
                offset = self.entry.part[1] * math.prod(self.sizes[d] for d in group)
            src.append(slice(offset + lo * step, offset + hi * step))
            inner.append(
                [(hi - lo, slice(None))] + [(self.sizes[d], slice(*span[d])) for d in group[1:]]
            )
        block = np.asarray(weights.slice(name)[tuple(src)])
        if block.dtype.kind == "f" or block.dtype.name == "bfloat16":
            block = block.astype(np.float32)  # the zoo computes from float32 parameters
        block = block.reshape([n for axis in inner for n, _ in axis])
        block = block[tuple(s for axis in inner for _, s in axis)]
        flat = [d for g in self.groups for d in g]
        return block.transpose([flat.index(d) for d in layer_dims])

    def write(self, value: np.ndarray, out: dict[str, np.ndarray], layer: int | None) -> None:
        """Put the (one layer's) value of the zoo parameter into the file tensors `out`."""
        layer_dims = self.dims[1:] if self.stacked else self.dims
        flat = [d for g in self.groups for d in g]
        block = value.transpose([layer_dims.index(d) for d in flat])
        block = block.reshape([math.prod(self.sizes[d] for d in g) for g in self.groups])
        name = self.entry.name if layer is None else self.entry.name.format(i=layer)
        if not self.entry.part:
            out[name] = block
            return
        axis, i, count = self.entry.part
        whole = out.setdefault(name, np.zeros(self.file_shape(), block.dtype))
        n = block.shape[axis]
        index = [slice(None)] * block.ndim
        index[axis] = slice(i * n, (i + 1) * n)
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
    for path, p in _leaves(fam.shapes(cfg)):
        if path not in rows:
            raise UnsupportedModelError(
                f"the {family} table has no row for the zoo parameter {path!r} (an option the "
                "family does not have)"
            )
        out[path] = FileTensor(
            rows[path], _groups(rows[path].axes, _head_dims(cfg)), tuple(p.sizes), p.sizes
        )
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
        if self.family == "t5":
            if decoder_input_ids is None:
                raise HubError("T5's logits need decoder_input_ids (the decoder's tokens)")
            batch["decoder_inputs"] = _ints(decoder_input_ids)
            batch.setdefault("weights", nm.ones(ids.sizes, np.float32))
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
    weights (padding mask), token_types, decoder_inputs (T5)."""
    if family == "t5":
        b = {
            "inputs": batch["inputs"],
            "input_weights": batch["weights"],
            "decoder_inputs": batch["decoder_inputs"],
        }
        return transformer.encdec_logits(params, b, cfg)[0]
    logits, _ = transformer.lm_forward(
        params,
        batch["inputs"],
        cfg,
        causal=family != "bert",
        weights=batch.get("weights"),
        token_types=batch.get("token_types"),
    )
    return logits


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
        raise MissingFileError(f"{folder}: no config.json (is it a Hugging Face model folder?)")
    try:
        hf = files.read_json(path, "config.json")
    except files.FileReadError as e:
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
        f"{family} checkpoint of a supported head (GPT2LMHeadModel, LlamaForCausalLM, "
        "T5ForConditionalGeneration, BertForMaskedLM)"
    )


def load(path, mesh: Mesh | None = None, layout: Layout | str | None = None) -> HubModel:
    """The model in a Hugging Face folder (config.json, model.safetensors or a sharded
    model.safetensors.index.json, tokenizer.json when present). With a `mesh`, each
    parameter is laid out by `layout` (rules on the zoo's dims) and every device's shard
    is read from the file as a slice, so the model need not fit one device; without,
    parameters are whole on the default device. Raises MissingFileError,
    UnsupportedModelError, WeightShapeError (all HubError)."""
    folder = Path(path)
    family, hf = read_config(folder)
    weights = Weights(folder)
    prefix = _prefix(family, weights)
    cfg = _config(family, hf, weights, folder)
    return load_params(folder, family, cfg, hf, weights, prefix, mesh, layout)


def config_of(path) -> tuple[str, Config]:
    """(family, the zoo's Config) of a Hugging Face folder, reading no weights."""
    folder = Path(path)
    family, hf = read_config(folder)
    return family, _config(family, hf, Weights(folder), folder)


def _config(family: str, hf: dict, weights: Weights, folder: Path) -> Config:
    """The family's Config of config.json; DamagedFileError for a missing key or a
    value of the wrong type."""
    try:
        return FAMILIES[family].config(hf, set(weights.where))
    except KeyError as e:
        raise DamagedFileError(f"{folder}/config.json lacks the key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, HubError | NamedMeshError):
            raise
        raise DamagedFileError(f"{folder}/config.json: a value of the wrong type ({e})") from None


def load_params(folder, family, cfg, hf, weights, prefix, mesh, layout) -> HubModel:
    """`load` once the family and Config are known: cfg may differ from the folder's
    in what does not change a parameter's shape (length, batch, dropout)."""
    if mesh is not None:
        layout = layout if isinstance(layout, Layout) else Layout(layout or "")
    params = {}
    for p, t in tensors(family, cfg, prefix).items():
        _check_shape(t, weights, p)
        _set(params, p, nm.tensor(_place(t, weights, mesh, layout, p), t.dims))
    return HubModel(family, cfg, params, _tokenizer(folder), hf, mesh, layout)


def _check_shape(t: FileTensor, weights: Weights, path: str) -> None:
    names = (
        [t.entry.name.format(i=i) for i in range(t.sizes["layers"])]
        if t.stacked
        else [t.entry.name]
    )
    want = t.file_shape()
    for name in names:
        got = tuple(weights.slice(name).get_shape())
        if got != want:
            raise WeightShapeError(
                f"tensor {name!r} has shape {got} in the weights, but config.json implies "
                f"{want} (zoo parameter {path!r}, dims {t.dims})"
            )


def _place(t: FileTensor, weights: Weights, mesh, layout, path: str) -> jax.Array:
    shape = tuple(t.sizes[d] for d in t.dims)
    if mesh is None:
        return jax.numpy.asarray(t.read(weights, tuple(slice(None) for _ in shape)))
    lay = layout.of(t.dims, shape, mesh, f"parameter {path!r}")
    sharding = jax.sharding.NamedSharding(mesh.jax_mesh, partition_spec(lay))
    return jax.make_array_from_callback(shape, sharding, lambda index: t.read(weights, index))


def tokenizer_of(path):
    """The folder's tokenizer.json as a tokenizers.Tokenizer, or None."""
    return _tokenizer(Path(path))


def _tokenizer(folder: Path):
    path = folder / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def save(model: HubModel, path) -> None:
    """Write `model` as a Hugging Face folder: config.json (the loaded one), the
    parameters in model.safetensors under the family's names, and tokenizer.json when
    the model has a tokenizer. transformers' from_pretrained loads it back. The folder
    is written whole beside `path` and then replaces it, so nothing of an export that
    was there survives (no stale shard or index) and a failed write (full disk,
    read-only folder) leaves it intact: SaveError."""
    from safetensors.numpy import save_file

    prefix = FAMILIES[model.family].prefixes[0]
    out: dict[str, np.ndarray] = {}
    for p, t in tensors(model.family, model.config, prefix).items():
        value = np.asarray(jax.device_get(_get(model.params, p).transpose(*t.dims).data))
        if t.stacked:
            for i in range(value.shape[0]):
                t.write(value[i], out, i)
        else:
            t.write(value, out, None)

    def write(folder: Path) -> None:  # a fresh folder, then put in place of the old whole
        tensors_ = {k: np.ascontiguousarray(v) for k, v in out.items()}
        try:
            save_file(tensors_, folder / "model.safetensors", {"format": "pt"})
        except Exception as e:  # safetensors' own SafetensorError wraps the OS's
            raise e if isinstance(e, OSError) else OSError(str(e)) from None
        (folder / "config.json").write_text(json.dumps(model.hf_config, indent=2))
        if model.tokenizer is not None:
            model.tokenizer.save(str(folder / "tokenizer.json"))

    try:
        files.replace_folder(path, write)
    except files.FileWriteError as e:
        raise SaveError(str(e)) from None
