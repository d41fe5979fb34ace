"""One solution folder through ``pkb run``, one evaluation at a time and side by side. Prints measured
numbers; asserts nothing.

Each arm is the command a user types (``pkb run --solutions FOLDER``) in a process of its own, into a
fresh database, with fresh extension and Triton caches (every build is cold in both arms): first side
by side (``--parallel N``, or this machine's default), then one at a time (``--parallel 1``), so
that the sequential arm, not the parallel one, gets whatever the first warmed (the page cache, the
compilers' files). The verdicts of the two arms are compared file by file: the status and the paper
verdict (``upstream_ok``) must be the same.

    python benchmarks/parallel_run.py FOLDER [--mode cpu] [--world-size 2] [--parallel N] [--trials 3]
        [--timeout-s 560] [--arm both|side|alone] [--out FILE.json]

``--arm side`` or ``alone`` runs one arm only (a long one-at-a-time arm timed in parts: the parts' walls
add up to it; compile_bound_folder.py --part writes them).
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_arm(folder: Path, mode: str, world_size: int, parallel: int | None, trials: int, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="pkb-parallel-") as scratch:
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": f"{scratch}/extensions", "TRITON_CACHE_DIR": f"{scratch}/triton"}
        db = f"{scratch}/results.sqlite"
        command = [sys.executable, "-m", "pkb.cli", "run", "--solutions", str(folder), "--db", db, "--mode", mode,
                   "--world-size", str(world_size), "--trials", str(trials), "--quiet"]
        if parallel is not None:
            command += ["--parallel", str(parallel)]
        began = time.monotonic()
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
        wall_s = time.monotonic() - began
        if not Path(db).exists():
            raise SystemExit(f"pkb run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        with sqlite3.connect(db) as connection:
            rows = connection.execute("SELECT problem, solution, status, upstream_ok, wall_s, result_json "
                                      "FROM results").fetchall()
    phases: dict[str, float] = {}  # summed over the evaluations: where their time went (start, load, check, time)
    for row in rows:
        for phase, seconds in json.loads(row[5]).get("details", {}).get("phase_s", {}).items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    return {"parallel": parallel, "wall_s": wall_s, "exit": done.returncode,
            "executor": next((line for line in done.stderr.splitlines() if line.startswith("executor:")), ""),
            "verdicts": {f"{problem}/{solution}": [status, upstream_ok] for problem, solution, status, upstream_ok, *_ in rows},
            "evaluation_s": sum(row[4] for row in rows), "phase_s": phases}


def summary(arm: dict) -> str:
    counts: dict[str, int] = {}
    for status, _ in arm["verdicts"].values():
        counts[status] = counts.get(status, 0) + 1
    return ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--mode", default="cpu", choices=["cpu", "shared-gpu", "cuda"])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--parallel", type=int, help="the side-by-side arm's --parallel (default: the machine's)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=560, help="seconds one arm may take")
    parser.add_argument("--arm", default="both", choices=["both", "side", "alone"],
                        help="both arms (default), or only the side-by-side or the one-at-a-time one")
    parser.add_argument("--out", help="write the numbers as JSON here")
    args = parser.parse_args()
    files = sorted(p.name for p in args.folder.glob("*.py") if not p.name.startswith("_"))
    print(f"{args.folder.name}: {len(files)} files; {args.mode} mode, W = {args.world_size}, {args.trials} trials; "
          f"{os.cpu_count()} cores" + (" (times in this mode are not GPU performance)" if args.mode != "cuda" else ""),
          flush=True)
    arms = []
    for parallel in {"both": (args.parallel, 1), "side": (args.parallel,), "alone": (1,)}[args.arm]:
        arm = run_arm(args.folder, args.mode, args.world_size, parallel, args.trials, args.timeout_s)
        arms.append(arm)
        print(f"--parallel {parallel or '(default)'}: {arm['wall_s']:.1f} s wall, {arm['evaluation_s']:.1f} s of evaluations "
              f"summed ({', '.join(f'{phase} {seconds:.1f}' for phase, seconds in arm['phase_s'].items())}); "
              f"{summary(arm)}; exit {arm['exit']}; {arm['executor']}", flush=True)
    if args.arm != "both":
        if args.out:
            Path(args.out).write_text(json.dumps({"folder": args.folder.name, "mode": args.mode, "world_size": args.world_size,
                                                  "trials": args.trials, "cores": os.cpu_count(), "arms": arms}, indent=1))
        return
    side, alone = arms
    differ = sorted(key for key in alone["verdicts"].keys() | side["verdicts"].keys()
                    if alone["verdicts"].get(key) != side["verdicts"].get(key))
    speedup = alone["wall_s"] / side["wall_s"]
    print(f"side by side {speedup:.2f}x faster than one at a time ({alone['wall_s']:.1f} s -> {side['wall_s']:.1f} s); "
          f"verdicts {'identical' if not differ else 'DIFFER'} on {len(alone['verdicts'])} evaluations")
    for key in differ:
        print(f"  {key}: one at a time {alone['verdicts'].get(key)}, side by side {side['verdicts'].get(key)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"folder": args.folder.name, "mode": args.mode, "world_size": args.world_size,
                                              "trials": args.trials, "cores": os.cpu_count(), "arms": arms,
                                              "speedup": speedup, "differ": differ}, indent=1))


if __name__ == "__main__":
    main()
