"""Shared by tests/ and property_tests/: 8 simulated CPU devices (set before jax is imported),
the hypothesis profiles (dev by default, ci when CI=true, thorough on request), and the
count of lowered cases, summed over pytest-xdist's workers when `make test` runs two."""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "dev", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(  # derandomized: a CI run tests the same cases every time
    "ci",
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") == "true" else "dev")
)


_LOWERED_BY_WORKER: dict[str, int] = {}  # filled on xdist's controller as workers finish


def _lowered_cases() -> int:
    testing = sys.modules.get("namedmesh.testing")
    return testing.CASES["lowered"] if testing is not None else 0


def pytest_sessionfinish(session):
    """An xdist worker hands its count of lowered cases to the controller."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["lowered"] = _lowered_cases()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller adds up its workers' counts (pytest-xdist's hook)."""
    _LOWERED_BY_WORKER[node.gateway.id] = getattr(node, "workeroutput", {}).get("lowered", 0)


def pytest_terminal_summary(terminalreporter):
    """Report how many (program, mesh, layout) cases the property suites lowered and ran."""
    lowered = sum(_LOWERED_BY_WORKER.values()) if _LOWERED_BY_WORKER else _lowered_cases()
    if lowered:
        profile = settings._current_profile
        terminalreporter.write_line(
            f"lowered cases run: {lowered} (hypothesis profile {profile!r})"
        )
