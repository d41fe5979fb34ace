"""The weights of the verifiers environment's rewards (pkb.rl.verifiers_env, issue 27): the timed rewards
weigh nothing without perf, a weight can be set, an unknown reward is refused; the retries of a file that got
no verdict (issue 56) are bounded. No server is asked: the environment asks nothing of one until its tasks load."""

from __future__ import annotations

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers 0.4 is not installed (pip install -e '.[rl]')")

from pkb.rl.common import NO_VERDICT_RETRIES  # noqa: E402
from pkb.rl.verifiers_env import REWARDS, load_environment  # noqa: E402


def test_the_weights_of_the_rewards():  # the rewards' values: tests/unit/test_rl_rewards.py (pkb.rl.common.rewards)
    def weights(**options):
        env = load_environment("http://127.0.0.1:9", **options)  # nothing is asked of a server until tasks load
        return {name: reward.weight for name, reward in env.taskset.config.task.rewards.items()}

    assert weights() == {"correctness": 1.0, "fast_1": 0.0, "log_speedup": 0.0, "roofline_fraction": 0.0}
    assert weights(perf=True) == dict.fromkeys(REWARDS, 1.0)
    assert weights(weights={"log_speedup": 0.5})["log_speedup"] == 0.5
    with pytest.raises(ValueError, match="unknown rewards"):
        weights(weights={"speed": 1.0})


def test_the_retries_of_a_file_without_a_verdict_are_bounded():
    def retries(**options):
        return load_environment("http://127.0.0.1:9", **options).taskset.config.task.no_verdict_retries

    assert retries() == NO_VERDICT_RETRIES and retries(no_verdict_retries=0) == 0
    with pytest.raises(ValueError, match="no_verdict_retries"):
        retries(no_verdict_retries=-1)
