"""benchmarks/accuracy_rule.py's scenarios (``SIM``), run as whole evaluations of pkb's accuracy rule in the parent
alone: shared by tests/unit/test_accuracy_rule.py (W = 2) and the integration tier's W = 4 and 8."""

from __future__ import annotations


import torch

from helpers.benchmarks import load

SIM = load("accuracy_rule")


def outcomes(scenario, settings, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for name, (honest, make) in scenario.candidates.items():
        for world_size, dtype in settings:
            passed = SIM.evaluation(scenario, make, world_size, dtype, gen)
            if passed is not None:
                yield name, honest, world_size, dtype, passed


def wrong_all_reduce_verdicts(world_size: int) -> list:
    """The all-reduce candidates whose verdict at ``world_size`` (bf16 and fp32) is not what they deserve."""
    return [(name, str(dtype), passed) for name, honest, _, dtype, passed
            in outcomes(SIM.ALLREDUCE, [(world_size, d) for d in (torch.bfloat16, torch.float32)], world_size)
            if passed != honest]


