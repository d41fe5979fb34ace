"""The candidate sandbox's checks that need no process (pkb.runtime.sandbox, builds): a candidate's build
request is checked before anything is built, and a scratch directory is removed whatever its modes. The
mechanisms at work in evaluations: tests/integration/test_sandbox.py.
"""

from __future__ import annotations

import os
import sys

import pytest

from pkb.runtime import sandbox
from pkb.runtime.builds import validated

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux's")


def test_build_requests_from_a_candidate_are_checked_before_anything_is_built():
    good = {"name": "ext", "arch": "9.0", "torch": "2.13", "python": "3.11", "cuda_sources": ["x"],
            "cpp_sources": [], "functions": ["f"], "with_cuda": True}
    assert validated(good)["cuda_sources"] == ["x"]
    for bad in ({**good, "name": "../../etc/evil"}, {**good, "cuda_sources": "not a list"},
                {**good, "extra_cflags": [1]}, {**good, "functions": "f"}, {**good, "arch": ""}, ["not", "a", "dict"]):
        with pytest.raises(ValueError):
            validated(bad)


def test_a_scratch_directory_is_removed_whatever_its_modes(tmp_path):
    scratch = tmp_path / "scratch"
    (scratch / "locked" / "deeper").mkdir(parents=True)
    (scratch / "locked" / "deeper" / "file").write_text("x")
    (scratch / "link").symlink_to(tmp_path)  # never followed
    (tmp_path / "outside").write_text("kept")
    os.chmod(scratch / "locked", 0)
    sandbox.remove_tree(str(scratch))
    assert not scratch.exists() and (tmp_path / "outside").read_text() == "kept"
