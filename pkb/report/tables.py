"""Tables of a report: the headline (one row per set), the metrics table, two sets compared problem by
problem, and the result rows. Formatting of a number lives here once, so the terminal and the HTML agree;
the machine-readable tables (``*_table``) keep raw values (fractions in 0..1) for CSV, JSON and parquet.
"""

from __future__ import annotations

import json

from pkb.report.metrics import FAST_P_THRESHOLDS, Comparison, Metrics, Report, SandboxTally, Side
from pkb.report.records import PROTOCOLS, Record

HEADLINE_COLUMNS = ("set", "covers", "pass@1 paper / pkb", "fast_1 paper / pkb", "geomean speedup",
                    "median roofline", "failures (pkb)")
OFF_GPU_COLUMN = "off-GPU speedup (not GPU performance)"  # only with --off-gpu-timings
ALL_CATEGORIES = "all"

# The result rows' columns, in order, for csv and parquet (JSON-valued columns hold JSON text).
RESULT_COLUMNS = ("result_id", "group", "sample", "problem", "category", "problem_version", "solution",
                  "solution_set", "experiment", "solution_sha256", "status", "upstream_ok", "paper_verdict", "message", "mode",
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


def pair(paper: str, pkb: str) -> str:
    return f"{paper} / {pkb}"


def covers_text(report: Report, group: str) -> str:
    """What ``group`` has a result for, of the selected problems, and how many of those left the denominator
    (every sample skipped by the run, or pkb's own failure), e.g. ``8 of 87`` or ``8 of 87, 7 left out``."""
    left_out = report.overall[group].num_skipped_problems
    return report.coverage[group].text() + (f", {left_out} left out" if left_out else "")


def failures_text(m: Metrics) -> str:
    return ", ".join(f"{n} {s}" for s, n in m.failures.items()) or "-"


# -- the headline ----------------------------------------------------------------------------------------


def headline_columns(report: Report) -> tuple[str, ...]:
    """The headline's columns: ``HEADLINE_COLUMNS``, and the off-GPU speedup where it was asked for."""
    return HEADLINE_COLUMNS + ((OFF_GPU_COLUMN,) if report.off_gpu_shown else ())


def headline_rows(report: Report) -> list[dict[str, str]]:
    """The headline of ``pkb run`` and of ``pkb report``, best first: one row per group, with what it covers and
    its pass@1 and fast_1 on both verdicts over the whole selection (the paper's denominator, said once by
    ``headline_footnote``), its geomean speedup and median % of roofline (timed on GPUs) and its failures."""
    rows = []
    for group in report.groups:
        m, paper = report.overall[group], report.paper[group]
        row = {"set": group, "covers": covers_text(report, group),
               "pass@1 paper / pkb": pair(percent(paper.pass_at_k.get(1)), percent(m.pass_at_k.get(1))),
               "fast_1 paper / pkb": pair(percent(paper.fast()), percent(m.fast())),
               "geomean speedup": times(m.geomean_speedup),
               "median roofline": percent(m.roofline.quantiles.get("median")),
               "failures (pkb)": failures_text(m)}
        if report.off_gpu_shown:
            row[OFF_GPU_COLUMN] = m.off_gpu.text()
        rows.append(row)
    return rows


def headline_footnote(report: Report) -> str:
    """What the headline's numbers count, said once, e.g. ``pass@1 and fast_1 (paper / pkb) count the 87 selected
    problems, the paper's denominator: ...``."""
    experiments = f"experiment {', '.join(report.experiments)}: " if report.experiments else ""
    count = len(report.problems)
    selected = f"the {count} selected problems" if count != 1 else "the 1 selected problem"
    return (f"{experiments}pass@1 and fast_1 (paper / pkb) count {selected}, the "
            "paper's denominator:\none without a result as failed, one left out (its every sample skipped by the run, "
            "or pkb's own failure) not at all.\npaper: upstream's inputs and rule; pkb: every case pkb checks; speed "
            "(fast_1, geomean, roofline): GPU timings in cuda mode only.")


def headline_notes(report: Report) -> list[str]:
    """What the reader of the headline should know beyond the footnote."""
    notes = []
    for group, m in report.paper.items():
        if m.num_unknown:
            samples = f"{m.num_unknown} sample{'s' * (m.num_unknown != 1)}"
            notes.append(f"{group}: {samples} without an upstream verdict (their run left the "
                         "upstream cases out, or they predate it) are left out of the paper's protocol")
    notes += candidate_skip_notes(report)
    notes += sandbox_notes(report).values()
    if report.timed_off_gpu:
        notes.append(f"`{OFF_GPU_COLUMN}`: the geomean of speedups timed in cpu or shared-gpu mode, never counted in "
                     "fast_1, the geomean or the roofline" if report.off_gpu_shown else
                     "speedups timed in cpu or shared-gpu mode (not GPU performance) are left out of fast_1, the "
                     "geomean and the roofline: `pkb report --off-gpu-timings` shows them apart")
    return notes + list(report.notes)


def candidate_skip_notes(report: Report) -> list[str]:
    """Per group with results ``skipped`` by what their code needs or did (counted as not passed, unlike a skip the
    run causes), how many and what they need, e.g. ``mine: 3 skipped results count as not passed: 2 need a GPU, 1
    need NVSHMEM (run them with --mode cuda)``."""
    from pkb.report.metrics import CANDIDATE_SKIP_NEEDS

    notes = []
    for group in report.groups:
        needs = report.candidate_skips(group)
        if needs:
            total = sum(needs.values())
            said = ", ".join(f"{n} " + (CANDIDATE_SKIP_NEEDS[need].replace("need ", "needs ", 1) if n == 1
                                        else CANDIDATE_SKIP_NEEDS[need]) for need, n in needs.items())
            notes.append(f"{group}: {total} skipped result{'s' * (total != 1)} count{'s' * (total == 1)} as not "
                         f"passed (in pass@k's n, among the failures): {said} (run them with --mode cuda"
                         + (", NVSHMEM on one node or real nodes" if "nvshmem" in needs else "") + ")")
    return notes


STRICT_GAP_COLUMNS = ("set", "paper ok", "fail pkb's cases", "why: the failing cases' tags")


def strict_gap_rows(report: Report) -> list[dict]:
    """Per group with paper-correct samples that fail pkb's cases: how many, and under which tags."""
    return [{"set": group, "paper ok": gap.paper_ok, "fail pkb's cases": gap.strict_failed,
             "why: the failing cases' tags": ", ".join(f"{reason} {n}" for reason, n in gap.reasons.items())}
            for group, gap in report.strict_gaps.items() if gap.strict_failed]


PAPER_GAP_COLUMNS = ("set", "pkb ok", "fail the paper's rule", "why")


def paper_gap_rows(report: Report) -> list[dict]:
    """Per group with samples ok by pkb's verdict that fail the paper's: how many, and why."""
    return [{"set": group, "pkb ok": gap.pkb_ok, "fail the paper's rule": gap.paper_failed,
             "why": ", ".join(f"{reason} {n}" for reason, n in gap.reasons.items())}
            for group, gap in report.paper_gaps.items() if gap.paper_failed]


def reason_meanings(report: Report) -> dict[str, str]:
    """What each tag or reason in ``strict_gap_rows`` and ``paper_gap_rows`` means."""
    from pkb.problem import CASE_TAGS
    from pkb.report.metrics import PAPER_ONLY_REASONS, STRICT_ONLY_REASONS

    meanings = {**CASE_TAGS, **STRICT_ONLY_REASONS, **PAPER_ONLY_REASONS}
    used = dict.fromkeys([*(reason for gap in report.strict_gaps.values() for reason in gap.reasons),
                          *(reason for gap in report.paper_gaps.values() for reason in gap.reasons)])
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
                           covered_fast_1=covered.fast())
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
            row[f"fast_{p:g}"] = m.fast(p)
    for k in sorted(set(ks)):
        if k > 1:
            row[f"fast_1@{k}"] = m.fast(1.0, k)
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
    """The one sample's verdict, or ``c/n ok`` over the samples in n (a skip the candidate caused among them:
    metrics.counted), ``+2 skipped`` for the rest."""
    if side is None:
        return "no result"
    verdicts = side.verdicts[protocol]
    if len(verdicts) == 1:
        return verdicts[0]
    left_out = ("skipped", "harness_error", "infra_error", "unknown")
    judged = side.num_counted.get(protocol, sum(1 for v in verdicts if v not in left_out))
    candidate_skips = judged - sum(1 for v in verdicts if v not in left_out)  # skipped, yet in n
    rest = {v: verdicts.count(v) - (candidate_skips if v == "skipped" else 0) for v in left_out if v in verdicts}
    text = f"{side.num_correct[protocol]}/{judged} ok" if judged else ""
    return " ".join([text, *(f"+{n} {v}" for v, n in rest.items() if n)]).strip()


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


