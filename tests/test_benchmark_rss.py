"""benchmarks/rss.py's memory of a step: each step measured alone in a fresh process
reads its own size, large then small; the same pair in one process, where the first
step's memory is freed during the second (as XLA:CPU frees a step's temporaries after
its outputs are ready), reads the second low, which `step_bytes` refuses to do."""

import sys

import pytest

from benchmarks import rss

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self (Linux)")
MIB = 2**20


@pytest.fixture(scope="module")
def fresh_pair():
    """A 256 MiB step, then a 32 MiB one, each in its own process."""
    return [rss.fresh("benchmarks.rss:known_step_bytes", [m], 120) for m in (256, 32)]


@pytest.mark.parametrize("index, mib", [(0, 256), (1, 32)])
def test_a_step_measured_in_its_own_process_reads_its_size(fresh_pair, index, mib):
    assert abs(fresh_pair[index] - mib * MIB) < 0.03 * mib * MIB + MIB


def test_the_second_step_in_one_process_reads_low_where_the_first_frees_late():
    """The fault of stop 50's run (PyTorch's step after namedmesh's read 19 MiB): the
    pages of the 32 MiB step come from the 256 MiB step's, freed after the reading began."""
    big, small = rss.fresh("benchmarks.rss:one_process", [256, 32], 120)
    assert abs(big - 256 * MIB) < 0.03 * 256 * MIB + MIB
    assert small < 8 * MIB


def test_step_bytes_refuses_a_second_measurement_in_one_process(monkeypatch):
    monkeypatch.setattr(rss, "measured", [])
    rss.step_bytes(lambda: None, "a first step")
    with pytest.raises(rss.MeasurementError, match="already measured a first step"):
        rss.step_bytes(lambda: None, "a second step")


def test_fresh_names_the_target_that_failed():
    with pytest.raises(rss.MeasurementError, match=r"benchmarks.rss\(1,\): exit status 1: "):
        rss.fresh("benchmarks.rss", [1], 120)  # no ":function"
