"""shared-gpu mode checks every case (issue 28, item 6): only cpu mode leaves cases too slow on the CPU out,
and the reference runs on the inputs where the candidate does (no CPU copies in shared-gpu mode, so it
rounds as upstream's GPU reference does). The staging of CUDA tensors through host memory, in real gloo
groups: tests/integration/test_shared_gpu_staging.py.
"""

from __future__ import annotations

import pytest
import torch

from pkb.evaluate.config import EvalConfig
from pkb.evaluate.cases import checked_cases, left_out_cases
from pkb.registry import all_problems
from pkb.runtime.modes import Mode

SLOW_ON_CPU = ("importance_sampling_loss", "opensora_conv3d_allreduce", "magi1_cso_async_attention",
               "conv2d_boundary_exchange")


def test_only_cpu_mode_leaves_the_cases_slow_on_the_cpu_out():
    problems = all_problems()
    slow = {name for name, p in problems.items() if any(c.slow_on_cpu for c in p.upstream)}
    assert set(SLOW_ON_CPU) <= slow, slow
    for name in sorted(slow):
        problem = problems[name]
        for mode in (Mode.SHARED_GPU, Mode.CUDA):
            config = EvalConfig(world_size=2, mode=mode, cases="upstream")
            assert not left_out_cases(problem, config), (name, mode)
            assert {c.name for c in checked_cases(problem, config)} == {c.name for c in problem.cases("upstream", 2)}
        config = EvalConfig(world_size=2, mode=Mode.CPU, cases="upstream")
        assert [c.name for c in left_out_cases(problem, config)] == [c.name for c in problem.cases("upstream", 2)
                                                                      if c.slow_on_cpu], name


class _Reference:
    """A problem whose reference returns the inputs it was called with."""

    def __init__(self):
        self.reference = lambda *inputs: inputs


@pytest.mark.parametrize("mode", [Mode.SHARED_GPU, Mode.CPU])
def test_the_reference_runs_on_the_inputs_where_the_candidate_does(mode):
    """No CPU copies in shared-gpu mode: the reference rounds as upstream's GPU reference does."""
    from pkb.runtime import worker as worker_module

    worker = worker_module.Worker.__new__(worker_module.Worker)  # no device: only the inputs handed over are checked
    worker.mode, worker.role, worker.solution, worker.problem = mode, "reference", None, _Reference()
    inputs = (torch.ones(2), 3)
    outputs, called_with = worker.call(inputs)
    assert called_with is inputs and outputs == inputs
