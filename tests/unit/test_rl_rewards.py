"""The rewards a verdict gives the RL environments (pkb.rl.common.rewards, issue 27): correctness, the paper's
verdict, fast_1, a capped log speedup and the roofline fraction, for timed and untimed verdicts and none."""

from __future__ import annotations

from pkb.rl.common import REWARDS, rewards


def test_rewards_of_timed_and_untimed_verdicts():
    timed = {"status": "ok", "upstream_ok": True, "speedup": 16.0, "roofline_fraction": 1.3}
    assert rewards(timed, log_speedup_cap=3.0) == {"correctness": 1.0, "upstream_ok": 1.0, "fast_1": 1.0,
                                                   "log_speedup": 1.0, "roofline_fraction": 1.0}
    slower = {**timed, "speedup": 0.5, "roofline_fraction": 0.25}
    assert rewards(slower) == {"correctness": 1.0, "upstream_ok": 1.0, "fast_1": 0.0, "log_speedup": 0.0,
                               "roofline_fraction": 0.25}
    wrong_but_paper_ok = {**timed, "status": "mismatch"}  # fails a stricter pkb case, passes upstream's
    assert rewards(wrong_but_paper_ok) == {**dict.fromkeys(REWARDS, 0.0), "upstream_ok": 1.0}
    assert rewards(None) == dict.fromkeys(REWARDS, 0.0)
