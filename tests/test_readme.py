"""The README's example and `make demo`'s script run as written."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_example_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    assert 15 <= len(blocks[0].strip().splitlines()) <= 30
    namespace: dict = {}
    for block in blocks:  # in order, in one namespace: later blocks use earlier names
        exec(compile(block, "README.md", "exec"), namespace)


def test_quickstart_commands_are_the_make_targets():
    text = (ROOT / "README.md").read_text()
    assert "make demo" in text and "make test" in text
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, flags=re.M) and re.search(r"^test:", makefile, re.M)
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("make test")


def test_demo_script_runs_and_agrees_with_numpy():
    out = subprocess.run(
        [sys.executable, "-m", "namedmesh.demo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "traced graph" in out.stdout and "einsum(" in out.stdout
    err = float(re.search(r"= ([0-9.e+-]+)", out.stdout.splitlines()[-1]).group(1))
    assert err < 1e-4


def test_ruff_is_clean():
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_make_demo_trains_on_a_2d_mesh_and_generates(tmp_path):
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:.*\n\t.*-m models\.cli\.demo\b", makefile, flags=re.M)
    out = subprocess.run(
        # two steps: the demo validates and saves every step of so short a run (8 steps
        # were 8 validations of 8 batches and 4 saves), and writes its plot from the first
        [sys.executable, "-m", "models.cli.demo", "--steps", "2", "--out", str(tmp_path / "demo")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "Mesh(rows=2, cols=4)" in out.stdout and "per-device flops" in out.stdout
    assert out.stdout.count("The assert statement") >= 2  # greedy and sampled samples
    assert (tmp_path / "demo" / "loss.png").read_bytes()[:4] == b"\x89PNG"
