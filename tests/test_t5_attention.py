"""Issue 26, class 5: T5's bucketed relative bias (one (heads, length, memory) table per
stack) cannot travel round a ring with the key blocks (ring_attend refuses a bias over
both), so Config refuses ring attention with it, naming both, where it accepted it and
every T5 model then failed with a ShapeError."""

import pytest

from models import catalog
from models.architecture import ConfigError


@pytest.mark.parametrize("name", ["t5-small", "t5-v1_1-small"])
def test_ring_attention_with_t5_buckets_is_a_config_error_naming_both(name):
    cfg = catalog.get(name)
    with pytest.raises(ConfigError, match=r"attention='ring'.*relative_buckets=32.*blockwise"):
        cfg.replace(attention="ring")
    assert cfg.replace(attention="blockwise").attention == "blockwise"
