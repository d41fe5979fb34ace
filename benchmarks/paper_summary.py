"""Both verdicts of a ``pkb run`` database, in brief: counts of pkb's verdict and of the paper's
(``upstream_ok``), then every file that is not ``ok`` on either (``--all``: every file). Prints; asserts nothing.

    python benchmarks/paper_summary.py RESULTS.sqlite [--json OUT.json] [--all]
"""

from __future__ import annotations

import argparse
import collections
import json
import sqlite3
from pathlib import Path

PAPER = {1: "ok", 0: "failed", None: "none"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("db")
    parser.add_argument("--json")
    parser.add_argument("--all", action="store_true", help="print every file, not only those not ok on both")
    args = parser.parse_args()
    with sqlite3.connect(args.db) as db:
        rows = db.execute("SELECT problem, solution, status, upstream_ok, mode, world_size, precision, wall_s, "
                          "message FROM results WHERE solution_set != 'reference' ORDER BY id").fetchall()
    keys = ("problem", "solution", "status", "upstream_ok", "mode", "world_size", "precision", "wall_s", "message")
    rows = [dict(zip(keys, row)) for row in rows]
    print(f"{len(rows)} files; pkb's verdict: {dict(collections.Counter(r['status'] for r in rows))}; "
          f"the paper's: {dict(collections.Counter(PAPER[r['upstream_ok']] for r in rows))}")
    for row in rows:
        if args.all or row["status"] != "ok" or row["upstream_ok"] != 1:
            print(f"  {row['solution']} (W={row['world_size']}): {row['status']}, paper {PAPER[row['upstream_ok']]}: "
                  f"{row['message'][:400 if args.all else 200]}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
