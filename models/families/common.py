"""What every family module uses: the errors of reading a Hugging Face folder, a row
of a weight table (`Entry`) and its shorthands, the `Family` record the registry
holds, and the helpers that read config.json so that no option goes unread."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import NamedTuple

from models.training.checkpoint import CheckpointError


class HubError(CheckpointError):
    """A Hugging Face folder that cannot be loaded or a model that cannot be saved."""


class UnsupportedModelError(HubError):
    """A model family (config.json's model_type) or option the zoo does not implement."""


class MissingFileError(HubError):
    """A file (config.json, the weights) or a tensor the family needs is not there."""


class WeightShapeError(HubError):
    """A tensor of the weights whose shape is not the one config.json implies."""


class WeightDtypeError(HubError):
    """A tensor of the weights that is not floating point (an int or bool tensor where a
    weight is read): never used as a weight."""


class DamagedFileError(HubError):
    """A config.json, index, safetensors or tokenizer file that is not what it should
    be: not JSON, truncated, a key missing or of the wrong type."""


class ChatTemplateError(HubError):
    """A chat template that fails to render or exceeds the sandbox's bounds
    (models/io/sandbox.py); the message names the template's file."""


class Entry(NamedTuple):
    """One row of a family's table: the zoo path, the file's tensor name (`{i}`: the
    layer), its axes as groups of zoo dims, and (axis, index, count) when the tensor
    fuses `count` zoo parameters along `axis` (this one is part `index`). In the axes,
    Q are the query head dims and KV the key/value head dims. The parts are one after
    another along the axis (GPT-2's c_attn: q, k, v), of equal sizes, or of the sizes
    `count` lists when it is a tuple (Phi-3's qkv_proj under grouped-query heads); a
    `*` in the axis' group says where equal parts sit inside it ("(Q * d_kv)": each
    head's q, k and v together, GPT-NeoX's query_key_value)."""

    path: str
    name: str
    axes: str
    part: tuple[int, int, int | tuple[int, ...]] | None = None
    first: int = 0  # the file's layer number ({i}) of the stack's layer 0 (a second stack)


# The zoo dims a tensor name may index, one file tensor per index: a parameter stacked
# over `layers` is read from layers.{i}.*, one stacked over `experts` from per-expert
# tensors (experts.{e}.*; Mixtral's, Qwen-MoE's), both ways (load and export).
STACKED = {"layers": "{i}", "experts": "{e}"}


def experts(path: str, name: str, out: str, inp: str) -> list[Entry]:
    """The per-expert torch Linears `name` (holding `{e}`: experts.{e}.w1) as one zoo
    parameter `path` with an `experts` dim, each expert's weight (out, in)."""
    return linear(path, name, out, inp, False)


def moe_rows(layer: str, moe: str, names=("gate_proj", "up_proj", "down_proj")) -> list[Entry]:
    """A mixture of experts' rows under `{layer}{moe}.`: the router (gate.weight, experts
    by d_model) and each expert's gated MLP (experts.{e}.<names>: the activation's input,
    the linear half, the output projection), stacked over experts."""
    m = f"{layer}{moe}."
    wi, wg, wo = (f"{m}experts.{{e}}.{n}" for n in names)
    return [
        Entry("layers/ffn/gate", f"{m}gate.weight", "experts d_model"),
        *experts("layers/ffn/wi", wi, "d_ff", "d_model"),
        *experts("layers/ffn/wg", wg, "d_ff", "d_model"),
        *experts("layers/ffn/wo", wo, "d_model", "d_ff"),
    ]


def linear(path: str, name: str, out: str, inp: str, bias: bool) -> list[Entry]:
    """A torch Linear: weight (out, in), bias (out)."""
    rows = [Entry(path, f"{name}.weight", f"({out}) ({inp})")]
    return rows + ([Entry(f"{path}_bias", f"{name}.bias", f"({out})")] if bias else [])


def norm(path: str, name: str, layer: bool, weight: str = "weight", dim="d_model") -> list[Entry]:
    """A LayerNorm (weight and bias) or an RMSNorm (weight) over `dim`."""
    rows = [Entry(f"{path}/scale", f"{name}.{weight}", dim)]
    return rows + ([Entry(f"{path}/bias", f"{name}.bias", dim)] if layer else [])


class Family(NamedTuple):
    """One Hugging Face model_type: `config(hf, names)` reads config.json (an
    `Options` dict, so unread keys are found) and the weights' tensor names into the
    zoo's Config; `table(cfg, prefix)` lists its weight tensors; `model` names the zoo
    model (models.zoo.MODELS: lm, bert, encdec) that gives shapes, logits and loss;
    `prefixes` are the tensor-name prefixes its files use (tried in order) and `probe`
    a tensor every checkpoint holds; `ignored` are regexes of tensor names that carry
    nothing (buffers like rotary_emb.inv_freq); `heads` names the transformers class;
    `tokens` the special tokens ("bos", "eos") its tokenizer puts around a text, which
    a tokenizer made from vocab.json + merges.txt or tokenizer.model is given
    (models/io/folder_tokens.py; a tokenizer.json says so itself); `unused(cfg)` are
    (regex, empty) pairs of tensors that a Config makes carry nothing (Qwen2-MoE's
    shared expert of width 0: transformers still saves its zero-size weights and its
    gate), not read, where `empty` says the tensor must hold no elements (else a
    WeightShapeError: the folder contradicts its config.json). `defaults` are the values
    transformers' config class gives the option keys the family reads (its sizes
    apart) when config.json leaves them out: a key absent reads as transformers reads
    it, never as a guess of the zoo's (GPT-2's activation_function is gelu_new, Gemma
    2's caps 50 and 30; tests/test_family_defaults.py checks each against transformers)."""

    name: str
    config: Callable
    table: Callable
    model: str
    prefixes: tuple[str, ...]
    probe: str
    heads: str
    ignored: tuple[str, ...] = ()
    tokens: tuple[str, ...] = ()
    unused: Callable = lambda cfg: ()
    defaults: Mapping[str, object] = MappingProxyType({})


# config.json keys that change nothing the zoo computes at inference: bookkeeping,
# special token ids (the tokenizer's business), dropout rates, init scales.
GENERIC = frozenset(
    """architectures model_type transformers_version torch_dtype dtype _name_or_path
    bos_token_id eos_token_id pad_token_id decoder_start_token_id sep_token_id
    initializer_range initializer_factor use_cache output_attentions output_hidden_states
    return_dict id2label label2id tokenizer_class prefix task_specific_params
    finetuning_task problem_type attention_dropout attn_pdrop embd_pdrop resid_pdrop
    dropout_rate hidden_dropout_prob attention_probs_dropout_prob classifier_dropout
    summary_activation summary_first_dropout summary_proj_to_labels summary_type
    summary_use_proj is_encoder_decoder chunk_size_feed_forward auto_map""".split()
)


class Options(dict):
    """config.json as a dict that remembers which keys were read, so `unread()` names
    the options a family did not implement. A key the file leaves out reads as
    `defaults` (the family's: transformers' own) give it, before any default the
    reading code passes."""

    def __init__(self, hf=(), defaults: Mapping | None = None):
        super().__init__(hf)
        self.read: set[str] = set()
        self.defaults = defaults or {}

    def __getitem__(self, key):
        self.read.add(key)
        if key not in self and key in self.defaults:
            return self.defaults[key]
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        if key not in self:
            return self.defaults.get(key, default)
        return super().__getitem__(key)

    def unread(self) -> dict:
        return {k: v for k, v in self.items() if k not in self.read and k not in GENERIC}


_ACT = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact", "relu": "relu"}
_ACT |= {"silu": "silu", "swish": "silu"}


def act(hf: dict, key: str) -> str:
    """The zoo's name of the activation config.json's `key` names."""
    name = hf.get(key, "gelu")
    if name not in _ACT:
        raise UnsupportedModelError(f"config.json: {key}={name!r} is not one of {sorted(_ACT)}")
    return _ACT[name]


def act_named(name: str):
    """The zoo's name of a transformers activation name, or None."""
    return _ACT.get(name)


def require(hf: dict, key: str, allowed, default=None) -> None:
    """Refuse config.json's `key` unless its value (default when absent) is allowed."""
    if hf.get(key, default) not in allowed:
        raise UnsupportedModelError(
            f"config.json: {key}={hf.get(key)!r} is not supported (supported: {allowed})"
        )
