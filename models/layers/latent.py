"""Multi-head latent attention's sizes (DeepSeek-V2/V3; arXiv 2405.04434), a record a
Config holds as `mla` so it stays hashable. The layer is models/layers/mla.py."""

from __future__ import annotations

from dataclasses import dataclass

from models.errors import ConfigError


@dataclass(frozen=True)
class Latent:
    """Queries from a low-rank `q_rank` latent (0: one d_model -> heads projection), keys
    and values from a `kv_rank` latent shared by every head; each head's query and key
    are `nope` dims without positions then the rotated dims (Config.d_kv, the key's
    shared by every head), its value `v` dims. `interleave`: the rotated dims pair as
    (0, 1), (2, 3), ... (DeepSeek's rope_interleave), not as halves. `eps` is the latent
    norms' (DeepSeek's q_a_layernorm and kv_a_layernorm keep RMSNorm's default)."""

    kv_rank: int
    nope: int
    v: int
    q_rank: int = 0
    interleave: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        for name in ("kv_rank", "nope", "v", "q_rank"):
            value, low = getattr(self, name), 0 if name == "q_rank" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"Latent.{name} must be an int >= {low}, got {value!r}")
