"""Gemma 2 (Gemma2ForCausalLM): Gemma plus a norm after attention and after the FFN
(post_attention_layernorm is the post-norm, pre_feedforward_layernorm the FFN's
input norm), attention logits scaled by query_pre_attn_scalar**-0.5 and soft-capped
(attn_logit_softcapping), final logits soft-capped (final_logit_softcapping), and
sliding and global layers as `layer_types` says (by default alternating, sliding
first): the window is a per-layer array the layer scan carries (models.layers.common.
layer_constants), in every attention kernel and the KV cache. Gemma 3 builds on it."""

from __future__ import annotations

from dataclasses import dataclass

from models.architecture import Config, ConfigError
from models.families import gemma, llama
from models.families.common import Entry, UnsupportedModelError, act, norm
from models.layers.blockwise import softcap
from models.parts import Parts

KINDS = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class Softcaps(Parts):
    """Gemma 2's soft-caps (0: none): attention logits -> attention_softcap * tanh(logits
    / attention_softcap) in every kernel and the cache; final logits likewise by
    logit_softcap. Gemma 3 has the final one alone."""

    attention_softcap: float = 0.0
    logit_softcap: float = 0.0

    def __post_init__(self):
        for name in ("attention_softcap", "logit_softcap"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"Config.{name}={value!r} must be >= 0 (0: none)")

    def logits(self, logits):
        return softcap(logits, self.logit_softcap) if self.logit_softcap else logits


def sliding_flags(hf: dict, pattern: int) -> tuple[bool, ...]:
    """Per layer, whether it is a sliding one: `layer_types`, or when absent every
    layer but each `pattern`-th (transformers' default)."""
    n = hf["num_hidden_layers"]
    kinds = hf.get("layer_types") or [KINDS[(i + 1) % pattern == 0] for i in range(n)]
    if stray := sorted(set(kinds) - set(KINDS)):
        raise UnsupportedModelError(f"config.json: layer_types {stray} (supported: {KINDS})")
    return tuple(k == "sliding_attention" for k in kinds)


def windows(hf: dict, sliding: tuple[bool, ...]) -> dict:
    """sliding_window and sliding_layers: () when every layer is alike."""
    size = hf.get("sliding_window")
    if any(sliding) and not size:
        raise UnsupportedModelError(
            f"config.json: sliding_window={size!r} with sliding layers in layer_types"
        )
    if not any(sliding):
        return {"sliding_window": 0}
    return {"sliding_window": size, "sliding_layers": () if all(sliding) else sliding}


def options(hf: dict) -> dict:
    """What Gemma 2 and 3 add to Gemma's options (windows apart)."""
    hf.get("hidden_act")  # transformers' Gemma 2 and 3 read hidden_activation only
    hf.get("cache_implementation")  # how transformers caches sliding layers: same values
    return dict(
        gemma.options(hf, act(hf, "hidden_activation")), block="sandwich",
        attention_scale_dim=float(hf.get("query_pre_attn_scalar") or 0.0),
        parts=Softcaps(
            attention_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
            logit_softcap=float(hf.get("final_logit_softcapping") or 0.0),
        ),
    )  # fmt: skip


def config(hf: dict, names: set[str]) -> Config:
    sliding = sliding_flags(hf, 2)
    return llama.decoder_config(hf, names, **options(hf), **windows(hf, sliding))


def table(cfg: Config, prefix: str) -> list[Entry]:
    layer = f"{prefix}layers.{{i}}."
    rows = [e for e in llama.table(cfg, prefix) if e.path != "layers/ffn_norm"]
    return rows + [
        *norm("layers/attn_post_norm", f"{layer}post_attention_layernorm", False),
        *norm("layers/ffn_norm", f"{layer}pre_feedforward_layernorm", False),
        *norm("layers/ffn_post_norm", f"{layer}post_feedforward_layernorm", False),
    ]


# Gemma2Config's: its caps (50 on attention, 30 on the logits), a window of 4096, the
# activation read from hidden_activation alone
DEFAULTS = {k: v for k, v in gemma.DEFAULTS.items() if k != "hidden_act"} | dict(
    hidden_activation="gelu_pytorch_tanh", num_key_value_heads=4, query_pre_attn_scalar=256,
    sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
)  # fmt: skip
FAMILY = llama.FAMILY._replace(
    name="gemma2", config=config, table=table, heads="Gemma2ForCausalLM", defaults=DEFAULTS
)

# The canonical checkpoints' config.json keys (models.catalog.configs names them)
_GEMMA2 = dict(
    vocab_size=256000, head_dim=256, max_position_embeddings=8192, rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh", rope_theta=10000.0, query_pre_attn_scalar=256,
    sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
)  # fmt: skip
NAMED = {
    "gemma-2-2b": dict(_GEMMA2, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4),  # Gemma2Config's defaults
    "gemma-2-9b": dict(_GEMMA2, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                       num_attention_heads=16, num_key_value_heads=8),
}  # fmt: skip
