"""``pkb report``, ``pkb transcripts`` and ``pkb export-suite``. Nothing heavy is imported until a command runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pkb import protocol
from pkb.commands import add_option
from pkb.options import DEFAULT_EXPERIMENT, OPTIONS, experiment_complaint

FORMATS = ("table", "json", "csv", "parquet")
TABLES = ("rows", "metrics")


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("report", help="headline, metrics, set comparisons and an HTML report "
                                             "from a results database")
    p.add_argument("--db", help="SQLite file (default: ./pkb-results.sqlite)")
    p.add_argument("--format", default="table", choices=FORMATS,
                   help="table: the headline in the terminal; json: the metrics; csv/parquet: the result rows "
                        "(or the table --table or --compare names)")
    p.add_argument("--table", choices=TABLES,
                   help="with csv, json or parquet: rows (every stored result) or metrics (every set's metrics, "
                        "overall and per category, on both protocols)")
    p.add_argument("--compare", nargs=2, metavar=("SET_A", "SET_B"),
                   help="two solution sets (or models) side by side, problem by problem")
    p.add_argument("--out", help="write the output here instead of stdout (needed for parquet)")
    p.add_argument("--html", help="also write the HTML report (one static file) here")
    p.add_argument("--group-by", default="set", choices=("set", "model", "solution"),
                   help="what to compare: solution sets (default), models (generations), or each solution")
    p.add_argument("--problems", help="the selection the metrics are over, e.g. 1-8,12 or a category; default: upstream "
                   "(the paper's 87 problems; all adds pkb's own, beyond upstream)")
    p.add_argument("--mode", choices=("cpu", "cuda", "shared-gpu"), help="only results measured in this mode")
    add_option(p, OPTIONS["world_size"], help="only results at this world size")
    p.add_argument("--dtype", choices=protocol.PRECISION_NAMES,
                   help="only results in this precision (default: all; a set's results in another precision than "
                        "bf16 are reported apart, as `SET [fp32]`)")
    p.add_argument("--k", default="1,3,5,10,100", help="the k of pass@k and fast_p@k (given where every attempted "
                                                       "problem has at least k samples)")
    p.add_argument("--experiment", action="append", metavar="NAME",
                   help=f"the experiment to report (default {DEFAULT_EXPERIMENT}); several (the flag again, or a comma "
                        "list) are compared, each set named with its experiment. Service and RL traffic (served, rl) "
                        "are reported only when named")
    p.add_argument("--off-gpu-timings", action="store_true",
                   help="also show speedups timed in cpu or shared-gpu mode, apart and labelled (never in fast_p, the "
                        "geomean or the roofline, which count GPU timings in cuda mode only)")
    p.set_defaults(func=cmd_report)

    p = subparsers.add_parser("transcripts", help="a generation or agent run's turns: prompt, answer, verdict, "
                                                  "feedback")
    p.add_argument("run", nargs="?", help="the run's name (`pkb generate`/`pkb agent` print it); left out: the "
                                          "database's runs")
    p.add_argument("--problem", help="only this problem's conversations (slug)")
    p.add_argument("--db", help="SQLite file (default: ./pkb-results.sqlite)")
    p.add_argument("--full", action="store_true", help="every text whole (by default long ones are shortened, "
                                                       "marked with an ellipsis)")
    p.add_argument("--json", action="store_true", help="the transcripts as JSON, every text whole")
    p.set_defaults(func=cmd_transcripts)

    p = subparsers.add_parser("export-suite", help="the problem suite as a Hugging Face datasets directory")
    p.add_argument("directory")
    p.add_argument("--format", default="parquet", choices=("parquet", "jsonl"))
    p.set_defaults(func=cmd_export_suite)


def cmd_report(args) -> int:
    from pkb.console import UsageError
    from pkb.registry import all_problems, select
    from pkb.report import html, metrics, records
    from pkb.store.db import DEFAULT_DB

    if args.format == "parquet" and not args.out:
        raise UsageError("--format parquet writes a binary file: add --out FILE.parquet")
    if args.table and args.format == "table":
        raise UsageError("--table names what --format csv, json or parquet writes; add one of them")
    if args.table and args.compare:
        raise UsageError("--compare writes its own table: leave out --table")
    ks = _parse_ks(args.k)
    experiments = parse_experiments(args.experiment)
    registry = {name: p.category for name, p in all_problems().items()}
    selection = {p.name: p.category for p in select(args.problems)} if args.problems else None
    row_filter = records.Filter(problems=frozenset(selection) if selection else None, mode=args.mode,
                                world_size=args.world_size, precision=args.dtype, experiments=experiments)
    db = args.db or DEFAULT_DB
    try:
        loaded = records.load(db, args.group_by, row_filter, registry)
    except records.ReportError as exc:
        raise UsageError(str(exc)) from None
    unknown = [name for name in experiments if name not in loaded.held] if args.experiment and loaded.held else []
    if unknown:  # a name the user gave that nothing was stored under: a typo, said as one
        raise UsageError(f"no results in experiment {unknown[0]!r}: this database holds {', '.join(loaded.held)}")
    notes = loaded.notes
    if selection is None:
        selection, outside = suite_selection({r.problem: r.category for r in loaded.rows})
        notes += outside
    report = metrics.build_report(loaded.records, selection, loaded.group_by, ks, notes, experiments=experiments,
                                  off_gpu_shown=args.off_gpu_timings)

    if args.compare:
        missing = [name for name in args.compare if name not in report.groups]
        known = f"the {report.group_by}s of these results: {', '.join(report.groups) or 'none'}"
        if missing:
            why = (" (the references are the suite's self-check, shown on the report's `references:` line, not a set "
                   "to compare; the speedups of a set are already against them)"
                   if any(name in ("reference", "references") for name in missing) else "")
            raise UsageError(f"--compare: {', '.join(map(repr, missing))} is not one of {known}{why}")
        if args.compare[0] == args.compare[1]:
            raise UsageError(f"--compare takes two different {report.group_by}s; {known}")
        _write(args, *_comparison_output(report, args.compare, args.format))
    else:
        _write(args, *_report_output(report, loaded, args.format, args.table, db))
    if args.html:
        path = html.write(report, args.html, source=Path(db).name, transcripts=_transcripts_of(report, db))
        print(f"HTML report: {path}", file=sys.stderr)
        covered = sorted({r.problem for r in report.records if not r.is_reference})
        if not args.problems and report.partial() and covered:
            from pkb.registry import selection_text

            print(f"  its sets cover part of the suite; to report only what was run: pkb report --problems "
                  f"{selection_text(covered)} --html {args.html}", file=sys.stderr)
    return 0


def parse_experiments(given: list[str] | None) -> tuple[str, ...]:
    """The experiments ``--experiment`` names (repeated, or comma lists), in order; ``default`` where none is."""
    from pkb.console import UsageError

    names = tuple(dict.fromkeys(name.strip() for text in given or [DEFAULT_EXPERIMENT] for name in text.split(",")))
    wrong = next((experiment_complaint(name) for name in names if experiment_complaint(name)), None)
    if wrong:
        raise UsageError(f"--experiment: {wrong}")
    return names


def _transcripts_of(report, db: str) -> list:
    """The transcripts of the generation runs whose results ``report`` counts (pkb.report.transcripts)."""
    from pkb.report import transcripts
    from pkb.store.db import ResultStore

    shown = dict.fromkeys(r.run for r in report.records if r.run is not None and r.group in report.groups)
    with ResultStore(db) as store:
        return [t for run in shown for t in transcripts.load(store, run) if t.problem in report.problems]


def cmd_transcripts(args) -> int:
    """``pkb transcripts [RUN] [--problem P]``: each conversation's turns (prompt or feedback sent, answer, verdict);
    without RUN, the database's runs."""
    from pkb.console import UsageError
    from pkb.report import transcripts
    from pkb.store.db import DEFAULT_DB, ResultStore, check_store, unreadable_store

    db = args.db or DEFAULT_DB
    unreadable = unreadable_store(db, "`pkb generate` or `pkb agent`")
    if unreadable:
        raise UsageError(unreadable)
    check_store(db)
    with ResultStore(db) as store:
        known = transcripts.runs(store)
        if args.run is None:
            print(json.dumps(known) if args.json else "\n".join(known) or f"no generation run in {db}")
            return 0
        if args.run not in known:
            raise UsageError(f"no run {args.run!r} in {db}; its runs: {', '.join(known) or 'none'}")
        found = transcripts.load(store, args.run, args.problem)
    if not found:
        raise UsageError(f"run {args.run} has no conversation on {args.problem}")
    if args.json:
        print(json.dumps([t.to_dict() for t in found], default=str))
    else:
        print("\n\n".join(transcripts.transcript_text(t, args.full) for t in found))
    return 0


