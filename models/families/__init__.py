"""The Hugging Face model families the zoo reads, one module each (models/families/
<model_type>.py): its config.json -> Config, its weight table, and its own parts (the
options only it has: models/parts.py). A new family is one module and its name in the
import below: every module imported here that has a FAMILY is registered, by name
(docs/models.md says how)."""

from __future__ import annotations

from types import ModuleType

from models.families import (
    bert,
    deepseek_v3,
    distilbert,
    gemma,
    gemma2,
    gemma3_text,
    gpt2,
    gpt_neox,
    granite,
    llama,
    mistral,
    mixtral,
    opt,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
    roberta,
    t5,
)
from models.families.common import Family

_MODULES = sorted(
    (m for m in dict(globals()).values() if isinstance(m, ModuleType) and hasattr(m, "FAMILY")),
    key=lambda m: m.FAMILY.name,
)
FAMILIES: dict[str, Family] = {m.FAMILY.name: m.FAMILY for m in _MODULES}

# The canonical checkpoints a family module names (its NAMED: config.json keys), by name:
# (family, keys); models.catalog.configs makes each what models.io.hub makes of that file.
NAMED: dict[str, tuple[str, dict]] = {
    name: (m.FAMILY.name, keys) for m in _MODULES for name, keys in getattr(m, "NAMED", {}).items()
}
