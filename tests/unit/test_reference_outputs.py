"""The reference's replies a session keeps (``pkb.evaluate.session.ReferenceOutputs``): by key, the largest dropped
first (the least recently used of equals) once their tensors pass the limit, none kept that alone is larger."""

from __future__ import annotations

import torch

from pkb.evaluate.session import ReferenceOutputs


def replies(megabytes: int) -> list[dict]:
    return [{"outputs": [torch.zeros(megabytes << 18)], "inputs_after": {"x": 1.0}}]  # fp32: 4 bytes each


def test_replies_are_kept_by_key_and_the_least_recently_used_go_first():
    kept = ReferenceOutputs(max_bytes=3 << 20)
    first, second = replies(1), replies(1)
    kept.put(("p", 1, "case", "bf16", 1, 0), first)
    kept.put(("p", 1, "case", "bf16", 1, 1), second)
    assert kept.get(("p", 1, "case", "bf16", 1, 0)) is first  # now the most recently used
    assert kept.get(("p", 1, "case", "bf16", 1, 2)) is None
    kept.put(("p", 1, "case", "bf16", 1, 2), replies(1))
    kept.put(("p", 1, "case", "bf16", 1, 3), replies(1))  # 4 MiB in all: the least recently used of equals goes
    assert kept.get(("p", 1, "case", "bf16", 1, 1)) is None
    assert kept.get(("p", 1, "case", "bf16", 1, 0)) is first
    assert kept.num_bytes == 3 << 20 and (kept.hits, kept.misses) == (2, 2)


def test_a_reply_larger_than_the_limit_is_not_kept():
    kept = ReferenceOutputs(max_bytes=1 << 20)
    kept.put(("p", 1, "case", "bf16", 1, 0), replies(2))
    assert kept.get(("p", 1, "case", "bf16", 1, 0)) is None and kept.num_bytes == 0


def test_the_largest_go_first_so_that_small_answers_stay_kept():
    """Candidates evaluated one after another on cases whose answers together pass the limit: the least recently used
    alone would drop each answer just before it is asked for again, the small ones included."""
    kept = ReferenceOutputs(max_bytes=16 << 20)
    keys = [("p", 1, case, "bf16", 1, 0) for case in ("large", "small", "large2", "small2")]
    for _ in range(2):  # two candidates, each asking for every case in turn
        for key in keys:
            if kept.get(key) is None:
                kept.put(key, replies(9 if key[2].startswith("large") else 1))
    assert (kept.hits, kept.misses) == (2, 6)  # the small ones kept for the second candidate
    assert kept.num_bytes == 11 << 20  # and the last large one
