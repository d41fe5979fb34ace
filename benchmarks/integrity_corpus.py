"""The verdict-integrity corpus, judged as a user runs pkb: every file of ``tests/candidates/integrity`` by
``pkb eval`` with the settings its manifest row names, ``--runs`` times each with fresh secret inputs, and the
share of runs that got a status the row allows (issue 53, 56).

The corpus has three parts. ``wrong/`` holds attacks a reward-hacking model or a hurried author would try: answers
that are wrong by a little (sparse, biased, lost small data, replicas that disagree), timing that is not what it
seems, stock routes past ``--policy``, and tries to choose a status that is not a failure. ``honest/`` holds
kernels that are right in another order or precision, many of them real library code. ``below/`` holds honest
arithmetic that is below a problem's precision in one dtype (a decision each file's docstring gives): ``ok`` in the
dtype where it is within it, ``mismatch`` in the other. ``manifest.tsv`` gives each
file's allowed statuses, the extra ``pkb eval`` flags (``--mode cpu`` and the problem's smallest world size unless
named) and whether the integration tier runs it once in CI (``ci``), or only here (``full``) for its time; a
``known`` row is an open hole (docs/paper-protocol.md): a wrong answer that pkb still judges ``ok``, or an honest one
it still fails at times: run and reported here, apart, and not counted in the exit status.

    python benchmarks/integrity_corpus.py [--runs 5] [--jobs 2] [--only GLOB] [--ci] [--mode cpu] [--out r.json]

Printed: one line per row with the statuses seen and the share allowed; exit status 0 when every run of every row
got an allowed status, 1 otherwise. A row whose ``needs`` (a Python module, or ``gpu``) this machine lacks is listed
as not run.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "candidates" / "integrity"
MANIFEST = CORPUS / "manifest.tsv"


@dataclass(frozen=True)
class Row:
    """One manifest row: a corpus file judged with ``flags``, which must end in one of ``allowed``."""

    path: str  # relative to CORPUS
    allowed: tuple[str, ...]
    flags: str
    tier: str  # "ci": also run once by the integration tier; "full": here only; "known": an open hole (either way)
    needs: tuple[str, ...]  # Python modules, or "gpu"

    @property
    def problem(self) -> str:
        return Path(self.path).stem.split("__")[0]

    @property
    def name(self) -> str:
        return f"{self.path} {self.flags}".strip()

    def missing(self, has_gpu: bool) -> list[str]:
        """What this machine lacks of ``needs``."""
        return [need for need in self.needs
                if (not has_gpu if need == "gpu" else importlib.util.find_spec(need.split(".")[0]) is None)]


def rows(manifest: Path = MANIFEST) -> list[Row]:
    """The manifest's rows; every corpus file must have at least one, and every row a file."""
    found = []
    for number, line in enumerate(manifest.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 5:
            raise ValueError(f"{manifest.name}:{number}: expected 5 tab-separated fields "
                             f"(file, allowed statuses, flags, tier, needs), got {len(fields)}")
        path, allowed, flags, tier, needs = fields
        if tier not in ("ci", "full", "known"):
            raise ValueError(f"{manifest.name}:{number}: tier is 'ci', 'full' or 'known', not {tier!r}")
        if not (manifest.parent / path).is_file():
            raise ValueError(f"{manifest.name}:{number}: no file {path}")
        found.append(Row(path, tuple(allowed.split("|")), flags.strip(), tier,
                         tuple(need for need in needs.split(",") if need and need != "-")))
    listed = {row.path for row in found}
    unlisted = sorted(str(path.relative_to(manifest.parent)) for path in manifest.parent.glob("*/*.py")
                      if str(path.relative_to(manifest.parent)) not in listed)
    if unlisted:
        raise ValueError(f"{manifest.name} has no row for {', '.join(unlisted)}: add one (allowed statuses, flags)")
    return found


def evaluate(row: Row, mode: str = "cpu", timeout: float = 900.0) -> dict:
    """One ``pkb eval`` of ``row``: its status, the paper's verdict and pkb's message."""
    flags = shlex.split(row.flags)
    if "--mode" not in flags:
        flags += ["--mode", mode]
    command = [sys.executable, "-m", "pkb", "eval", row.problem, str(CORPUS / row.path), *flags, "--json"]
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"status": "no-answer", "message": f"pkb eval did not end within {timeout:.0f} s", "seconds": timeout}
    seconds = time.monotonic() - started
    try:
        reply = json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"status": "no-answer", "seconds": seconds,
                "message": f"pkb eval exited {done.returncode} without JSON: {done.stderr.strip()[-600:]}"}
    result = reply if "status" in reply else reply["results"][0]
    return {"status": result["status"], "upstream_ok": result.get("upstream_ok"), "message": result["message"],
            "speedup": result.get("speedup"), "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="evaluations of each row (default 5)")
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="evaluations at once (default: half the cores; each starts W rank processes)")
    parser.add_argument("--only", default="*", help="rows whose file matches this glob (e.g. 'wrong/*policy*')")
    parser.add_argument("--ci", action="store_true", help="only the rows the integration tier runs")
    parser.add_argument("--mode", default="cpu", choices=("cpu", "cuda", "shared-gpu"),
                        help="the mode of rows that name none (default cpu)")
    parser.add_argument("--out", type=Path, help="write every run's status and message here as JSON")
    args = parser.parse_args(argv)

    has_gpu = args.mode != "cpu"
    chosen = [row for row in rows() if fnmatch.fnmatch(row.path, args.only) and (row.tier == "ci" or not args.ci)]
    runnable = [row for row in chosen if not row.missing(has_gpu)]
    for row in chosen:
        if row.missing(has_gpu):
            print(f"not run  {row.name}: needs {', '.join(row.missing(has_gpu))}")
    started = time.monotonic()
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = {row: [pool.submit(evaluate, row, args.mode) for _ in range(args.runs)] for row in runnable}
        results = {row: [future.result() for future in futures] for row, futures in runs.items()}
    wrong = 0
    for row, got in results.items():
        seen = Counter(run["status"] for run in got)
        allowed = sum(count for status, count in seen.items() if status in row.allowed)
        wrong += allowed < len(got) and row.tier != "known"
        mark = "ok  " if allowed == len(got) else "KNOWN" if row.tier == "known" else "FAIL"
        print(f"{mark} {allowed}/{len(got)}  {row.name}  allowed {'|'.join(row.allowed)}, got "
              + ", ".join(f"{status} x{count}" for status, count in seen.most_common()))
        for run in got:
            if run["status"] not in row.allowed:
                print(f"       {run['status']}: {run['message'][:600]}")
    total = sum(len(got) for got in results.values())
    print(f"{len(results) - wrong} of {len(results)} rows got an allowed status in every run or are known holes ({total} evaluations, "
          f"{time.monotonic() - started:.0f} s wall, {args.jobs} at once, mode {args.mode})")
    if args.out:
        args.out.write_text(json.dumps({"mode": args.mode, "runs": args.runs, "rows": [
            {**asdict(row), "results": got} for row, got in results.items()]}, indent=1))
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
