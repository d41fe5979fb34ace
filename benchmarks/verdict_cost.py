"""What one verdict costs, in cpu mode: the wall time of one evaluation of an honest candidate, and of its check
phase (every case's trials run and judged, both verdicts): the first in a session (its rank groups started, the
reference's answers and exact answers computed), then the next ones, which find the reference's answers kept (a
model's k samples of one problem). Prints measured numbers; asserts nothing but each evaluation's status.

Two evaluations (issue 53 asked for them, before and after its accuracy rule):
- ``allreduce``: the problem's own cases, an honest all-reduce that adds the ranks in the other order
  (tests/candidates/accuracy): every floating output goes through the accuracy rule.
- ``allgather``: one of the problem's benchmark cases, ``--allgather-case`` (by default bf16_16MiB: 8.4M elements per
  rank, an output of 33.6M at W = 4: compared whole now, sampled at 65,536 places before), upstream's own all-gather
  as the candidate.

Run it against another checkout of pkb by putting that checkout first on ``PYTHONPATH`` (the candidates are read
from this file's own tree):

    python benchmarks/verdict_cost.py --world-size 4 --repeats 5
    PYTHONPATH=/path/to/old/checkout python benchmarks/verdict_cost.py --world-size 4 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
from pathlib import Path

import torch

import pkb
from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import checked_cases, evaluate
from pkb.evaluate.session import Session
from pkb.options import Status
from pkb.problem import Case
from pkb.registry import get_problem
from pkb.runtime.modes import Mode

HERE = Path(__file__).resolve().parent.parent
UPSTREAM = Path(os.environ.get("PKB_UPSTREAM_DIR", HERE.parent / "shared" / "upstream"))


def one_case(problem, case: Case):
    """``problem`` with ``case``, one of its own cases (the ranks look it up by name), as its only test case."""
    benchmarks = tuple(other for other in problem.benchmarks if other.name != case.name)
    narrowed = type(problem)(**{**problem.__dict__, "tests": (case,), "benchmarks": benchmarks})
    object.__setattr__(narrowed, "module", problem.module)
    return narrowed


def phase(result, name: str) -> float:
    phases = result.details["phase_s"] if isinstance(result.details, dict) else result.details.phase_s
    return phases.get(name, float("nan"))


def measure(label: str, problem, candidate: Candidate, config: EvalConfig, trials: int, repeats: int) -> None:
    with Session(Mode.CPU, config.world_size) as session:
        first = evaluate(problem, candidate, config, session)  # the groups start, the reference's answers are made
        if first.status is not Status.OK:
            raise SystemExit(f"{label}: {first.status.value}: {first.message}")
        walls, checks = [], []
        for _ in range(repeats):
            result = evaluate(problem, candidate, config, session)
            if result.status is not Status.OK:
                raise SystemExit(f"{label}: {result.status.value}: {result.message}")
            walls.append(result.wall_s)
            checks.append(phase(result, "check"))
    cases = ", ".join(case.name for case in checked_cases(problem, config))
    print(f"{label} (W={config.world_size}, {trials} trials, cases {cases}): the first evaluation in the session "
          f"{first.wall_s:.2f} s (check phase {phase(first, 'check'):.2f} s); then {repeats} more, the reference's "
          f"answers kept: wall median {statistics.median(walls):.2f} s (min {min(walls):.2f}, max {max(walls):.2f}), "
          f"check phase median {statistics.median(checks):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--allgather-case", default="bf16_16MiB", help="a case of the all-gather's benchmarks")
    args = parser.parse_args()
    checkout = Path(pkb.__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    print(f"pkb from {checkout.name} at {commit}; {platform.machine()}, {os.cpu_count()} CPU cores, torch "
          f"{torch.__version__}; cpu mode (gloo): harness and judging times, not GPU performance")
    trials = "trials" if "trials" in EvalConfig.__dataclass_fields__ else "num_trials"  # its name before issue 55
    config = EvalConfig(world_size=args.world_size, mode=Mode.CPU, **{trials: args.trials})

    allreduce = get_problem("allreduce")
    honest = Candidate.from_file(HERE / "tests" / "candidates" / "accuracy" / "1_allreduce_reversed_order_in_bf16.py")
    measure("allreduce, the ranks added in the other order", allreduce, honest, config, args.trials, args.repeats)

    problem = get_problem("allgather")
    case = next(case for case in problem.benchmarks if case.name == args.allgather_case)
    upstream = Candidate.from_file(UPSTREAM / "reference" / "2_allgather.py")
    measure(f"allgather, {case['shape']} per rank, upstream's file", one_case(problem, case), upstream, config,
            args.trials, args.repeats)


if __name__ == "__main__":
    main()
