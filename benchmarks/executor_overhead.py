"""Evaluations per minute on this machine's executor and on a Ray cluster started here (``--executor ray``).

The same evaluations (each selected problem's reference as a candidate: every one is ``ok``, so the work per
evaluation is the harness's) run in rounds, each round into a fresh store so nothing is skipped as stored:
first with the local executor, then on a local Ray cluster with one slot (what Ray adds per
evaluation: the task round trip, the candidate's source shipped to the node), then with as many slots
as the node holds (``--slots``). Round 1 includes starting the rank processes (and the Ray actors);
the steady rate is the median of the later rounds. Prints a table; ``--out`` writes it as JSON.

    python benchmarks/executor_overhead.py [--mode cpu] [--world-size 2] [--problems 1-8] [--rounds 4]
        [--slots 1,auto] [--trials 1] [--out overhead.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pkb.executor import Evaluation
from pkb.loop import run_evaluations
from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.executor import LocalExecutor
from pkb.registry import select
from pkb.runtime.modes import Mode
from pkb.store.db import ResultStore


def rounds(make_executor, evaluations: list[Evaluation], config: EvalConfig, count: int) -> dict:
    """Run ``evaluations`` ``count`` times on one executor; seconds per round and the verdicts."""
    seconds, statuses = [], {}
    with make_executor() as executor, tempfile.TemporaryDirectory() as scratch:
        for number in range(count):
            with ResultStore(Path(scratch) / f"round{number}.sqlite") as store:
                began = time.monotonic()
                results = run_evaluations(evaluations, config, store, executor=executor)
                seconds.append(time.monotonic() - began)
            for result in results:
                statuses[result.status.value] = statuses.get(result.status.value, 0) + 1
    steady = statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0]
    return {"round_s": [round(s, 3) for s in seconds], "first_round_s": round(seconds[0], 3),
            "steady_round_s": round(steady, 3), "evaluations_per_minute": round(60 * len(evaluations) / steady, 1),
            "statuses": statuses}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="cpu", choices=["cpu", "shared-gpu", "cuda"])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--problems", default="1-8")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--slots", default="1,auto", help="Ray slot counts to measure (auto: as many as fit)")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    import ray

    from pkb.executor.ray_cluster import RayExecutor

    config = EvalConfig(world_size=args.world_size, mode=Mode(args.mode), trials=args.trials)
    evaluations = [Evaluation(p, Candidate.reference_of(p), "reference") for p in select(args.problems)
            if args.world_size in p.world_sizes]
    rows = [{"executor": "local", "slots": 1, **rounds(LocalExecutor, evaluations, config, args.rounds)}]
    print(f"{len(evaluations)} evaluations per round, {args.mode} mode, W={args.world_size}, {args.trials} trial(s); "
          f"{os.cpu_count()} CPUs", flush=True)
    print(f"local: {rows[0]}", flush=True)

    began = time.monotonic()
    ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    cluster_start_s = time.monotonic() - began
    try:
        for slots in args.slots.split(","):
            parallel = None if slots == "auto" else int(slots)
            with RayExecutor(parallel=parallel) as probe:
                count = probe.capacity(config)
            row = {"executor": "ray", "slots": count,
                   **rounds(lambda: RayExecutor(parallel=parallel), evaluations, config, args.rounds)}
            rows.append(row)
            print(f"ray, {count} slot(s): {row}", flush=True)
    finally:
        ray.shutdown()

    local_steady = rows[0]["steady_round_s"]
    print(f"\nRay cluster start on this machine: {cluster_start_s:.1f} s")
    print(f"{'executor':<10} {'slots':>5} {'round 1 s':>10} {'steady s':>9} {'eval/min':>9} {'vs local':>9}  verdicts")
    for row in rows:
        print(f"{row['executor']:<10} {row['slots']:>5} {row['first_round_s']:>10.2f} {row['steady_round_s']:>9.2f} "
              f"{row['evaluations_per_minute']:>9.1f} {local_steady / row['steady_round_s']:>8.2f}x  {row['statuses']}")
    one_slot = next((r for r in rows if r["executor"] == "ray" and r["slots"] == 1), None)
    if one_slot:
        added_ms = 1000 * (one_slot["steady_round_s"] - local_steady) / len(evaluations)
        print(f"Ray adds {added_ms:.0f} ms per evaluation at one slot (steady rounds)")
    if args.out:
        args.out.write_text(json.dumps({"mode": args.mode, "world_size": args.world_size, "trials": args.trials,
                                        "evaluations_per_round": len(evaluations), "cpus": os.cpu_count(),
                                        "machine": platform.machine(), "ray": ray.__version__,
                                        "cluster_start_s": round(cluster_start_s, 2), "rows": rows}, indent=1))
    bad = [r for r in rows if set(r["statuses"]) - {"ok", "skipped"}]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
