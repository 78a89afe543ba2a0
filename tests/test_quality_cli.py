"""benchmarks.quality's --layout: an unknown name is refused before anything trains,
naming it and the layouts there are."""

import pytest

from benchmarks import quality


def test_an_unknown_layout_is_refused_with_the_known_names(capsys):
    with pytest.raises(SystemExit) as exc:
        quality.main(["--layout", "one device", "--layout", "no such layout"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "no such layout" in err and "one device, bfloat16" in err
