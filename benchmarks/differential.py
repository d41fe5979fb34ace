"""Differential verdict testing: the same honest candidates judged in every arrangement pkb offers, where
every verdict must be the same (docs/architecture.md, "Invariance"; issue 36).

The corpus (default ``tests/candidates/differential``) holds honest candidates that lean on pkb's own
limits; each declares the verdict it must get per mode (``EXPECTED``). Every file is judged in each *arm*
(alone or side by side, the sandbox at ``auto`` or ``off``) at each world size, through pkb's evaluation
loop (``pkb run``'s), with a fresh results database per arm. A verdict is the status and the paper's
verdict (``upstream_ok``). Printed: one line per file and world size with its verdict in every arm, and
the evaluations that were judged again alone (``rerun_alone``); ``--out`` writes it all as JSON.

    python benchmarks/differential.py [--mode cpu] [--world-sizes 2,4,8] [--arms alone,side-by-side,...]
        [--parallel N] [--files 'GLOB'] [--out results.json]

Exit status 0 when every file got its expected verdict in every arm; 1 when a verdict moved between
arms or differs from what the file expects (pkb's bug until shown otherwise).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pkb.executor import Evaluation
from pkb.loop import run_evaluations
from pkb.solution_files import match_file
from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.executor import LocalExecutor, default_parallel
from pkb.registry import all_problems
from pkb.runtime.modes import Mode
from pkb.store.db import ResultStore

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "candidates" / "differential"


@dataclass(frozen=True)
class Arm:
    """One arrangement: how many evaluations at once, and the sandbox level."""

    name: str
    side_by_side: bool
    sandbox: str


ARMS = {arm.name: arm for arm in (Arm("alone", False, "auto"), Arm("side-by-side", True, "auto"),
                                  Arm("sandbox-off", False, "off"), Arm("sandbox-off-side-by-side", True, "off"))}


def expected_verdict(path: Path, mode: Mode) -> str:
    """The verdict ``path`` declares for ``mode`` (its literal ``EXPECTED`` dict), read without importing it."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EXPECTED" for t in node.targets):
            return ast.literal_eval(node.value)[mode.value]
    raise ValueError(f"{path.name} declares no EXPECTED verdicts")


def judge(files: list[Path], mode: Mode, world_size: int, arm: Arm, parallel: int,
          trials: int = 1) -> tuple[dict[str, dict], int]:
    """Each file's verdict in one arm at one world size (name -> {status, upstream_ok, rerun_alone, message}),
    and the most evaluations seen in flight at once."""
    problems = all_problems()
    evaluations = []
    for path in files:
        problem = match_file(path, problems).problem
        if problem is None:
            raise ValueError(f"{path.name} names no problem")
        if world_size in problem.world_sizes:
            evaluations.append(Evaluation(problem, Candidate.from_file(path), "differential"))
    config = EvalConfig(world_size=world_size, mode=mode, trials=trials, upstream_trials=trials, cases="all",
                        sandbox=arm.sandbox)
    most_at_once = [0]

    def seen(evaluation, result, resumed):
        most_at_once[0] = max(most_at_once[0], len(executor.in_flight()) + 1)

    with tempfile.TemporaryDirectory(prefix="pkb-differential-") as folder, \
            LocalExecutor(parallel if arm.side_by_side else 1) as executor, \
            ResultStore(Path(folder) / "results.sqlite") as store:
        results = run_evaluations(evaluations, config, store, seen, executor=executor)
        if arm.side_by_side:
            print(f"executor: {executor.describe()}", flush=True)
    return {result.solution: {"status": result.status.value, "upstream_ok": result.upstream_ok,
                              "rerun_alone": result.details.rerun_alone, "message": result.message[:300]}
            for result in results}, most_at_once[0]


def side_by_side_slots(mode: Mode, world_size: int, asked: int | None) -> int:
    """``--parallel``, else the machine's maximum for the mode and W, and at least 2 (else nothing is beside)."""
    return asked or max(2, default_parallel(mode, world_size).slots)


def compare(verdicts: dict[str, dict[str, dict]], expected: dict[str, str]) -> tuple[list[str], list[str]]:
    """(verdicts that moved between arms, verdicts other than the file expects), one line each.
    ``verdicts``: file -> arm label -> verdict."""
    moved, unexpected = [], []
    for name, by_arm in verdicts.items():
        seen = {(v["status"], v["upstream_ok"]) for v in by_arm.values()}
        if len(seen) > 1:
            moved.append(f"{name}: " + "; ".join(f"{arm} {v['status']} (paper {v['upstream_ok']})"
                                                   for arm, v in by_arm.items()))
        wrong = {arm: v for arm, v in by_arm.items() if v["status"] != expected[name]}
        unexpected += [f"{name} {arm}: {v['status']}, expected {expected[name]}: {v['message']}" for arm, v in wrong.items()]
    return moved, unexpected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--files", default="*.py", help="a glob of the corpus's files (default: all)")
    parser.add_argument("--mode", default="cpu", choices=[m.value for m in Mode])
    parser.add_argument("--world-sizes", default="2,4,8")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument("--parallel", type=int, help="side by side: this many at once (default: the machine's most, "
                                                     "at least 2)")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    mode, arms = Mode(args.mode), [ARMS[name] for name in args.arms.split(",")]
    files = sorted(args.corpus.glob(args.files))
    expected = {path.stem: expected_verdict(path, mode) for path in files}
    verdicts: dict[str, dict[str, dict]] = {path.stem: {} for path in files}
    walls = {}
    for world_size in map(int, args.world_sizes.split(",")):
        for arm in arms:
            slots = side_by_side_slots(mode, world_size, args.parallel)
            began = time.monotonic()
            judged, most_at_once = judge(files, mode, world_size, arm, slots, args.trials)
            for name, verdict in judged.items():
                verdicts[name][f"{arm.name} W={world_size}"] = verdict
            walls[f"{arm.name} W={world_size}"] = round(time.monotonic() - began, 1)
            print(f"{arm.name} at W = {world_size}" + (f" ({slots} slots, {most_at_once} at most in flight)"
                                                      if arm.side_by_side else "")
                  + f": {walls[f'{arm.name} W={world_size}']} s", flush=True)
            for name, verdict in judged.items():  # as each arm ends: a run cut short keeps what it judged
                print(f"  {name}: {verdict['status']} (paper {verdict['upstream_ok']})"
                      + (" judged again alone" if verdict["rerun_alone"] else ""), flush=True)
    for name, by_arm in verdicts.items():
        statuses = sorted({v["status"] for v in by_arm.values()})
        reruns = [arm for arm, v in by_arm.items() if v["rerun_alone"]]
        print(f"{name}: {', '.join(statuses)} in {len(by_arm)} arms (expected {expected[name]})"
              + (f"; judged again alone in {', '.join(reruns)}" if reruns else ""))
    moved, unexpected = compare(verdicts, expected)
    for line in moved:
        print(f"MOVED {line}")
    for line in unexpected:
        print(f"UNEXPECTED {line}")
    print(f"{len(files)} files x {len(next(iter(verdicts.values()), {}))} arms: "
          f"{'identical verdicts, as expected' if not moved and not unexpected else 'VERDICTS DIFFER'}")
    if args.out:
        args.out.write_text(json.dumps({"mode": mode.value, "arms": [a.name for a in arms], "walls_s": walls,
                                        "expected": expected, "verdicts": verdicts, "moved": moved,
                                        "unexpected": unexpected}, indent=1))
    return 1 if moved or unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
