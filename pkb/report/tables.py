"""Tables of a report: the headline (one row per set), the metrics table, two sets compared problem by
problem, and the result rows. Formatting of a number lives here once, so the terminal and the HTML agree;
the machine-readable tables (``*_table``) keep raw values (fractions in 0..1) for CSV, JSON and parquet.
"""

from __future__ import annotations

import json

from pkb.report.metrics import FAST_P_THRESHOLDS, Comparison, Metrics, Report, SandboxTally, Side
from pkb.report.records import PROTOCOLS, Record

HEADLINE_COLUMNS = ("set", "problems", "pass@1 paper / pkb", "fast_1 paper / pkb", "geomean speedup",
                    "median roofline", "failures (pkb)")
HEADLINE_FOOTNOTE = ("paper: correct on the upstream cases alone (the paper's protocol); pkb: correct on every case "
                     "pkb checks.\nproblems: attempted of counted, a problem whose samples were all skipped (or pkb's "
                     "own failures) left out. A set with results for part of the selection has two rows: `covered` "
                     "counts the problems it has a result for; `in the suite` counts every selected problem, one "
                     "without a result as failed (the paper's denominator; sets are ranked on it).")
COVERED, IN_THE_SUITE = "covered", "in the suite"  # how the headline labels the two views (metrics.VIEWS)
ALL_CATEGORIES = "all"

# The result rows' columns, in order, for csv and parquet (JSON-valued columns hold JSON text).
RESULT_COLUMNS = ("result_id", "group", "sample", "problem", "category", "problem_version", "solution",
                  "solution_set", "solution_sha256", "status", "upstream_ok", "paper_verdict", "message", "mode",
                  "world_size", "num_trials", "speedup", "roofline_fraction", "busbw_gbps",
                  "times_are_gpu_performance", "collectives_used", "hardware", "pkb_version", "schema_version",
                  "created_at", "wall_s", "timings", "details")
_JSON_COLUMNS = ("collectives_used", "timings", "details")
RESULT_TYPES = {"result_id": int, "problem_version": int, "world_size": int, "num_trials": int, "schema_version": int,
                "speedup": float, "roofline_fraction": float, "busbw_gbps": float, "created_at": float,
                "wall_s": float, "times_are_gpu_performance": bool, "upstream_ok": bool}


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def fast_1(m: Metrics, k: int = 1) -> float | None:
    """fast_1@k, or None where no sample was timed (then it would only repeat that nothing was measured)."""
    return m.fast_p.get(k, {}).get(1.0) if m.timed else None


def pair(paper: str, pkb: str) -> str:
    return f"{paper} / {pkb}"


def problems_text(m: Metrics, view: str = "") -> str:
    """e.g. ``3 of 5`` (attempted of counted), ``1 of 1 (+1 left out)``, ``8 of 8 covered``, ``8 of 87 in the
    suite`` (``view``: the headline's label of the view, for a set that covers part of the selection)."""
    return f"{m.num_attempted} of {m.denominator}" + (f" {view}" if view else "") + (
        f" (+{m.num_skipped_problems} left out)" if m.num_skipped_problems else "")


def failures_text(m: Metrics) -> str:
    return ", ".join(f"{n} {s}" for s, n in m.failures.items()) or "-"


# -- the headline ----------------------------------------------------------------------------------------


def headline_rows(report: Report) -> list[dict[str, str]]:
    """The headline of ``pkb run`` and of ``pkb report``, best first: one row per group that covers the whole
    selection; two for one that covers part of it, on the problems it covers (``8 of 8 covered``), then on
    the whole selection (``8 of 87 in the suite``, the paper's denominator; the samples' columns left blank,
    they are the row above's)."""
    rows = []
    for group in report.groups:
        if report.coverage[group].complete:
            rows.append(_headline_row(report, group, "suite", ""))
            continue
        rows.append(_headline_row(report, group, "covered", COVERED))
        suite = _headline_row(report, group, "suite", IN_THE_SUITE)
        rows.append({c: suite[c] if c in ("problems", "pass@1 paper / pkb", "fast_1 paper / pkb") else ""
                     for c in HEADLINE_COLUMNS})
    return rows


def _headline_row(report: Report, group: str, view: str, label: str) -> dict[str, str]:
    m, paper = report.on("pkb", view)[group], report.on("paper", view)[group]
    return {"set": group, "problems": problems_text(m, label),
            "pass@1 paper / pkb": pair(percent(paper.pass_at_k.get(1)), percent(m.pass_at_k.get(1))),
            "fast_1 paper / pkb": pair(percent(fast_1(paper)), percent(fast_1(m))),
            "geomean speedup": times(m.geomean_speedup),
            "median roofline": percent(m.roofline.quantiles.get("median")),
            "failures (pkb)": failures_text(m)}


