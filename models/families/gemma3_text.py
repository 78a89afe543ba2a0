"""Gemma 3 text (Gemma3ForCausalLM, model_type gemma3_text): Gemma 2 plus q/k norms
(1 + weight, over head_dim) and a rotary base of its own on the sliding layers
(rope_parameters' sliding_attention, or rope_local_base_freq in older files), while
the global layers have rope_parameters' full_attention with its scaling; every
`sliding_window_pattern`-th layer is global unless layer_types says otherwise. Each
layer's window and frequencies are arrays the layer scan carries
(models.layers.common.layer_constants)."""

from __future__ import annotations

from dataclasses import dataclass

from models.architecture import Config, ConfigError
from models.families import gemma2, llama
from models.families.common import UnsupportedModelError, require
from models.layers.common import rope_constants
from models.layers.rope import Rope

LOCAL_THETA, GLOBAL_THETA = 10_000.0, 1_000_000.0  # transformers' defaults


@dataclass(frozen=True)
class LocalRope(gemma2.Softcaps):
    """Gemma 2's soft-caps, and the rotary positions of the sliding layers, `local_rope`
    (None: Config.rope, as the global layers'): each layer's frequencies are carried
    by the layer scan (models.layers.common.layer_constants)."""

    local_rope: Rope | None = None

    @property
    def ropes(self) -> tuple:
        return () if self.local_rope is None else (self.local_rope,)

    def check(self, cfg) -> None:
        if self.local_rope is not None and not cfg.sliding_layers:
            raise ConfigError("Config.local_rope needs sliding_layers (which layers are local)")

    def layer_constants(self, cfg, seq_len: int) -> dict:
        if self.local_rope is None:
            return {}
        ropes = (cfg.rope, self.local_rope)
        return rope_constants(ropes, cfg.sliding_layers, cfg.d_kv, seq_len)


def ropes(hf: dict) -> tuple[Rope, Rope]:
    """(global layers' Rope, sliding layers' Rope) as transformers makes them: from
    rope_parameters per layer type, with older files' rope_scaling merged into the
    global layers' and rope_theta / rope_local_base_freq as their default bases."""
    given = hf.get("rope_parameters") or {}
    if stray := sorted(set(given) - set(gemma2.KINDS)):
        raise UnsupportedModelError(
            f"config.json: rope_parameters keys {stray}: Gemma 3's are per layer type "
            f"{gemma2.KINDS}"
        )
    params = {k: dict(given.get(k) or {"rope_type": "default"}) for k in gemma2.KINDS}
    params["full_attention"].update(hf.get("rope_scaling") or {})
    params["full_attention"].setdefault("rope_theta", hf.get("rope_theta") or GLOBAL_THETA)
    local = hf.get("rope_local_base_freq") or LOCAL_THETA
    params["sliding_attention"].setdefault("rope_theta", local)
    max_pos = hf.get("max_position_embeddings", 131_072)
    full, sliding = (
        llama.rope_of({"rope_parameters": params[k], "max_position_embeddings": max_pos})
        for k in ("full_attention", "sliding_attention")
    )
    return full, sliding


def config(hf: dict, names: set[str]) -> Config:
    # transformers' Gemma 3 reads attn_logit_softcapping but never applies it: a value
    # would make the zoo differ from it or be dropped silently, so only null is read
    require(hf, "attn_logit_softcapping", (None,), None)
    # the pattern (transformers 5 writes it twice) counts only where layer_types is absent
    pattern = hf.get("sliding_window_pattern"), hf.get("_sliding_window_pattern")
    pattern = pattern[0] or pattern[1] or 6
    sliding = gemma2.sliding_flags(hf, pattern)
    full, local = ropes(hf)
    kinds = gemma2.windows(hf, sliding)
    options = gemma2.options(hf) | kinds
    caps = vars(options.pop("parts"))
    if kinds.get("sliding_layers"):  # sliding and global layers: each kind its own rope
        rope = {"rope": full, "parts": LocalRope(**caps, local_rope=local)}
    else:
        rope = {"rope": local if all(sliding) else full, "parts": LocalRope(**caps)}
    return llama.decoder_config(hf, names, qk_norm=True, **options, **rope)


# Gemma3TextConfig's: no caps, 131072 positions (its rotary bases: GLOBAL_THETA, LOCAL_THETA)
_NO_CAPS = ("attn_logit_softcapping", "final_logit_softcapping")
DEFAULTS = {k: v for k, v in gemma2.DEFAULTS.items() if k not in _NO_CAPS} | dict(
    max_position_embeddings=131072, use_bidirectional_attention=False, rope_theta=GLOBAL_THETA,
)  # fmt: skip
FAMILY = gemma2.FAMILY._replace(
    name="gemma3_text", config=config, heads="Gemma3ForCausalLM", defaults=DEFAULTS
)

# The canonical checkpoints' config.json keys (models.catalog.configs names them)
NAMED = {
    "gemma-3-1b": dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        max_position_embeddings=32768, query_pre_attn_scalar=256, sliding_window=512,
        sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=None, attn_logit_softcapping=None, rope_scaling=None,
    ),
}  # fmt: skip
