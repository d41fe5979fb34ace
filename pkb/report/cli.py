"""``pkb report`` and ``pkb export-suite``. Nothing heavy is imported until a command runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

FORMATS = ("table", "json", "csv", "parquet")


def add_commands(subparsers, add_eval_options) -> None:
    p = subparsers.add_parser("report", help="metrics, leaderboard and an HTML report from a results database")
    p.add_argument("--db", help="SQLite file (default: ./pkb-results.sqlite)")
    p.add_argument("--format", default="table", choices=FORMATS,
                   help="table: leaderboard; json: the metrics; csv/parquet: the result rows")
    p.add_argument("--out", help="write the output here instead of stdout (needed for parquet)")
    p.add_argument("--html", help="also write the HTML report (one static file) here")
    p.add_argument("--group-by", default="auto", choices=("auto", "model", "set", "solution"),
                   help="what to compare: model (generations), solution set, or each solution (default: auto)")
    p.add_argument("--problems", help="the selection the metrics are over, e.g. 1-8,12 or a category; default: all")
    p.add_argument("--mode", choices=("cpu", "cuda", "shared-gpu"), help="only results measured in this mode")
    p.add_argument("--world-size", type=int, help="only results at this world size")
    p.add_argument("--k", default="1,5,10,100", help="the k of pass@k and fast_p@k (given where every attempted "
                                                     "problem has at least k samples)")
    p.set_defaults(func=cmd_report)

    p = subparsers.add_parser("export-suite", help="the problem suite as a Hugging Face datasets directory")
    p.add_argument("directory")
    p.add_argument("--format", default="parquet", choices=("parquet", "jsonl"))
    p.set_defaults(func=cmd_export_suite)


def cmd_report(args) -> int:
    from pkb.cli import UsageError, print_table
    from pkb.registry import all_problems, select
    from pkb.report import html, metrics, records, tables
    from pkb.store.db import DEFAULT_DB

    if args.format == "parquet" and not args.out:
        raise UsageError("--format parquet writes a binary file: add --out FILE.parquet")
    ks = _parse_ks(args.k)
    registry = {name: p.category for name, p in all_problems().items()}
    selection = {p.name: p.category for p in select(args.problems)} if args.problems else None
    row_filter = records.Filter(problems=frozenset(selection) if selection else None, mode=args.mode,
                                world_size=args.world_size)
    db = args.db or DEFAULT_DB
    try:
        loaded = records.load(db, args.group_by, row_filter, registry)
    except records.ReportError as exc:
        raise UsageError(str(exc)) from None
    if selection is None:  # the whole suite, plus problems the database has that the suite no longer does
        selection = dict(registry)
        selection.update({r.problem: r.category for r in loaded.rows if r.problem not in registry})
    report = metrics.build_report(loaded.records, selection, loaded.group_by, ks, loaded.notes)

    if args.format == "parquet":
        try:
            tables.write_parquet(loaded.rows, args.out)
        except ImportError as exc:
            raise UsageError(str(exc)) from None
    else:
        text = {"json": lambda: json.dumps(report.to_json(), indent=1) + "\n",
                "csv": lambda: tables.to_csv(loaded.rows),
                "table": lambda: _table_text(report, print_table, db)}[args.format]()
        if args.out:
            Path(args.out).write_text(text, encoding="utf-8")
        else:
            sys.stdout.write(text)
    if args.html:
        path = html.write(report, args.html, source=str(db))
        print(f"HTML report: {path}", file=sys.stderr)
    return 0


def _table_text(report, print_table, db: str) -> str:
    import contextlib
    import io

    from pkb.report import tables

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if not report.groups:
            print(f"no candidate results in {db} for this selection (reference self-checks do not count)")
        else:
            print_table(tables.leaderboard_rows(report), list(tables.LEADERBOARD_COLUMNS))
            print(f"\n{len(report.problems)} problems selected; grouped by {report.group_by}; "
                  "a problem without a result counts as failed, skipped samples are neither pass nor fail")
        for note in report.notes:
            print(f"note: {note}")
    return out.getvalue()


def _parse_ks(text: str) -> tuple[int, ...]:
    from pkb.cli import UsageError

    try:
        ks = tuple(int(k) for k in text.split(",") if k.strip())
    except ValueError:
        ks = ()
    if not ks or any(k < 1 for k in ks):
        raise UsageError(f"--k takes positive integers separated by commas, e.g. 1,5,10 (got {text!r})")
    return ks


def cmd_export_suite(args) -> int:
    from pkb.cli import UsageError
    from pkb.report.export import export_suite

    directory = Path(args.directory)
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"{directory} is a file: give a directory to write the dataset into")
    try:
        path = export_suite(directory, args.format)
    except ImportError as exc:
        raise UsageError(str(exc)) from None
    print(f"wrote {path} and {directory / 'README.md'} (load with datasets.load_dataset({str(directory)!r}))")
    return 0
