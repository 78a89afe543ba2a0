"""The Hugging Face model families the zoo reads, one module each (models/families/
<model_type>.py): its config.json -> Config, its weight table, and layer options only
it needs. A new family is one module and one line here (docs/models.md says how)."""

from __future__ import annotations

from models.families import (
    bert,
    deepseek_v3,
    distilbert,
    gemma,
    gemma2,
    gemma3_text,
    gpt2,
    gpt_neox,
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

_MODULES = (gpt2, llama, t5, bert, mistral, qwen2, qwen3, phi3, gpt_neox, opt, gemma, gemma2)
_MODULES += (gemma3_text, roberta, distilbert, deepseek_v3, mixtral, qwen2_moe, qwen3_moe)
FAMILIES: dict[str, Family] = {m.FAMILY.name: m.FAMILY for m in _MODULES}

# The canonical checkpoints a family module names (its NAMED: config.json keys), by name:
# (family, keys); models.catalog.configs makes each what models.hub makes of that file.
NAMED: dict[str, tuple[str, dict]] = {
    name: (m.FAMILY.name, keys) for m in _MODULES for name, keys in getattr(m, "NAMED", {}).items()
}