def suite_selection(with_results: dict[str, str]) -> tuple[dict[str, str], tuple[str, ...]]:
    """The selection a headline counts when none is asked for (slug -> category), and a note: the paper's
    suite (the upstream problems), plus problems of ``with_results`` (slug -> category, those the results
    are for) that the registry no longer has. pkb's own problems (beyond upstream) stay out, so that the
    denominator stays the paper's; the note names those the results are for and how to report them."""
    from pkb.registry import all_problems, select

    registry = all_problems()
    selection = {p.name: p.category for p in select("upstream")}
    selection.update({name: category for name, category in with_results.items() if name not in registry})
    own = sorted(name for name in with_results if name in registry and name not in selection)
    if not own:
        return selection, ()
    categories = ",".join(sorted({registry[name].category for name in own}))
    return selection, (f"results for {len(own)} of pkb's own problems beyond upstream ({', '.join(own)}) are "
                       f"outside the paper's suite this headline counts: `pkb report --problems {categories}` "
                       "reports them",)


def _report_output(report, loaded, file_format: str, table: str | None, db: str):
    """(text, or None with a parquet writer) for the report in ``file_format``."""
    from pkb.report import export, tables

    if file_format == "table":
        return _headline_text(report, db), None
    if table == "metrics":
        rows, columns, types = tables.metrics_table(report), tables.metric_columns(report.ks), \
            tables.metric_types(report.ks)
    elif table == "rows" or file_format != "json":
        rows, columns, types = tables.result_rows(loaded.rows), tables.RESULT_COLUMNS, tables.RESULT_TYPES
    else:
        return json.dumps(report.to_json(), indent=1) + "\n", None
    if file_format == "parquet":
        return None, lambda path: export.write_parquet_table(rows, columns, types, path)
    return export.table_text(rows, columns, file_format), None


