"""Time that is pkb's, not the candidate's (issue 36): the time a group's ranks spend waiting for the build
broker (its queue, its builds) is not counted against them; and a first call that compiles lazily (what it
started keeps using the CPU) is not cut short by the per-case time limit, while a hang still is. The broker
here is a stand-in that says how long the group waits; the compiler is a process that burns CPU. The broker's
queue: tests/unit/test_build_queue.py."""

from __future__ import annotations

import threading
import time
from multiprocessing import Pipe

import pytest

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import evaluate
from pkb.options import Status
from pkb.registry import get_problem
from pkb.runtime.builds import BuildBroker
from pkb.runtime.channel import send_reply
from pkb.runtime.group import RankGroup, RankTimeout, _Rank
from pkb.runtime.modes import Mode
from pkb.runtime.messages import Ack


class WaitingFor:
    """A stand-in broker that says the group waits for a build until ``until``."""

    MAX_SOURCES = BuildBroker.MAX_SOURCES

    def __init__(self, until: float):
        self.until = until

    def waiting_for(self, owner) -> bool:
        return time.monotonic() < self.until

    def release(self, owner) -> None:
        pass


def _group_answering_after(seconds: float, queued_s: float):
    """A one-rank group whose rank replies ``seconds`` from now, waiting ``queued_s`` of them for a build;
    and the rank's end of the channel."""
    group = RankGroup(Mode.CPU, 1, "candidate", broker=WaitingFor(time.monotonic() + queued_s))
    ours, theirs = Pipe()
    log = group._log_dir / "rank0.log"
    log.write_text("")
    group.ranks = [_Rank(0, None, ours, log)]
    group.ready, group._num_builds = True, 1
    def reply():
        try:
            send_reply(theirs, {"status": "ok"})
        except OSError:  # the group timed out and closed its end first
            pass

    threading.Timer(seconds, reply).start()
    return group, theirs


def test_time_waiting_for_the_build_broker_is_not_the_candidates():
    group, _rank_end = _group_answering_after(2.0, queued_s=1.8)
    assert group.collect(timeout=1.0, kind=Ack) == [Ack()]  # 2 s in all, 1.8 s of them waiting for builds


def test_time_outside_the_build_broker_still_counts():
    group, _rank_end = _group_answering_after(2.0, queued_s=0.0)
    with pytest.raises(RankTimeout):
        group.collect(timeout=1.0, kind=Ack)


COMPILES_ON_FIRST_CALL = """
import subprocess, sys
import torch.distributed as dist

_built = []


def solution(tensor):
    if not _built:  # a lazy build: a helper process that keeps a core busy for {seconds} s
        subprocess.run([sys.executable, "-S", "-c", "import time\\nend = time.time() + {seconds}\\n"
                        "while time.time() < end: pass"], check=True)
        _built.append(True)
    out = tensor.clone()
    dist.all_reduce(out)
    return out
"""
SLEEPS_ON_FIRST_CALL = """
import time
import torch.distributed as dist

_slept = []


def solution(tensor):
    if not _slept:
        time.sleep({seconds})
        _slept.append(True)
    out = tensor.clone()
    dist.all_reduce(out)
    return out
"""


@pytest.mark.parametrize("source, status", [(COMPILES_ON_FIRST_CALL, Status.OK), (SLEEPS_ON_FIRST_CALL, Status.TIMEOUT)])
def test_a_first_call_that_compiles_gets_the_time_a_load_gets_and_a_hang_does_not(source, status, tmp_path, sessions):
    path = tmp_path / "1_allreduce_lazy.py"
    path.write_text(source.format(seconds=8))
    config = EvalConfig(world_size=2, mode=Mode.CPU, trials=1, upstream_trials=1, cases="upstream", timeout=3.0)
    result = evaluate(get_problem("allreduce"), Candidate.from_file(path), config, sessions(2))
    assert result.status is status, result.message
    if status is Status.TIMEOUT:
        assert "did not finish within 3 s" in result.message
