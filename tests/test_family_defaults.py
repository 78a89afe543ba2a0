"""A config.json key left out reads as transformers reads it: each family's `defaults`
(models/families/common.py Family) are its transformers config class's own, and a
config.json without any one of its keys gives the Config of the whole file, or a
DamagedFileError naming that key (the sizes), never another model. Config files
only: nothing is compiled."""

import dataclasses

import pytest

transformers = pytest.importorskip("transformers")

from models.families import FAMILIES  # noqa: E402
from models.io import hub  # noqa: E402

# every family's sizes, small, by the names its config class takes (the rest: defaults)
SIZES = dict(
    vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=32, n_embd=32, n_layer=2, n_head=4, n_positions=32, dim=32,
    n_layers=2, n_heads=4, hidden_dim=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
    num_heads=4, ffn_dim=64, max_position_embeddings=64,
)  # fmt: skip
OWN = {  # DeepSeek-V3's key/value heads are its query heads (its default 128 is not 32)
    "deepseek_v3": dict(num_key_value_heads=32),
    "gpt_neox": dict(num_attention_heads=4),  # a quarter of 16 dims rotated
}


def config_class(family: str):
    """transformers' config class of a model_type (its config module alone: no torch)."""
    return transformers.CONFIG_MAPPING[family]


def small(family: str) -> dict:
    """config.json of a small model of `family`, as transformers writes it: the sizes
    given, every other key its config class's default."""
    cls = config_class(family)
    fields = {f.name for f in dataclasses.fields(cls)}
    given = {k: v for k, v in SIZES.items() if k in fields} | OWN.get(family, {})
    return cls(**given).to_dict()


def field_default(cls, key):
    field = cls.__dataclass_fields__[key]
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_familys_defaults_are_its_transformers_config_defaults(family):
    """The values a family gives absent keys are those of transformers' config class
    (the rotary base: its default rope_parameters'); keys the class has no field for
    (Mistral's attention_bias) are options its model lacks, read as off."""
    cls = config_class(family)
    for key, value in FAMILIES[family].defaults.items():
        if key == "rope_theta":  # Gemma 3's: its global layers'
            rope = cls().rope_parameters
            assert value == rope.get("full_attention", rope)["rope_theta"], family
        elif key in cls.__dataclass_fields__:
            assert value == field_default(cls, key), (family, key)
        else:
            assert value in (False, 1), (family, key)  # off: no bias, no tensor-parallel split


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_key_left_out_reads_as_transformers_reads_it(family):
    """Each key of a small model's config.json that holds its default, dropped alone
    (transformers fills it in again): the same Config, or a DamagedFileError naming
    the key."""
    full, defaults = small(family), config_class(family)().to_dict()
    want = hub.family_config(family, dict(full), set())
    for key in sorted(k for k in full if k != "model_type" and defaults.get(k) == full[k]):
        stripped = {k: v for k, v in full.items() if k != key}
        try:
            got = hub.family_config(family, stripped, set())
        except hub.DamagedFileError as e:
            assert f"lacks the key '{key}'" in str(e), (key, e)
            continue
        assert got == want, key
