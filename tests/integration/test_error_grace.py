"""After one rank fails, the others get a grace to report failures of their own (pkb.runtime.group,
``ERROR_GRACE_S``). It ends at once when every process of the group is asleep (the others wait in a
collective the failed rank never joins), and lasts while a rank still computes, so that a rank that fails
on its own is named as itself, not as stuck. The grace is made long here (30 s): a wait for all of it
would show."""

from __future__ import annotations

import time

import pytest

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import evaluate
from pkb.options import Status
from pkb.registry import get_problem
from pkb.runtime import group as group_module
from pkb.runtime.modes import Mode

LONG_GRACE_S = 30.0

STUCK_BEHIND = '''
import torch.distributed as dist
from {module} import reference


def solution(*args):
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gave up")
    return reference(*args)  # rank 0 waits in the all-reduce for rank 1
'''

FAILS_LATER_ON_ITS_OWN = '''
import time
import torch.distributed as dist


def solution(*args):
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gave up")
    end = time.monotonic() + 1.5  # rank 0 computes, then fails for a reason of its own
    while time.monotonic() < end:
        pass
    raise KeyError("rank 0 failed too")
'''


def judge(source: str, sessions, tmp_path):
    problem = get_problem("allreduce")
    path = tmp_path / "candidate.py"
    path.write_text(source.replace("{module}", problem.module))
    config = EvalConfig(world_size=2, mode=Mode.CPU, trials=1, cases="tests", timeout=60.0)
    began = time.monotonic()
    result = evaluate(problem, Candidate.from_file(path), config, sessions(2))
    return result, time.monotonic() - began


@pytest.fixture
def long_grace(monkeypatch):
    monkeypatch.setattr(group_module, "ERROR_GRACE_S", LONG_GRACE_S)


def test_ranks_stuck_behind_a_failed_rank_are_given_up_without_waiting_out_the_grace(long_grace, sessions, tmp_path):
    result, seconds = judge(STUCK_BEHIND, sessions, tmp_path)
    assert result.status is Status.RUNTIME_ERROR, result.message
    assert "rank 1, case" in result.message and "rank 1 gave up" in result.message, result.message
    assert seconds < LONG_GRACE_S / 2, f"{seconds:.1f} s: the grace was waited out though rank 0 was asleep"


def test_a_rank_still_computing_reports_its_own_failure(long_grace, sessions, tmp_path):
    result, seconds = judge(FAILS_LATER_ON_ITS_OWN, sessions, tmp_path)
    assert result.status is Status.RUNTIME_ERROR, result.message
    # rank 0's own error arrived (the lowest rank that failed itself is named): it was not cut short as stuck
    assert "rank 0, case" in result.message and "rank 0 failed too" in result.message, result.message
    assert seconds < LONG_GRACE_S / 2, f"{seconds:.1f} s"
