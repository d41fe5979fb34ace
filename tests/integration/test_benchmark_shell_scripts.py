"""The shell scripts of benchmarks/ (the GPU proofs' stages) parse: ``bash -n`` on each. What they name and
the flags they pass: tests/unit/test_benchmark_scripts.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHELL_SCRIPTS = sorted(path for path in (REPO / "benchmarks").rglob("*.sh")
                       if "results" not in path.relative_to(REPO / "benchmarks").parts)


def test_benchmarks_has_shell_scripts():
    assert REPO / "benchmarks" / "gpu_proof.sh" in SHELL_SCRIPTS


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda path: str(path.relative_to(REPO)))
def test_shell_script_parses(script):
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, f"bash -n {script.relative_to(REPO)}: {checked.stderr}"
