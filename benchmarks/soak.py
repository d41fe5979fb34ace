"""Soak test of the harness itself: many consecutive evaluations of honest candidates, some runs side by side.

Every candidate here is correct (each problem's reference run as a candidate, the portable shipped
all-reduce, honest point-to-point all-to-alls), so anything but ``ok`` (or ``skipped``) is a
failure the harness caused. Evaluations alternate W = 2 and W = 4 over the whole suite in ``cpu``
mode; a share of them runs as ``--parallel`` separate processes at once (separate sessions, ports,
temp files), as users do to save time. Prints the count of harness-caused failures and the wall time.

    python benchmarks/soak.py [--evaluations 1000] [--parallel 4] [--parallel-share 0.4] [--out soak.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from pkb.executor import Evaluation
from pkb.loop import EvaluationLoop
from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.options import Status
from pkb.registry import all_problems, get_problem
from pkb.runtime.modes import Mode
from pkb.store.db import ResultStore

HERE = Path(__file__).resolve().parent
HONEST_FILES = {"alltoall": ["tests/candidates/p2p_batched.py", "tests/candidates/p2p_isend_irecv.py",
                             "tests/candidates/p2p_group_ops.py"],
                "allreduce": ["pkb/solutions/1_allreduce_two_step.py"]}


def evaluation_list(count: int, offset: int) -> list[tuple[str, str, int]]:
    """``count`` (problem, candidate, world size) evaluations, cycling over the suite from ``offset``."""
    base = []
    for world_size in (2, 4):
        for problem in all_problems().values():
            if world_size in problem.world_sizes:
                base.append((problem.name, "reference", world_size))
                base += [(problem.name, path, world_size) for path in HONEST_FILES.get(problem.name, [])]
    cycle = itertools.islice(itertools.cycle(base), offset, offset + count)
    return list(cycle)


def run_evaluations(evaluations: list[tuple[str, str, int]], trials: int) -> list[dict]:
    """Evaluate each of ``evaluations`` one after another through pkb's evaluation loop, each afresh (a repeat is
    judged again, never answered from the store), rank groups kept warm per world size."""
    config = EvalConfig(world_size=2, mode=Mode.CPU, trials=trials)
    rows = []
    with tempfile.TemporaryDirectory() as scratch, ResultStore(Path(scratch) / "soak.sqlite") as store, \
            EvaluationLoop(store, config, reuse="never") as loop:
        for index, (problem_name, candidate_name, world_size) in enumerate(evaluations):
            problem = get_problem(problem_name)
            candidate = (Candidate.reference_of(problem) if candidate_name == "reference"
                         else Candidate.from_file(HERE.parent / candidate_name))
            loop.submit(Evaluation(problem, candidate, "soak", replace(config, world_size=world_size), tag=index))
        for stored in loop.finished():
            problem_name, candidate_name, world_size = evaluations[stored.evaluation.tag]
            rows.append({"problem": problem_name, "candidate": candidate_name, "world_size": world_size,
                         "status": stored.result.status.value, "message": stored.result.message[:300],
                         "wall_s": round(stored.result.wall_s, 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--evaluations", type=int, default=1000)
    parser.add_argument("--parallel", type=int, default=4, help="evaluation processes side by side in phase 2")
    parser.add_argument("--parallel-share", type=float, default=0.4, help="share of the evaluations run side by side")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", nargs=2, type=int, metavar=("COUNT", "OFFSET"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_evaluations(evaluation_list(*args.worker), args.trials)))
        return 0

    started = time.monotonic()
    side_by_side = int(args.evaluations * args.parallel_share) // args.parallel * args.parallel
    sequential = args.evaluations - side_by_side
    rows = run_evaluations(evaluation_list(sequential, 0), args.trials)
    sequential_s = time.monotonic() - started
    print(f"phase 1: {len(rows)} evaluations one after another in {sequential_s:.1f} s", flush=True)

    began = time.monotonic()
    share = side_by_side // args.parallel if args.parallel else 0
    processes = [subprocess.Popen([sys.executable, __file__, "--worker", str(share), str(sequential + i * share),
                                   "--trials", str(args.trials)], stdout=subprocess.PIPE, text=True)
                 for i in range(args.parallel if share else 0)]
    for process in processes:
        out, _ = process.communicate()
        try:
            rows += [{**row, "side_by_side": True} for row in json.loads(out)]
        except json.JSONDecodeError:  # a whole process lost: every evaluation it had counts as failed
            rows += [{"status": "lost", "message": f"worker process exited {process.returncode}", "side_by_side": True}] * share
    parallel_s = time.monotonic() - began
    print(f"phase 2: {side_by_side} evaluations in {len(processes)} processes side by side in {parallel_s:.1f} s")

    good = {Status.OK.value, Status.SKIPPED.value}
    failures = [row for row in rows if row["status"] not in good]
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    total_s = time.monotonic() - started
    print(f"{len(rows)} evaluations of honest candidates in {total_s:.1f} s: "
          + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    print(f"harness-caused failures: {len(failures)} of {len(rows)}")
    for row in failures[:20]:
        print(f"  {row.get('problem')} / {row.get('candidate')} W={row.get('world_size')}: {row['status']}: {row['message']}")
    if args.out:
        args.out.write_text(json.dumps({"evaluations": len(rows), "failures": len(failures), "wall_s": total_s,
                                        "sequential_s": sequential_s, "side_by_side_s": parallel_s,
                                        "parallel": args.parallel, "counts": counts, "rows": rows}, indent=1))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