def _comparison_output(report, sets, file_format: str):
    from pkb.console import print_table
    from pkb.report import export, metrics, tables

    comparison = metrics.compare(report, *sets)
    if file_format == "table":
        def show() -> None:
            print_table(tables.compare_text_rows(comparison), list(tables.compare_columns(comparison)))
            print()
            for line in tables.compare_summary(comparison):
                print(line)
        return _captured(show), None
    rows, columns, types = tables.compare_table(comparison), tables.compare_columns(comparison), \
        tables.compare_types(comparison)
    if file_format == "parquet":
        return None, lambda path: export.write_parquet_table(rows, columns, types, path)
    return export.table_text(rows, columns, file_format), None


def _write(args, text: str | None, writer) -> None:
    from pkb.console import UsageError

    if writer is not None:
        try:
            writer(args.out)
        except ImportError as exc:
            raise UsageError(str(exc)) from None
    elif args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)


def headline_lines(report, empty: str) -> None:
    """Print the headline: the references' self-check, one row per set, what the columns mean."""
    from pkb.console import print_table
    from pkb.report import tables

    print(report.self_check.summary())
    if not report.groups:
        print(empty)
    else:
        print()
        columns = tables.headline_columns(report)
        print_table(tables.headline_rows(report), list(columns), headers=[report.group_by, *columns[1:]])
        print()
        print(tables.headline_footnote(report))
        strict_gaps, paper_gaps = tables.strict_gap_rows(report), tables.paper_gap_rows(report)
        if strict_gaps:
            print("\nCorrect on the paper's protocol, failing pkb's stricter cases:")
            print_table(strict_gaps, list(tables.STRICT_GAP_COLUMNS),
                        headers=[report.group_by, *tables.STRICT_GAP_COLUMNS[1:]])
        if paper_gaps:
            print("\nOk by pkb's verdict, failing the paper's rule:")
            print_table(paper_gaps, list(tables.PAPER_GAP_COLUMNS), headers=[report.group_by, *tables.PAPER_GAP_COLUMNS[1:]])
        for reason, meaning in tables.reason_meanings(report).items():
            print(f"  {reason}: {meaning}")
    for note in tables.headline_notes(report):
        print(f"note: {note}")


def _headline_text(report, db: str) -> str:
    return _captured(lambda: headline_lines(
        report, f"no candidate results in {db} for this selection (reference self-checks do not count)"))


def _captured(show) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        show()
    return out.getvalue()


def _parse_ks(text: str) -> tuple[int, ...]:
    from pkb.console import UsageError

    try:
        ks = tuple(int(k) for k in text.split(",") if k.strip())
    except ValueError:
        ks = ()
    if not ks or any(k < 1 for k in ks):
        raise UsageError(f"--k takes positive integers separated by commas, e.g. 1,5,10 (got {text!r})")
    return ks


def cmd_export_suite(args) -> int:
    from pkb.console import UsageError
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
