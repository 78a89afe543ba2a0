"""The named configs: config.CONFIGS (the zoo's own, the paper's LM1B models and the
ecosystem's checkpoints) and the canonical checkpoints the family modules name (their
NAMED). Kept apart from models/architecture.py so that the Config record imports no family:
the families and hub import Config, and this catalog imports them (issue 42)."""

from __future__ import annotations

import functools

from models.architecture import CONFIGS, Config
from models.errors import UnknownConfigError


@functools.cache
def configs() -> dict[str, Config]:
    """CONFIGS and the canonical checkpoints the family modules name (their NAMED), each
    what models.io.hub makes of its config.json (batch 8, as ECOSYSTEM's). The families and
    hub load on first use, so that naming a config of CONFIGS stays light."""
    from models.families import NAMED
    from models.io.hub import family_config

    named = {n: family_config(f, keys, set(), f"<{n}>") for n, (f, keys) in NAMED.items()}
    return {**CONFIGS, **{n: c.replace(batch=8) for n, c in named.items()}}


def get(name: str, **changes) -> Config:
    """The config called `name`, with `changes` applied."""
    known = CONFIGS if name in CONFIGS else configs()
    if name not in known:
        raise UnknownConfigError(f"unknown config {name!r}; known: {', '.join(known)}")
    return known[name].replace(**changes)
