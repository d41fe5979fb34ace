"""Builds beyond what the machine runs at once wait in the build broker's queue, never fail (issue 36); past
pkb's own bound on extensions per evaluation the refusal says it is pkb's limit. The broker's builds here are
stand-ins that take a set time (threads, no build process)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from pkb.runtime.builds import LIMIT_WORDS, BuildBroker


def _request(index: int) -> dict:
    return {"name": f"per_rank_r{index}", "arch": "9.0", "torch": "2.13", "python": "3.11",
            "cuda_sources": [f"// rank {index}"], "with_cuda": True}


class TimedBroker(BuildBroker):
    """A broker whose builds take ``seconds`` each and produce nothing."""

    def __init__(self, tmp_path, seconds: float, max_parallel: int):
        super().__init__(lambda scratch: None, cache_root=tmp_path, max_parallel=max_parallel)
        self.seconds = seconds
        self.most_at_once, self._now = 0, 0
        self._count = threading.Lock()

    def _build(self, full_name, request):
        with self._count:
            self._now += 1
            self.most_at_once = max(self.most_at_once, self._now)
        time.sleep(self.seconds)
        with self._count:
            self._now -= 1
        return {"path": f"/nowhere/{full_name}.so"}


def test_one_evaluation_may_ask_for_more_builds_than_run_at_once_and_they_all_wait_their_turn(tmp_path):
    """A solution that builds one extension per rank at W = 8 asks for 8 at once: before, the third was
    refused ("more than 2 extensions of different sources built at once") and the candidate failed."""
    broker = TimedBroker(tmp_path, seconds=0.2, max_parallel=2)
    owner, answers, done = object(), {}, threading.Event()

    def answer_for(index):
        def answer(reply):
            answers[index] = reply
            if len(answers) == 8:
                done.set()
        return answer

    for index in range(8):
        broker.request(_request(index), answer_for(index), owner=owner)
    assert broker.waiting_for(owner)  # 8 asked, 2 run: the others wait in the queue
    assert done.wait(30)
    assert all("path" in reply and "error" not in reply for reply in answers.values()), answers
    assert broker.most_at_once == 2 and not broker.waiting_for(owner)
    broker.close()


def test_past_pkbs_own_bound_the_refusal_says_it_is_pkbs_limit(tmp_path):
    broker = TimedBroker(tmp_path, seconds=0.0, max_parallel=4)
    owner, answers = object(), []
    for index in range(BuildBroker.MAX_SOURCES + 1):
        broker.request(_request(index), answers.append, owner=owner)
    deadline = time.monotonic() + 30
    while len(answers) < BuildBroker.MAX_SOURCES + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    refused = [reply for reply in answers if "error" in reply]
    assert len(refused) == 1 and refused[0]["error"].startswith(LIMIT_WORDS), refused
    assert refused[0]["limit"] == "extensions per evaluation"
    broker.close()


def test_a_build_waits_for_free_memory_but_not_forever_and_builds_share_the_processs_slots():
    """Builds at once, every process's, took a 24 GiB machine out of memory (cc1plus over torch's headers: about
    1.5 GiB each): a build starts once ``BUILD_MEMORY`` is free, or after its wait's limit; and one process's brokers
    share at most as many slots as its cores and memory hold."""
    from pkb.kernels.build import meminfo_bytes, wait_for_memory
    from pkb.runtime.builds import BUILD_MEMORY, build_slots

    if meminfo_bytes("MemAvailable") is None:
        pytest.skip("no /proc/meminfo here")
    began = time.monotonic()
    wait_for_memory(needed=1)
    assert time.monotonic() - began < 0.5
    wait_for_memory(needed=1 << 62, limit_s=0.6)  # more than any machine has: the limit, then the build goes ahead
    assert 0.6 <= time.monotonic() - began < 3
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 1 <= build_slots() <= max(1, min(os.cpu_count(), total // (2 * BUILD_MEMORY)))
