"""Compare the verdicts of two results databases, row by row: what a change of pkb did to its answers.

Rows are matched by (solution set, solution, problem, mode, world size, precision). A verdict is
everything a result says about the candidate: the status, the message, the paper's verdict, the cases
checked, the collectives used and the details, less what describes the run rather than the candidate
(wall times, where the time went, when, the path of the file and of the checkout it ran from, pkb's
version, the schema version). Paths under either checkout are written as ``<checkout>``, the name of a
scratch folder (random per evaluation) as ``pkb-scratch-*``, and the line numbers of pkb's own frames in a
traceback as ``line *`` (pkb's code moves; the candidate's lines stay). A field a later schema added
counts as the value an older row implies (``ADDED_FIELDS``).

    python benchmarks/verdict_diff.py BEFORE.sqlite AFTER.sqlite [--before-root DIR] [--after-root DIR]

Prints the number of rows compared and each difference; exit status 0 when every verdict is identical.
"""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
import sys
from pathlib import Path

RUN_DETAILS = ("phase_s", "solution_path", "gpu_memory_peak_gib")  # how a run went, not what it found
ADDED_FIELDS = {"nodes": 1}  # field -> what a row written before it existed means (schema 6: one node)
SCRATCH = re.compile(r"pkb-scratch-[A-Za-z0-9_]+")
OWN_FRAME = re.compile(r'(<checkout>/pkb/[^"\\]*\\", line )\d+')  # in JSON text: the quote escaped
RUN_FIELDS = ("wall_s", "created_at", "pkb_version", "schema_version", "details", "timings", "speedup",
              "roofline_fraction", "busbw_gbps", "hardware")


def rows(path: Path, root: str | None) -> dict[tuple, dict]:
    """The latest row of each (set, solution, problem, mode, world size, precision) as a comparable dict."""
    found = {}
    with sqlite3.connect(path) as db:
        for (text,) in db.execute("SELECT result_json FROM results ORDER BY id"):
            row = json.loads(text)
            key = (row.get("solution_set"), row["solution"], row["problem"], row["mode"], row["world_size"],
                   row.get("precision", "bf16"))
            details = {k: v for k, v in (row.get("details") or {}).items() if k not in RUN_DETAILS}
            verdict = {k: v for k, v in row.items() if k not in RUN_FIELDS}
            verdict["details"] = details
            for name, implied in ADDED_FIELDS.items():
                verdict[name] = implied if verdict.get(name) is None else verdict[name]
            text = json.dumps(verdict, sort_keys=True, default=str)
            text = SCRATCH.sub("pkb-scratch-*", text.replace(root, "<checkout>") if root else text)
            found[key] = json.loads(OWN_FRAME.sub(r"\1*", text))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--before-root", help="the checkout the first database was written from")
    parser.add_argument("--after-root", help="the checkout the second database was written from")
    args = parser.parse_args(argv)
    before, after = rows(args.before, args.before_root), rows(args.after, args.after_root)
    differences = [f"only before: {key}" for key in sorted(before.keys() - after.keys(), key=str)]
    differences += [f"only after: {key}" for key in sorted(after.keys() - before.keys(), key=str)]
    for key in sorted(before.keys() & after.keys(), key=str):
        changed = sorted(name for name in before[key].keys() | after[key].keys()
                         if before[key].get(name) != after[key].get(name))
        differences += [f"{key}: {name}: {before[key].get(name)!r} -> {after[key].get(name)!r}" for name in changed]
    print(f"{len(before.keys() & after.keys())} rows in both: "
          + ("every verdict identical" if not differences else f"{len(differences)} differences"))
    for line in differences:
        print(line)
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
