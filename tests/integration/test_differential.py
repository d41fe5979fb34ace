"""Differential verdict testing in cpu mode (issue 36): the honest candidates of
tests/candidates/differential, each leaning on one of pkb's own limits, get the same verdict alone and
side by side, with the sandbox full and off, at W = 2, 4 and 8, and the verdict each expects
(benchmarks/differential.py; its ``differential`` stage in benchmarks/gpu_proof.sh does the same in
shared-gpu mode on a GPU).

On this 2-core machine the two files that compile run where it costs least: ``torch.compile`` (half a
minute of C++ compilation per evaluation here) at W = 2 in the two arms farthest apart, an extension per
rank (a cold build per rank) at W = 2 and 4 (every W and arm under ``-m slow``). Every file runs in all four arms at
W = 2 (three minutes here: the default tier) and 4; at W = 8 alone with the full sandbox and side by side with none
(each property at W = 8; W = 4 and 8, and the four combinations at 8, under ``-m slow``). Side by side means
three evaluations at once: more than the cores hold, so failures for want of the machine happen and are
judged again alone.
"""

from __future__ import annotations


import pytest

from pkb.runtime.modes import Mode
from helpers.benchmarks import load

differential = load("differential")

FILES = sorted(differential.CORPUS.glob("*.py"))
LARGEST_W_HERE = {"1_allreduce_compiled": 2, "1_allreduce_extension_per_rank": 4}  # the compiling files
SIDE_BY_SIDE = 3


@pytest.fixture(scope="module")
def build_cache(tmp_path_factory):
    """One extension cache for the module: each arm builds what the others have not (the broker's cache and
    the unsandboxed one are apart), none of the user's caches touched."""
    return tmp_path_factory.mktemp("extensions")


ALL_ARMS = tuple(differential.ARMS)
FARTHEST_APART = ("alone", "sandbox-off-side-by-side")
FEWEST_ARMS = {"1_allreduce_compiled": FARTHEST_APART}  # outside -m slow: a cold compile per evaluation


@pytest.mark.parametrize("world_size, arms, every_file", [
    (2, ALL_ARMS, False), pytest.param(4, ALL_ARMS, False, marks=pytest.mark.slow),
    pytest.param(8, FARTHEST_APART, False, marks=pytest.mark.slow),
    pytest.param(4, ALL_ARMS, True, marks=pytest.mark.slow), pytest.param(8, ALL_ARMS, True, marks=pytest.mark.slow)])
def test_every_arrangement_gives_the_same_verdict(world_size, arms, every_file, build_cache, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(build_cache))
    files = [path for path in FILES if every_file or world_size <= LARGEST_W_HERE.get(path.stem, 8)]
    arms_of = {path.stem: arms if every_file else FEWEST_ARMS.get(path.stem, arms) for path in files}
    expected = {path.stem: differential.expected_verdict(path, Mode.CPU) for path in files}
    verdicts = {path.stem: {} for path in files}
    for arm in (differential.ARMS[name] for name in arms):
        judged_files = [path for path in files if arm.name in arms_of[path.stem]]
        judged, most_at_once = differential.judge(judged_files, Mode.CPU, world_size, arm, SIDE_BY_SIDE)
        if arm.side_by_side:
            assert most_at_once > 1, f"{arm.name}: nothing ran side by side, so nothing was compared"
        for name, verdict in judged.items():
            verdicts[name][arm.name] = verdict
    moved, unexpected = differential.compare(verdicts, expected)
    assert not moved and not unexpected, "\n".join(moved + unexpected)
    assert set(verdicts) == {path.stem for path in files}
    assert all(set(by_arm) == set(arms_of[name]) & set(arms) for name, by_arm in verdicts.items())
