"""The Hugging Face model families the zoo reads, one module each (models/families/
<model_type>.py): its config.json -> Config, its weight table, and layer options only
it needs. A new family is one module and one line here (docs/models.md says how)."""

from __future__ import annotations

from models.families import bert, gpt2, llama, mistral, qwen2, qwen3, t5
from models.families.common import Family

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        gpt2.FAMILY,
        llama.FAMILY,
        t5.FAMILY,
        bert.FAMILY,
        mistral.FAMILY,
        qwen2.FAMILY,
        qwen3.FAMILY,
    )
}