def coverage_notes(report: Report) -> dict[str, str]:
    """Per group with results for part of the selection, e.g. ``pkb shipped has results for 8 of the 87
    selected problems: its `covered` row counts those, its `in the suite` row every selected problem (the
    79 without a result as failed)``."""
    notes = {}
    for group in report.partial():
        coverage = report.coverage[group]
        notes[group] = (f"{group} has results for {coverage.num_covered} of the {coverage.num_selected} selected "
                        f"problems: its `{COVERED}` row counts those, its `{IN_THE_SUITE}` row every selected "
                        f"problem (the {coverage.num_selected - coverage.num_covered} without a result as failed)")
    return notes


def headline_notes(report: Report) -> list[str]:
    """What the reader of the headline should know beyond the footnote."""
    notes = list(coverage_notes(report).values())
    for group, m in report.paper.items():
        if m.num_unknown:
            notes.append(f"{group}: {m.num_unknown} sample(s) without an upstream verdict (their run left the "
                         "upstream cases out, or they predate it) are left out of the paper's protocol")
    notes += sandbox_notes(report).values()
    if report.timed_off_gpu:
        notes.append("some speedups were measured in cpu or shared-gpu mode: not GPU performance")
    return notes + list(report.notes)


STRICT_GAP_COLUMNS = ("set", "paper ok", "fail pkb's cases", "why: the failing cases' tags")


def strict_gap_rows(report: Report) -> list[dict]:
    """Per group with paper-correct samples that fail pkb's cases: how many, and under which tags."""
    return [{"set": group, "paper ok": gap.paper_ok, "fail pkb's cases": gap.strict_failed,
             "why: the failing cases' tags": ", ".join(f"{reason} {n}" for reason, n in gap.reasons.items())}
            for group, gap in report.strict_gaps.items() if gap.strict_failed]


def reason_meanings(report: Report) -> dict[str, str]:
    """What each tag or reason in ``strict_gap_rows`` means."""
    from pkb.problem import CASE_TAGS
    from pkb.report.metrics import STRICT_ONLY_REASONS

    meanings = {**CASE_TAGS, **STRICT_ONLY_REASONS}
    used = dict.fromkeys(reason for gap in report.strict_gaps.values() for reason in gap.reasons)
    return {reason: meanings.get(reason, "") for reason in used}


SANDBOX_GAP_LABELS = {"off": "--sandbox off", "partial": "partial", "unrecorded": "no record (older pkb)"}


def sandbox_notes(report: Report) -> dict[str, str]:
    """Per group whose results include any not run under the full sandbox, e.g. ``3 of 12 results in set X
    ran without the full sandbox (--sandbox off: 2; partial: 1; no record (older pkb): 0)``."""
    notes = {}
    for group in report.groups:
        tally = report.sandbox(group)
        if tally.num_without_full:
            gaps = "; ".join(f"{SANDBOX_GAP_LABELS[gap]}: {n}" for gap, n in tally.num_by_gap.items())
            notes[group] = (f"{tally.num_without_full} of {tally.num_results} results in {report.group_by} {group} "
                            f"ran without the full sandbox ({gaps})")
    return notes


# -- the metrics table: one row per (group, category, protocol) ---------------------------------------------


def metric_columns(ks) -> tuple[str, ...]:
    ks = sorted(set(ks))
    return (("group", "category", "protocol", "problems", "attempted", "samples", "unknown")
            + tuple(f"pass@{k}" for k in ks)
            + tuple(f"fast_{p:g}" for p in FAST_P_THRESHOLDS if p >= 1)
            + tuple(f"fast_1@{k}" for k in ks if k > 1)
            + ("geomean_speedup", "num_timed", "median_roofline", "moves_data_itself", "failures",
               "results_without_full_sandbox")
            + ("selected", "covered", "covered_problems") + tuple(f"covered_pass@{k}" for k in ks)
            + ("covered_fast_1",))


def metrics_table(report: Report) -> list[dict]:
    """Every group's metrics overall (category ``all``) and per category, on both protocols; raw values."""
    rows = []
    for group in report.groups:
        for protocol in PROTOCOLS:
            cells = [(ALL_CATEGORIES, report.on(protocol)[group], report.on(protocol, "covered")[group],
                      report.coverage[group])]
            cells += [(category, m, report.on_category(protocol, "covered")[group][category],
                       report.category_coverage(group, category))
                      for category, m in report.on_category(protocol)[group].items()]
            for category, m, covered, coverage in cells:
                row = _metric_row(group, category, protocol, m, report.ks,
                                  report.sandbox(group, None if category == ALL_CATEGORIES else category))
                row.update(selected=coverage.num_selected, covered=coverage.num_covered,
                           covered_problems=covered.denominator,
                           **{f"covered_pass@{k}": covered.pass_at_k.get(k) for k in sorted(set(report.ks))},
                           covered_fast_1=fast_1(covered))
                rows.append(row)
    return rows


