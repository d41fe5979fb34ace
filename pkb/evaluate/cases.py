"""Which cases an evaluation checks: the ``--cases`` selection at the run's world size, precision and nodes, without
the cases too slow where the reference runs on the CPU (left out in ``cpu`` mode, and the result says so)."""

from __future__ import annotations

from pkb.evaluate.config import EvalConfig
from pkb.options import CASE_SELECTIONS, Mode
from pkb.problem import Case, Problem


def checked_cases(problem: Problem, config: EvalConfig) -> tuple[Case, ...]:
    """The cases the correctness trials run, as ``config.cases`` selects them (without the cases that
    are too slow where the reference runs on the CPU: ``left_out_cases``)."""
    return tuple(case for case in _selected_cases(problem, config) if not _left_out(case, config))


def left_out_cases(problem: Problem, config: EvalConfig) -> tuple[Case, ...]:
    return tuple(case for case in _selected_cases(problem, config) if _left_out(case, config))


def _left_out(case: Case, config: EvalConfig) -> bool:
    """Too slow to check where the reference runs on the CPU: cpu mode (the others run it on the GPU:
    pkb.runtime.worker.Worker.call)."""
    return case.slow_on_cpu and config.mode is Mode.CPU


def _selected_cases(problem: Problem, config: EvalConfig) -> tuple[Case, ...]:
    return tuple(case for kind in CASE_SELECTIONS[config.cases]
                 for case in problem.cases(kind, config.world_size, config.dtype, config.nodes))
