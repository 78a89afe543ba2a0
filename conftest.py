"""Shared by tests/ and property_tests/: 8 simulated CPU devices (set before jax is imported),
one compilation cache for the session's subprocesses, and the hypothesis profiles (dev by
default, ci when CI=true, thorough on request)."""

import atexit
import gc
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# The suite compiles thousands of tiny programs and runs each a few times: most of its
# time is XLA's compiles, and a quarter to a third of a CPU compile's time is LLVM
# optimising loops over a few hundred elements. Tests compile without that (results may
# differ from -O3's in the last bit, e.g. a fused multiply-add: every oracle has a
# tolerance or compiles alike). Subprocesses inherit it: a test that sets its own device
# count appends that to XLA_FLAGS (the last of a repeated flag wins), so a run and its
# resume, or a launch and its in-process reference, compile alike.
TEST_XLA_FLAG = "--xla_backend_optimization_level=0"
if TEST_XLA_FLAG not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += f" {TEST_XLA_FLAG}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The command-line tests start many processes that compile the same programs (a run, then
# its resume; a training run, then generate on it): each process after the first loads
# them from this session's cache (jax's persistent compilation cache) instead of compiling
# again. Every compile, however short: a process's many small ones (a model's parameters
# drawn eagerly, op by op, per shape: 60-odd compiles of 0.1 s) were 5 of its 8 s of
# compiling when only those of 0.2 s or more were kept (an entry: some 8 KB). A fresh
# directory per session, removed at its end: no program outlives the code that made it.
# This process keeps compiling its own (below).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="namedmesh-test-compiles-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    import jax  # noqa: E402 (after XLA_FLAGS, which jax reads when its backend starts)

    jax.config.update("jax_compilation_cache_dir", None)  # this process: not cached

# The session holds a million long-lived Python objects (traced graphs, plans, compiled
# programs, the planner's memos) and the planner makes short-lived ones by the million:
# at the default thresholds (700, 10, 10) Python's cycle collector ran 17,000 times and
# rescanned the old objects 40 times in property_tests/test_lowering_props.py and
# tests/test_plan.py, 25 of their 131 s of CPU (6.6 s at these thresholds). Reference
# counting still frees everything at once; only cycles wait longer.
gc.set_threshold(50_000, 20, 100)

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


def _mappings() -> tuple[int, int] | None:
    """(this process's memory mappings, the kernel's limit on them), where /proc says."""
    try:
        with open("/proc/self/maps") as f:
            held = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return held, int(f.read())
    except (OSError, ValueError):
        return None


def pytest_runtest_teardown(item, nextitem):
    """Between test modules, jax's caches are emptied once the process holds half the
    memory mappings the kernel allows: every compiled XLA:CPU program the caches keep
    alive holds about 12, and at vm.max_map_count (65,530 by default) LLVM's next compile
    fails to map its code and the process dies of a segmentation fault (the whole suite
    in one process reached it in tests/test_scan.py on 2026-12-06). A program a fixture
    holds compiled (`.compile()`'s) is kept; a jitted function compiles again when next
    called."""
    if nextitem is not None and nextitem.module is item.module:
        return
    counts = _mappings()
    if counts is not None and counts[0] > counts[1] // 2:
        import jax

        jax.clear_caches()
        gc.collect()
