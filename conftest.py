"""Shared by tests/ and property_tests/: 8 simulated CPU devices (set before jax is imported)
and the hypothesis profiles (dev by default, ci when CI=true, thorough on request)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "dev", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(  # derandomized: a CI run tests the same cases every time
    "ci",  # 200: the suite's 30-minute budget on CI's 2 cores (300 took 34 minutes there)
    max_examples=200,
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


def pytest_terminal_summary(terminalreporter):
    """Report how many (program, mesh, layout) cases the property suites lowered and ran."""
    import sys

    testing = sys.modules.get("namedmesh.testing")
    if testing is not None:
        profile = settings._current_profile
        terminalreporter.write_line(
            f"lowered cases run: {testing.CASES['lowered']} (hypothesis profile {profile!r})"
        )
