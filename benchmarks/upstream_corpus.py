"""Run the upstream benchmark's own reference files as candidates: each must be ``ok`` (issue 18).

Every file ``<n>_<name>.py`` in the corpus folder (default ``../shared/upstream/reference`` beside
the project) is, by definition, a correct solution of upstream problem ``n``. This evaluates each
against pkb's problem of that number, through pkb's evaluation loop (pkb.loop.run_evaluations:
``--parallel`` side by side, every verdict stored in ``--db`` as it finishes, so a cut run resumes there),
and prints one line per file, then the counts by verdict; ``--out`` writes every result as JSON (rewritten
after each file).

    python benchmarks/upstream_corpus.py [--world-size 2] [--mode cpu] [--problems 1-87]
        [--cases all|upstream|tests] [--trials 1] [--parallel N] [--db corpus.sqlite] [--out results.json]

Exit status 0 when every file is ``ok`` or ``skipped``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from pkb.executor import Evaluation
from pkb.loop import run_evaluations
from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.executor import LocalExecutor
from pkb.options import Status
from pkb.registry import get_problem, select
from pkb.runtime.modes import Mode
from pkb.store.db import ResultStore

DEFAULT_CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "upstream" / "reference"


def corpus_files(folder: Path) -> dict[int, Path]:
    """Upstream number -> file, for every ``<n>_<name>.py`` in ``folder``."""
    files = {}
    for path in folder.glob("*.py"):
        number = path.name.split("_", 1)[0]
        if number.isdigit():
            files[int(number)] = path
    return dict(sorted(files.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mode", default="cpu", choices=[m.value for m in Mode])
    parser.add_argument("--problems", help="selection as for `pkb run --problems` (default: every file)")
    parser.add_argument("--cases", default="all")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--parallel", type=int, help="evaluations side by side (default: what this machine holds)")
    parser.add_argument("--db", type=Path, help="results database (default: a temporary one); a rerun resumes")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not args.corpus.is_dir():
        parser.error(f"no corpus folder at {args.corpus} (pass --corpus)")
    files = corpus_files(args.corpus)
    if args.problems:
        wanted = {p.upstream_id for p in select(args.problems)}
        files = {n: path for n, path in files.items() if n in wanted}
    config = EvalConfig(world_size=args.world_size, mode=Mode(args.mode), trials=args.trials,
                        timeout=args.timeout, cases=args.cases)
    evaluations = [Evaluation(get_problem(number), Candidate.from_file(path), "upstream-corpus")
                   for number, path in files.items()]
    rows = []

    def show(evaluation: Evaluation, result, resumed: bool) -> None:
        problem = evaluation.problem
        rows.append({"upstream_id": problem.upstream_id, "problem": problem.name, "version": problem.version,
                     "file": evaluation.candidate.path.name, "status": result.status.value, "message": result.message,
                     "upstream_ok": result.upstream_ok, "cases": result.cases, "wall_s": round(result.wall_s, 2)})
        print(f"{problem.upstream_id:3d} {problem.name:42s} {result.status.value:14s} {rows[-1]['wall_s']:6.1f}s "
              f"{result.message[:200]}", flush=True)
        if args.out:
            args.out.write_text(json.dumps({"world_size": args.world_size, "mode": args.mode, "cases": args.cases,
                                            "results": sorted(rows, key=lambda row: row["upstream_id"])}, indent=1))

    with tempfile.TemporaryDirectory() as scratch, ResultStore(args.db or Path(scratch) / "corpus.sqlite") as store, \
            LocalExecutor(args.parallel) as executor:
        run_evaluations(evaluations, config, store, show, executor)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    print(f"\n{len(rows)} upstream files at W={args.world_size} ({args.mode}): "
          + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    good = (Status.OK.value, Status.SKIPPED.value)
    return 0 if all(row["status"] in good for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