def _metric_row(group: str, category: str, protocol: str, m: Metrics, ks, sandbox: SandboxTally) -> dict:
    """The suite view's columns (``metric_columns`` up to ``results_without_full_sandbox``)."""
    row = {"group": group, "category": category, "protocol": protocol, "problems": m.denominator,
           "attempted": m.num_attempted, "samples": m.num_samples, "unknown": m.num_unknown}
    for k in sorted(set(ks)):
        row[f"pass@{k}"] = m.pass_at_k.get(k)
    for p in FAST_P_THRESHOLDS:
        if p >= 1:
            row[f"fast_{p:g}"] = m.fast_p.get(1, {}).get(p) if m.timed else None
    for k in sorted(set(ks)):
        if k > 1:
            row[f"fast_1@{k}"] = fast_1(m, k)
    row.update(geomean_speedup=m.geomean_speedup, num_timed=m.num_timed,
               median_roofline=m.roofline.quantiles.get("median"), moves_data_itself=m.moves_data_itself,
               failures=json.dumps(m.failures), results_without_full_sandbox=sandbox.num_without_full)
    return row


def metric_types(ks) -> dict[str, type]:
    return {c: (str if c in ("group", "category", "protocol", "failures") else
                int if c in ("problems", "attempted", "samples", "unknown", "num_timed",
                             "results_without_full_sandbox", "selected", "covered", "covered_problems") else float)
            for c in metric_columns(ks)}


# -- two sets, problem by problem ----------------------------------------------------------------------


def compare_columns(comparison: Comparison) -> tuple[str, ...]:
    return ("problem", "category") + tuple(f"{name} {what}" for name in comparison.sets
                                           for what in ("paper", "pkb", "speedup", "roofline"))


def compare_table(comparison: Comparison) -> list[dict]:
    """One row per problem: each set's verdict on both protocols (``c/n ok`` for several samples), its best
    speedup and that sample's fraction of roofline; raw numbers."""
    rows = []
    for problem, category, sides in comparison.rows:
        row = {"problem": problem, "category": category}
        for name, side in sides.items():
            row[f"{name} paper"] = _verdict_cell(side, "paper")
            row[f"{name} pkb"] = _verdict_cell(side, "pkb")
            row[f"{name} speedup"] = side.best_speedup if side else None
            row[f"{name} roofline"] = side.roofline if side else None
        rows.append(row)
    return rows


def compare_types(comparison: Comparison) -> dict[str, type]:
    return {c: float if c.endswith((" speedup", " roofline")) else str for c in compare_columns(comparison)}


def compare_text_rows(comparison: Comparison) -> list[dict[str, str]]:
    """``compare_table`` with numbers formatted for the terminal."""
    return [{c: (times(v) if c.endswith(" speedup") else percent(v) if c.endswith(" roofline") else v)
             for c, v in row.items()} for row in compare_table(comparison)]


def compare_summary(comparison: Comparison) -> list[str]:
    return [f"{protocol}: " + ", ".join(f"{label} {n}" for label, n in counts.items())
            + " (problems with a correct sample)" for protocol, counts in comparison.counts.items()]


def _verdict_cell(side: Side | None, protocol: str) -> str:
    """The one sample's verdict, or ``c/n ok`` over the samples with a verdict (``+2 skipped`` for the rest)."""
    if side is None:
        return "no result"
    verdicts = side.verdicts[protocol]
    if len(verdicts) == 1:
        return verdicts[0]
    left_out = ("skipped", "harness_error", "infra_error", "unknown")
    judged = [v for v in verdicts if v not in left_out]
    rest = {v: verdicts.count(v) for v in left_out if v in verdicts}
    text = f"{side.num_correct[protocol]}/{len(judged)} ok" if judged else ""
    return " ".join([text, *(f"+{n} {v}" for v, n in rest.items())]).strip()


# -- the result rows -------------------------------------------------------------------------------------


def result_rows(records: tuple[Record, ...]) -> list[dict]:
    rows = []
    for record in records:
        values = record.result.to_dict()
        paper = record.verdict("paper")
        row = {"result_id": record.result_id, "group": record.group, "sample": record.sample,
               "category": record.category, "paper_verdict": paper.value if paper is not None else None,
               **{c: values.get(c) for c in RESULT_COLUMNS if c in values}}
        for column in _JSON_COLUMNS:
            row[column] = json.dumps(row[column], default=str)
        rows.append({c: row.get(c) for c in RESULT_COLUMNS})
    return rows


