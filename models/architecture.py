"""Model configurations by name: `tiny`, `small`, `base`, and the Mesh-TensorFlow paper's
LM1B language models `lm1b_m1` ... `lm1b_5` (tensor2tensor's `mtf_transformer_paper_lm`:
d_model 1024, d_kv 256, 6 layers, heads 8·2^k, d_ff 8192·2^k, unshared embeddings,
a 32768-token vocabulary; 0.14B to 4.90B parameters), each with the paper's mesh and
layout; and the shapes of the checkpoints people bring (`gpt2`, `gpt2-medium`,
`tinyllama-1.1b`, `llama3-8b`, `llama3-70b`, `llama3-405b`, `t5-small`, `t5-base`,
`t5-v1_1-small`; see models/io/hub.py); models/catalog.py's `configs()` adds the families'
canonical checkpoints (`bert-base-uncased`, `mistral-7b`, `qwen3-8b`, `gemma-2-9b`, ...:
each family module's NAMED), and its `get(name)` finds any of them."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass

from models.errors import ConfigError as ConfigError  # re-exported: its home was here
from models.layers.kernels import AUTO, KERNELS
from models.layers.latent import Latent
from models.layers.rope import Rope, rotary_dims
from models.parts import Parts, field_types, with_options
from models.residual import COMPOSITIONS
from models.run_settings import FIELDS as RUN_FIELDS
from models.run_settings import Run

# layer: LayerNorm; rms: RMSNorm; rms_offset: RMSNorm scaled by 1 + its weight (Gemma)
NORMS = ("layer", "rms", "rms_offset")


# The command-line flag that sets a Config field, where it has its own (else --set).
_FLAGS = {"batch": "--batch", "length": "--length", "attention_block": "--attention-block"}
# The smallest value of each size of a Config (0 of an option: the option is off).
_AT_LEAST = {
    **dict.fromkeys(("vocab", "d_model", "heads", "d_kv", "d_ff", "layers", "length"), 1),
    **dict.fromkeys(("batch", "attention_block"), 1),
    **dict.fromkeys(("relative_bias", "max_positions", "kv_heads", "relative_buckets"), 0),
    **dict.fromkeys(("experts", "encoder_layers"), 0),
    **dict.fromkeys(("expert_ff", "shared_ff", "dense_layers"), 0),
}
AT_MOST = 10**9  # every size of a Config: beyond any model (and jax's int32 shapes' reach)
DTYPES = ("float32", "bfloat16")  # the compute dtypes (parameters stay float32)


@dataclass(frozen=True)
class Config:
    """A Transformer's sizes and options. Dims of the named parameters and activations:
    batch, length, memory (attended positions), d_model, heads, d_kv, d_ff, vocab,
    layers, experts, expert_capacity."""

    vocab: int = 256
    d_model: int = 64
    heads: int = 4
    d_kv: int = 16
    d_ff: int = 256
    layers: int = 2
    length: int = 64  # training sequence length (and the largest position)
    batch: int = 16
    ffn: str = "gelu"  # relu | gelu (tanh) | gelu_exact | silu, or gated_<one> (swiglu, geglu)
    norm: str = "layer"  # layer | rms | rms_offset (RMSNorm x (1 + weight): Gemma)
    shared_embedding: bool = True  # the softmax reuses the input embedding
    relative_bias: int = 0  # > 0: a learned bias per head for relative distances up to it
    # --- options of the architectures people bring (models/io/hub.py); defaults keep the zoo's
    norm_eps: float = 1e-6
    # how a block puts attention and the FFN on the residual (models/residual.py): pre
    # h + f(norm(h)), final norm; post: norm(h + f(h)) (BERT); sandwich: h + norm'(f(norm(h)))
    # (Gemma 2, 3); parallel: h + attn(norm(h)) + ffn(norm'(h)) (GPT-NeoX)
    block: str = "pre"
    bias: bool = False  # biases on the attention and FFN projections
    qkv_bias: bool = False  # biases on the q, k and v projections only (Qwen2)
    qk_norm: bool = False  # RMSNorm of each head's queries and keys over d_kv (Qwen3)
    sliding_window: int = 0  # > 0: a query sees the last `sliding_window` keys (Mistral)
    scale_tied_logits: bool = True  # tied softmax: logits of x * d_model**-0.5
    attention_scale: bool = True  # logits q.k * d_kv**-0.5 (False: T5's unscaled)
    positions: str = "learned"  # learned (absolute, max_positions of them) | rotary | none
    max_positions: int = 0  # learned positions in the table (0: `length`)
    rope: Rope = Rope()  # rotary positions: theta and scaling (llama3, linear, dynamic, yarn)
    kv_heads: int = 0  # > 0: grouped-query attention, dims kv_heads and q_per_kv
    relative_buckets: int = 0  # > 0: T5's log-bucketed relative bias, one table per stack
    relative_max_distance: int = 128
    embed_norm: bool = False  # a norm after the embeddings (BERT)
    mlm_head: bool = False  # BERT's MLM head: dense, activation, norm, then a vocab bias
    dropout: float = 0.0
    experts: int = 0  # > 0: mixture-of-experts FFN (docs/models.md, "Mixture of experts")
    experts_per_token: int = 2  # k: the experts each token reaches
    routing: str = "dropless"  # dropless (every choice computed) | capacity (slots, drops)
    router: str = "topk_softmax"  # topk_softmax (chosen weights sum to 1) | softmax_topk
    # | sigmoid_topk (sigmoid scores, chosen by score + a learned bias: DeepSeek-V3) |
    # sigmoid_topk_norm (the chosen scores normed to sum to 1)
    expert_ff: int = 0  # the experts' FFN width (0: d_ff)
    shared_ff: int = 0  # > 0: a dense gated FFN this wide beside the experts (shared experts)
    dense_layers: int = 0  # the first layers have a dense FFN of d_ff (first_k_dense_replace)
    capacity_factor: float = 1.25  # capacity routing: slots per expert over an even share
    moe_loss: float = 0.01  # weight of the load-balancing loss
    encoder_layers: int = 0  # encoder-decoder: layers of the encoder
    # the run's settings (models/run_settings.py: dtype, remat, scan_layers, attention,
    # attention_block, mesh, layout), not the architecture's; read as cfg.dtype, ...
    run: Run = Run()
    # > 0: token embeddings of this width (dim d_embed), projected in to d_model before the
    # stack and out of it after (OPT's word_embed_proj_dim: project_in, project_out)
    embed_dim: int = 0
    # --- Gemma 1-3's options (models/families/gemma*.py); defaults keep the zoo's
    embed_scale: bool = False  # token embeddings x sqrt(d_model), rounded to the compute dtype
    attention_scale_dim: float = 0.0  # > 0: logits q.k * attention_scale_dim**-0.5, not d_kv's
    sliding_layers: tuple[bool, ...] = ()  # the layers sliding_window applies to (): all
    # multi-head latent attention (DeepSeek; models/layers/mla.py): queries, keys and values from
    # low-rank latents, d_kv the rotated dims every head's key shares; None: multi-head
    mla: Latent | None = None
    # the Hugging Face model_type the model is of (models/families/; "": the zoo's own),
    # recorded by models.io.hub's family builder
    family: str = ""
    # the family's own parts (models/parts.py): its options as fields of a Parts record
    # that its module defines, hooks the shared forward pass calls (Parts(): none)
    parts: Parts = Parts()

    def __post_init__(self):
        if not isinstance(self.parts, Parts):
            raise ConfigError(
                f"Config.parts must be a models.parts.Parts (a family's parts), got "
                f"{type(self.parts).__name__}"
            )
        choices = {
            "norm": NORMS,
            "block": tuple(COMPOSITIONS),
            "positions": ("learned", "rotary", "none"),
            "attention": (AUTO, *KERNELS),
            "remat": ("none", "full", "dots"),
            "routing": ("dropless", "capacity"),
            "router": ("topk_softmax", "softmax_topk", "sigmoid_topk", "sigmoid_topk_norm"),
            "dtype": DTYPES,
        }
        for field, allowed in choices.items():
            if getattr(self, field) not in allowed:
                raise ConfigError(
                    f"Config.{field} must be one of {allowed}, got {getattr(self, field)!r}"
                )
        for field, low in _AT_LEAST.items():
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                flag = _FLAGS.get(field, f"--set {field}=")
                raise ConfigError(f"Config.{field} ({flag}) must be an int >= {low}, got {value!r}")
            if value > AT_MOST:
                flag = _FLAGS.get(field, f"--set {field}=")
                raise ConfigError(f"Config.{field} ({flag}) must be <= {AT_MOST:,}, got {value:,}")
        if not isinstance(self.scan_layers, bool) and self.scan_layers != "auto":
            raise ConfigError(
                f"Config.scan_layers must be True, False or 'auto', got {self.scan_layers!r}"
            )
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"Config.dropout must be >= 0 and < 1, got {self.dropout!r}")
        if self.experts and not 1 <= self.experts_per_token <= self.experts:
            raise ConfigError(
                f"Config.experts_per_token={self.experts_per_token} must be in "
                f"[1, experts={self.experts}]"
            )
        if self.kv_heads and self.heads % self.kv_heads:
            raise ConfigError(
                f"Config.kv_heads={self.kv_heads} does not divide heads={self.heads}: each "
                "key/value head must serve the same number of query heads"
            )
        if self.kv_heads and (self.relative_bias or self.relative_buckets):
            raise ConfigError("relative position biases are per `heads`; kv_heads must be 0")
        if self.sliding_window < 0:
            raise ConfigError(f"Config.sliding_window={self.sliding_window} must be >= 0 (0: none)")
        if self.attention == "ring" and self.relative_buckets:
            # T5's bias is one (heads, length, memory) table for the whole stack, which a
            # ring cannot pass round with its key blocks (ring_attend refuses it)
            raise ConfigError(
                f"Config.attention='ring' (--attention ring) cannot take "
                f"relative_buckets={self.relative_buckets} (T5's bucketed relative bias, "
                "over both length and memory): use attention='blockwise' or 'full'"
            )
        self._check_layer_kinds()
        if self.positions == "rotary" and rotary_dims(self.rope, self.d_kv) % 2:
            raise ConfigError(
                f"rotary positions rotate pairs: the {rotary_dims(self.rope, self.d_kv)} rotated "
                f"dims of d_kv={self.d_kv} (rope.fraction {self.rope.fraction}) must be even"
            )
        if self.positions == "rotary":
            self.rope.check(rotary_dims(self.rope, self.d_kv))
        if self.block == "parallel" and self.encoder_layers:
            raise ConfigError(
                f"Config.block='parallel' with encoder_layers={self.encoder_layers}: the "
                "parallel residual is implemented for decoder-only and encoder-only stacks "
                "(a cross-attention has no place beside attention and the FFN)"
            )
        if self.mla is not None:
            self._check_latent()
        self._check_experts()

    def _check_experts(self):
        """Dense layers before mixture-of-experts ones, in one decoder stack (a family's
        routing options are its parts': their `check`)."""
        if (self.dense_layers or self.shared_ff) and not self.experts:
            raise ConfigError(
                f"Config.dense_layers={self.dense_layers} and shared_ff={self.shared_ff} are "
                "options of a mixture of experts: experts is 0"
            )
        if self.dense_layers and (self.dense_layers > self.layers or self.sliding_layers
                                  or self.encoder_layers):  # fmt: skip
            raise ConfigError(
                f"Config.dense_layers={self.dense_layers} must be <= layers={self.layers}, "
                "in a decoder-only stack without per-layer windows"
            )

    def _check_latent(self):
        """Latent attention has no options of multi-head attention's projections, and
        rotates (part of) its queries and keys."""
        refused = {"kv_heads": 0, "qk_norm": False, "bias": False, "qkv_bias": False}
        refused |= {"relative_bias": 0, "relative_buckets": 0, "encoder_layers": 0}
        refused |= {"positions": "rotary"}
        for field, want in refused.items():
            if getattr(self, field) != want:
                raise ConfigError(
                    f"Config.mla (latent attention) with {field}={getattr(self, field)!r}: "
                    f"implemented only with {field}={want!r}"
                )

    def _check_layer_kinds(self):
        """sliding_layers (one flag per layer) need a window to mean something; the
        scale must not be negative; the family's parts agree with the rest."""
        if self.sliding_layers and len(self.sliding_layers) != self.layers:
            raise ConfigError(
                f"Config.sliding_layers has {len(self.sliding_layers)} flags for "
                f"layers={self.layers}: one per layer"
            )
        if self.sliding_layers and not self.sliding_window:
            raise ConfigError(
                "Config.sliding_layers say which layers slide: they need sliding_window > 0"
            )
        if self.sliding_layers and self.encoder_layers:
            raise ConfigError(
                f"Config.sliding_layers with encoder_layers={self.encoder_layers}: per-layer "
                "windows are implemented for one stack of `layers` (decoder-only models)"
            )
        self.parts.check(self)
        if self.attention_scale_dim < 0:
            raise ConfigError(
                f"Config.attention_scale_dim={self.attention_scale_dim} must be >= 0 (0: none)"
            )

    def replace(self, **changes) -> Config:
        """This config with `changes`, the run's settings among them (dtype=...)."""
        return dataclasses.replace(self, **changes)

    # The run's settings, read where they were Config fields (models/run_settings.py)
    dtype = property(lambda self: self.run.dtype)
    remat = property(lambda self: self.run.remat)
    scan_layers = property(lambda self: self.run.scan_layers)
    attention = property(lambda self: self.run.attention)
    attention_block = property(lambda self: self.run.attention_block)
    mesh = property(lambda self: self.run.mesh)
    layout = property(lambda self: self.run.layout)

    @property
    def attention_variant(self) -> str:
        """The attention the blocks use (models.transformer.ATTENTIONS): mla or mha."""
        return "mha" if self.mla is None else "mla"

    @property
    def mlp_variant(self) -> str:
        """The MLP the blocks use (models.blocks.MLPS): moe (experts > 0) or dense."""
        return "moe" if self.experts else "dense"

    @property
    def attention_factor(self) -> float:
        """The attention logits' factor: d_kv**-0.5 (attention_scale_dim**-0.5 where set;
        1 where attention_scale is False: T5's unscaled logits), as the family's parts
        take it (Granite's attention_multiplier replaces it)."""
        plain = (self.attention_scale_dim or self.d_kv) ** -0.5 if self.attention_scale else 1.0
        return self.parts.attention_factor(plain)

    @property
    def q_per_kv(self) -> int:
        """Query heads that share one key/value head (grouped-query attention)."""
        return self.heads // self.kv_heads if self.kv_heads else 1

    @property
    def learned_positions(self) -> int:
        """Positions of the learned absolute position table (0: the model has none); the
        table has position_offset rows more, before them."""
        if self.positions != "learned" or self.relative_bias or self.relative_buckets:
            return 0
        return self.max_positions or self.length


def _taking_run_settings_by_name(cls):
    """`cls` whose constructor (and so dataclasses.replace) also takes the run's settings
    by name, as when they were Config fields: Config(dtype="bfloat16") is Config(run=
    Run(dtype="bfloat16")), applied over `run` when both are given; and a family's
    options by name, as when they were Config fields (Config(logit_softcap=30.0): set on
    `parts`, models.parts.with_options)."""
    made = cls.__init__
    own = {f.name for f in dataclasses.fields(cls)}

    @functools.wraps(made)
    def __init__(self, *args, **fields):
        settings = {k: fields.pop(k) for k in RUN_FIELDS if k in fields}
        if settings:
            fields["run"] = dataclasses.replace(fields.get("run", Run()), **settings)
        if options := {k: fields.pop(k) for k in list(fields) if k not in own}:
            fields["parts"] = _parts_with(fields.get("parts", Parts()), options)
        made(self, *args, **fields)

    cls.__init__ = __init__
    return cls


def _parts_with(parts: Parts, options: dict) -> Parts:
    """`parts` with a family's `options` set; ConfigError naming an option no Config
    field and no family's parts have (with the closest Config field), or one these
    parts lack."""
    import difflib

    try:
        return with_options(parts, options)
    except KeyError as e:
        names = [f.name for f in dataclasses.fields(Config)] + list(RUN_FIELDS)
        names += list(field_types())
        near = difflib.get_close_matches(e.args[0], names, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"Config has no field {e.args[0]!r}{hint}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"Config's family options {options}: {e}") from None


Config = _taking_run_settings_by_name(Config)

_PAPER_LAYOUT = "batch:batch;vocab:model;d_ff:model;heads:model"
_PAPER_MESHES = {
    -1: (("batch", 32),),
    0: (("batch", 32),),
    1: (("model", 4), ("batch", 8)),
    2: (("model", 4), ("batch", 8)),
    3: (("model", 8), ("batch", 16)),
    4: (("batch", 16), ("model", 32)),
    5: (("batch", 16), ("model", 32)),
}
# Parameters (billions) that tensor2tensor reports for each size.
PAPER_PARAMS = {-1: 0.14, 0: 0.22, 1: 0.37, 2: 0.67, 3: 1.28, 4: 2.48, 5: 4.90}


def _paper_lm(k: int) -> Config:
    n = 2.0**k
    return Config(
        vocab=32768,
        d_model=1024,
        heads=int(8 * n),
        d_kv=256,
        d_ff=int(8192 * n),
        layers=6,
        length=256,
        batch=256,
        ffn="relu",
        shared_embedding=False,
        run=Run(
            mesh=_PAPER_MESHES[k],
            layout=_PAPER_LAYOUT if k > 0 else "batch:batch",  # the smallest: data-parallel
        ),
    )


def _gpt2(d_model: int, heads: int, layers: int) -> Config:
    return Config(
        vocab=50257,
        d_model=d_model,
        heads=heads,
        d_kv=d_model // heads,
        d_ff=4 * d_model,
        layers=layers,
        length=1024,
        max_positions=1024,
        batch=8,
        ffn="gelu",
        norm_eps=1e-5,
        bias=True,
        scale_tied_logits=False,
        family="gpt2",
    )


def _llama(**sizes) -> Config:
    return Config(
        **sizes,
        batch=8,
        ffn="gated_silu",
        norm="rms",
        norm_eps=1e-5,
        shared_embedding=False,
        scale_tied_logits=False,
        positions="rotary",
        family="llama",
    )


def _t5(d_model: int, heads: int, d_ff: int, layers: int, v1_1: bool = False) -> Config:
    return Config(
        vocab=32128,
        d_model=d_model,
        heads=heads,
        d_kv=64,
        d_ff=d_ff,
        layers=layers,
        encoder_layers=layers,
        length=512,
        batch=8,
        ffn="gated_gelu" if v1_1 else "relu",
        norm="rms",
        norm_eps=1e-6,
        shared_embedding=not v1_1,
        scale_tied_logits=not v1_1,
        attention_scale=False,
        positions="none",
        relative_buckets=32,
        relative_max_distance=128,
        family="t5",
    )


# fmt: off
_TINYLLAMA = _llama(vocab=32000, d_model=2048, heads=32, kv_heads=4, d_kv=64, d_ff=5632,
                    layers=22, length=2048)
_LLAMA3_8B = _llama(vocab=128256, d_model=4096, heads=32, kv_heads=8, d_kv=128, d_ff=14336,
                    layers=32, length=8192, rope=Rope(theta=500000.0))
_LLAMA3_70B = _llama(vocab=128256, d_model=8192, heads=64, kv_heads=8, d_kv=128, d_ff=28672,
                     layers=80, length=8192, rope=Rope(theta=500000.0))
# Llama 3.1 405B (there is no Llama 3 405B): its long-context rope scaling
_LLAMA3_405B = _llama(vocab=128256, d_model=16384, heads=128, kv_heads=8, d_kv=128,
                      d_ff=53248, layers=126, length=131072,
                      rope=Rope(theta=500000.0, kind="llama3", factor=8.0,
                                original_positions=8192))
# fmt: on

# The architectures people bring, with their published shapes (weights come from files:
# models.io.hub.load).
ECOSYSTEM: dict[str, Config] = {
    "gpt2": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 16, 24),
    "tinyllama-1.1b": _TINYLLAMA,
    "llama3-8b": _LLAMA3_8B,
    "llama3-70b": _LLAMA3_70B,
    "llama3-405b": _LLAMA3_405B,
    "t5-small": _t5(512, 8, 2048, 6),
    "t5-base": _t5(768, 12, 3072, 12),
    "t5-v1_1-small": _t5(512, 6, 1024, 8, v1_1=True),
}

CONFIGS: dict[str, Config] = {
    "tiny": Config(),
    "small": Config(d_model=256, heads=4, d_kv=64, d_ff=1024, layers=4, length=128),
    "base": Config(d_model=512, heads=8, d_kv=64, d_ff=2048, layers=6, length=256, batch=64),
    **{f"lm1b_{'m1' if k < 0 else k}": _paper_lm(k) for k in PAPER_PARAMS},
    **ECOSYSTEM,
}


def _legacy_flag(field: str, value: str):
    """The --set item a legacy boolean field's item means (`true`: block=value)."""

    def item(text: str) -> str | None:
        if text.lower() in ("false", "0", "no"):
            return None  # the option off: the block as the rest of the config says
        if text.lower() in ("true", "1", "yes"):
            return f"block={value}"
        raise ConfigError(f"--set {field}={text!r}: expected true or false (now block={value})")

    return item


# --set names of fields that became Config.block's values (a run.json records its --set,
# so runs made before still resume and load): norm_position=post -> block=post, ...
LEGACY = {
    "norm_position": lambda text: f"block={text}",
    "parallel_residual": _legacy_flag("parallel_residual", "parallel"),
    "post_norms": _legacy_flag("post_norms", "sandwich"),
}


def _record_of(hint):
    """A field's type, or the record of an optional record (`Rope | None`: Rope)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) else hint


def parse_overrides(items: list[str]) -> dict:
    """`["d_model=128", "ffn=relu"]` -> `{"d_model": 128, "ffn": "relu"}`, each value
    converted to its Config field's type (bool: true/false; tuples: Python literals).
    ConfigError for a malformed item, an unknown field (with the closest name) or a
    value that does not convert."""
    import ast
    import difflib

    hints = typing.get_type_hints(Config) | typing.get_type_hints(Run)
    del hints["run"]  # its fields are set by name
    # a family's options (its parts' fields: models/parts.py), set by name as before
    hints |= {name: kind for name, (_, kind) in field_types().items() if name not in hints}
    out = {}
    for item in items:
        name, eq, text = item.partition("=")
        name = name.strip()
        if eq and name in LEGACY:  # a field that became a value of another (old run.json)
            item = LEGACY[name](text.strip())
            if item is None:
                continue
            name, eq, text = item.partition("=")
        if not eq or not name:
            raise ConfigError(f"--set {item!r}: expected field=value, e.g. d_model=128")
        if name not in hints:
            near = difflib.get_close_matches(name, list(hints), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"--set {item!r}: Config has no field {name!r}{hint}")
        kind = _record_of(hints[name])
        try:
            if kind == bool | str and text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                value = text  # a flag or a word (scan_layers=auto)
            elif kind in (bool, bool | str):
                if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(text)
                value = text.lower() in ("true", "1", "yes")
            elif kind in (int, float, str):
                value = kind(text)
            elif dataclasses.is_dataclass(kind):  # a record (Rope): fields as a dict
                value = kind(**ast.literal_eval(text))
            else:
                value = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError):
            raise ConfigError(
                f"--set {item!r}: {text!r} is not a valid {getattr(kind, '__name__', kind)} "
                f"for Config.{name}"
            ) from None
        out[name] = value
    return out
