"""The README's set-up works where users keep torch: an activated environment that holds torch, with no
package index reachable (an offline GPU node, a conda env), reuses that torch and runs pkb."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def environment_with_torch(root: Path) -> Path:
    """A fresh venv (not built with system site packages) whose site-packages holds torch and the other
    packages this test run has, but not pkb: what a user's CUDA env looks like to setup.sh."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    target = Path(subprocess.run([str(root / "bin" / "python"), "-c",
                                  "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip())
    ours = Path(sysconfig.get_paths()["purelib"])
    for entry in ours.iterdir():
        if entry.name.startswith(("pkb", "__editable__", "_pkb", "pytest", "_pytest")) or entry.suffix == ".pth":
            continue
        (target / entry.name).symlink_to(entry)
    return root


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to list the checkout's files")
def test_setup_reuses_the_active_environments_torch_without_a_package_index(tmp_path):
    checkout = tmp_path / "checkout"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True, text=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, checkout / name)
    env = environment_with_torch(tmp_path / "user-env")
    activated = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")},
                 "VIRTUAL_ENV": str(env), "PATH": f"{env / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
                 "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PKB_TORCH_SPEC": "torch==0.0.0-not-on-any-index"}
    setup = subprocess.run(["bash", "scripts/setup.sh"], cwd=checkout, env=activated, capture_output=True,
                           text=True, timeout=600)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert "ready in .venv" in setup.stdout and "not reachable" in setup.stderr, setup.stdout + setup.stderr

    found = subprocess.run([str(checkout / ".venv" / "bin" / "python"), "-c", "import pkb, torch; "
                            "print(pkb.__file__); print(torch.__file__)"], cwd=tmp_path, env=activated, capture_output=True,
                           text=True, check=True).stdout.split()
    assert Path(found[0]).is_relative_to(checkout), found  # pkb from this checkout, torch from the user's env
    assert Path(found[1]).resolve().is_relative_to(Path(sysconfig.get_paths()["purelib"]).resolve()), found

    run = subprocess.run([str(checkout / ".venv" / "bin" / "pkb"), "run", "--problems", "1", "--trials", "1",
                          "--db", str(tmp_path / "results.sqlite"), "--json"], cwd=checkout, env=activated,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert {(r["problem"], r["solution"], r["status"]) for r in json.loads(run.stdout)} >= {("allreduce", "reference", "ok")}
