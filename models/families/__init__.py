"""The Hugging Face model families the zoo reads, one module each (models/families/
<model_type>.py): its config.json -> Config, its weight table, and layer options only
it needs. A new family is one module and one line here (docs/models.md says how)."""

from __future__ import annotations

from models.families import (
    bert,
    distilbert,
    gemma,
    gemma2,
    gemma3_text,
    gpt2,
    gpt_neox,
    llama,
    mistral,
    opt,
    phi3,
    qwen2,
    qwen3,
    roberta,
    t5,
)
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
        phi3.FAMILY,
        gpt_neox.FAMILY,
        opt.FAMILY,
        gemma.FAMILY,
        gemma2.FAMILY,
        gemma3_text.FAMILY,
        roberta.FAMILY,
        distilbert.FAMILY,
    )
}
