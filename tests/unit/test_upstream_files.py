"""The upstream benchmark's own reference files and pkb's problems match one to one (issue 18): every problem
with an upstream number has its ``../shared/upstream/reference/<n>_<name>.py`` and an upstream case at each
of its world sizes. Skipped where the folder is absent (a user's clone has no ../shared). The files run as
candidates: tests/integration/test_upstream_corpus.py.
"""

from __future__ import annotations

import pytest

from pkb.registry import all_problems
from helpers.upstream import UPSTREAM_REFERENCE as CORPUS

FILES = {int(p.name.split("_", 1)[0]): p for p in CORPUS.glob("*.py")} if CORPUS.is_dir() else {}

pytestmark = pytest.mark.skipif(not FILES, reason=f"no upstream corpus at {CORPUS}")


def test_every_problem_has_an_upstream_file_and_an_upstream_case_at_each_world_size():
    problems = [p for p in all_problems().values() if p.category != "inter_node"]  # pkb's own have no upstream
    assert sorted(p.upstream_id for p in problems if p.upstream_id) == sorted(FILES)
    missing = [f"{p.name} W={w}" for p in problems for w in p.world_sizes if not p.cases("upstream", w)]
    assert not missing, f"no upstream case: {missing}"
