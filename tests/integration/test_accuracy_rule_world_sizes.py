"""The accuracy rule's all-reduce scenarios (benchmarks/accuracy_rule.py) at W = 4 and 8, in bf16 and fp32: every
honest reduction order passes and every wrong answer fails (the unit tier runs W = 2). These start no process; they
sit here for their time (each world size judges the scenario's candidates over several trials)."""

from __future__ import annotations

import pytest

from helpers.accuracy_rule import wrong_all_reduce_verdicts


@pytest.mark.parametrize("world_size", [4, pytest.param(8, marks=pytest.mark.slow)])  # W = 8: 80 s here
def test_every_all_reduce_candidate_gets_the_verdict_it_deserves_at_larger_world_sizes(world_size):
    assert wrong_all_reduce_verdicts(world_size) == []
