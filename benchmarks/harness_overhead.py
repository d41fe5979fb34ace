"""How fast the harness itself is, in cpu mode. Prints measured numbers; asserts nothing.

1. A full correctness pass: every problem's reference against itself at W ranks, T trials, the way
   ``pkb run`` does it (one reference group, a fresh candidate group per evaluation).
2. The fixed overhead of one evaluation: ``evaluate`` of a one-element all-reduce (1 case, 1 trial)
   in a warm session, in a cold session (rank processes started from scratch), and the upstream
   harness's way: one fresh ``torchrun`` launch for the reference and one for the candidate per trial.

    python benchmarks/harness_overhead.py [--world-size 4] [--trials 3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pkb.loop import run_evaluations
from pkb.solution_files import plan
from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import evaluate
from pkb.evaluate.session import Session
from pkb.options import Status
from pkb.problem import Case
from pkb.registry import all_problems, get_problem
from pkb.runtime.modes import Mode
from pkb.store.db import ResultStore

TORCHRUN_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.randn(1)
dist.all_reduce(x)
dist.destroy_process_group()
"""


def full_pass(world_size: int, trials: int) -> None:
    config = EvalConfig(world_size=world_size, mode=Mode.CPU, trials=trials)
    evaluations = plan(all_problems().values(), solutions_dir=None, include_reference=True)
    evaluations = [evaluation for evaluation in evaluations if evaluation.candidate.is_reference]
    per_problem = []
    with tempfile.TemporaryDirectory() as tmp, ResultStore(Path(tmp) / "pass.sqlite") as store:
        started = time.monotonic()
        results = run_evaluations(evaluations, config, store, lambda _, result, resumed: per_problem.append(result))
        total = time.monotonic() - started
    failed = [r.problem for r in results if r.status not in (Status.OK, Status.SKIPPED)]
    slowest = sorted(per_problem, key=lambda r: -r.wall_s)[:5]
    print(f"full correctness pass: {len(results)} references at W={world_size}, {trials} trials: {total:.1f} s wall "
          f"({total / len(results):.2f} s per problem); failed: {failed or 'none'}")
    print("  slowest: " + ", ".join(f"{r.problem} {r.wall_s:.1f} s" for r in slowest))


def tiny_problem_overhead(world_size: int, repeats: int) -> None:
    problem = get_problem("allreduce")
    # One tiny case, one trial: what is left is the harness's own cost.
    one_case = type(problem)(**{**problem.__dict__, "tests": (Case("single", {"shape": (1,)}, tags=("tiny",)),)})
    object.__setattr__(one_case, "module", problem.module)
    config = EvalConfig(world_size=world_size, mode=Mode.CPU, trials=1)
    candidate = Candidate.reference_of(problem)

    with Session(Mode.CPU, world_size) as session:
        evaluate(one_case, candidate, config, session)  # start the groups once
        warm = []
        for _ in range(repeats):
            started = time.monotonic()
            assert evaluate(one_case, candidate, config, session).status is Status.OK
            warm.append(time.monotonic() - started)
    cold = []
    for _ in range(repeats):
        started = time.monotonic()
        assert evaluate(one_case, candidate, config).status is Status.OK
        cold.append(time.monotonic() - started)

    torchrun = Path(sys.executable).with_name("torchrun")
    launches = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "one_allreduce.py"
        script.write_text(TORCHRUN_SCRIPT)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for _ in range(repeats):
            started = time.monotonic()
            subprocess.run([str(torchrun), "--standalone", f"--nproc_per_node={world_size}", str(script)],
                           check=True, capture_output=True, env=env)
            launches.append(time.monotonic() - started)
    print(f"one evaluation (1 case, 1 trial, W={world_size}), median of {repeats}:")
    print(f"  pkb, warm session (reference group kept, candidate group pre-started): {statistics.median(warm) * 1e3:.0f} ms")
    print(f"  pkb, cold session (every rank process started for it):                 {statistics.median(cold) * 1e3:.0f} ms")
    launch = statistics.median(launches)
    print(f"  one fresh torchrun launch ({world_size} ranks, init + one all_reduce + exit): {launch * 1e3:.0f} ms")
    print(f"  upstream-style trial (a torchrun for the reference and one for the candidate): {2 * launch * 1e3:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-full-pass", action="store_true")
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
          f"torch {torch.__version__}; cpu mode (gloo): these are harness times, not GPU performance")
    if not args.skip_full_pass:
        full_pass(args.world_size, args.trials)
    tiny_problem_overhead(args.world_size, args.repeats)


if __name__ == "__main__":
    main()
