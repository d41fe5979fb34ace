"""Reports say why a sample correct on the paper's protocol fails pkb's cases (its failing case's tags), and
keep each precision's results apart (issue 28)."""

from __future__ import annotations

import json

from pkb.cli import main
from pkb.evaluate.result import Details, EvalResult
from pkb.options import Status
from pkb.problem import CASE_TAGS
from pkb.registry import all_problems
from pkb.report import html, metrics, records
from pkb.report.tables import paper_gap_rows, strict_gap_rows
from pkb.store.db import ResultStore

PROBLEMS = {"allgather": "collectives", "allreduce": "collectives", "moe_pre_all2all": "expert_parallel"}
TAGS = {"allgather": {"odd": ("odd_sizes",), "single": ("tiny", "odd_sizes")},
        "moe_pre_all2all": {"uneven_with_empty_rank": ("uneven_sizes", "empty_rank")}}


def _result(problem, solution, status, upstream_ok, case=None, solution_set="models", precision="bf16"):
    details = Details(case=case) if case else Details()
    return EvalResult(problem=problem, problem_version=1, solution=solution, solution_sha256=solution, status=status,
                      solution_set=solution_set, upstream_ok=upstream_ok, details=details, precision=precision,
                      world_size=2, cases=["upstream", "odd"])


RESULTS = [
    _result("allgather", "a", Status.MISMATCH, True, "odd"),
    _result("allreduce", "b", Status.MISMATCH, True, "upstream"),  # stricter comparison on the upstream inputs
    _result("moe_pre_all2all", "c", Status.TIMEOUT, True, "uneven_with_empty_rank"),
    _result("moe_pre_all2all", "d", Status.MISMATCH, True, "uneven_with_empty_rank"),
    _result("allgather", "e", Status.MISMATCH, False, "upstream"),  # wrong on the paper's inputs: not counted
    _result("allreduce", "f", Status.OK, True),
    _result("allgather", "g", Status.RUNTIME_ERROR, True, "single"),
]


def test_strict_gaps_count_paper_correct_samples_under_their_failing_cases_tags():
    report = metrics.build_report(records.from_results(RESULTS, PROBLEMS), PROBLEMS, "set", case_tags=TAGS)
    gap = report.strict_gaps["models"]
    assert (gap.paper_ok, gap.strict_failed) == (6, 5)
    assert gap.reasons == {"odd_sizes": 2, "strict_check": 1, "timeout_or_crash": 1, "uneven_sizes": 1,
                           "empty_rank": 1, "tiny": 1}
    row, = strict_gap_rows(report)
    assert row["paper ok"] == 6 and row["fail pkb's cases"] == 5 and row["why: the failing cases' tags"].startswith("odd_sizes 2")
    assert report.to_json()["strict_gaps"]["models"]["reasons"]["odd_sizes"] == 2
    page = html.render(report)
    assert "failing pkb&#x27;s cases" in page and "uneven_sizes" in page and CASE_TAGS["uneven_sizes"] in page


def test_a_precision_other_than_bf16_is_its_own_group():
    results = [_result("allgather", "a", Status.OK, True), _result("allgather", "a", Status.MISMATCH, True, "odd",
                                                                   precision="fp32")]
    report = metrics.build_report(records.from_results(results, PROBLEMS), PROBLEMS, "set", case_tags=TAGS)
    assert set(report.groups) == {"models", "models [fp32]"}
    assert report.overall["models"].verdicts == {"ok": 1} and report.overall["models [fp32]"].verdicts == {"mismatch": 1}


def test_pkb_report_prints_the_tags_and_filters_by_dtype(tmp_path, capsys):
    db = tmp_path / "results.sqlite"
    problems = all_problems()
    tagged = next((p.name, c) for p in problems.values() for c in p.tests if c.tags)
    with ResultStore(db) as store:
        for result in (_result(tagged[0], "a", Status.MISMATCH, True, tagged[1].name),
                       _result(tagged[0], "b", Status.OK, True, precision="fp16")):
            result.problem_version = problems[tagged[0]].version
            store.add(result, result.solution)
    assert main(["report", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "failing pkb's stricter cases" in out
    for tag in tagged[1].tags:
        assert f"{tag} 1" in out and CASE_TAGS[tag] in out
    assert main(["report", "--db", str(db), "--dtype", "fp16", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["groups"] == ["models [fp16]"]


def test_every_tests_case_has_a_tag():
    untagged = [f"{p.name}/{c.name}" for p in all_problems().values() for c in p.tests if not c.tags]
    assert not untagged, f"tests cases without tags (pkb.problem.CASE_TAGS): {untagged}"


def test_ok_for_pkb_but_not_by_upstreams_rule_is_a_paper_mismatch():
    result = _result("allreduce", "a", Status.OK, False)
    assert records.paper_status(result, frozenset({"upstream"})) is Status.MISMATCH


def test_paper_gaps_count_pkb_correct_samples_that_fail_the_papers_rule_and_why():
    """The other direction of the two verdicts' disagreement: ok by pkb's rule, failed by upstream's, and why in a
    reader's words (more accurate than the reference, a rounding or two, wrong on upstream's own values alone)."""
    def failed_paper(name, status, rms_ratio=None):
        details = Details(upstream={"failed": {"status": status}},
                          accuracy={"least_accurate": {"rms_ratio": rms_ratio}} if rms_ratio is not None else None)
        return EvalResult(problem="allreduce", problem_version=1, solution=name, solution_sha256=name,
                          status=Status.OK, solution_set="models", upstream_ok=False, details=details, world_size=2,
                          cases=["upstream"])
    results = [failed_paper("fp32_partials", "mismatch", 0.49), failed_paper("ring", "mismatch", 1.8),
               failed_paper("on_constants", "mismatch"), failed_paper("hangs_there", "timeout"),
               _result("allreduce", "fine", Status.OK, True)]
    report = metrics.build_report(records.from_results(results, PROBLEMS), PROBLEMS, "set", case_tags=TAGS)
    gap = report.paper_gaps["models"]
    assert (gap.pkb_ok, gap.paper_failed) == (5, 4)
    assert gap.reasons == {"more_accurate": 1, "rounding": 1, "upstream_values": 1, "timeout_or_crash": 1}
    assert report.to_json()["paper_gaps"]["models"]["paper_failed"] == 4
    row, = paper_gap_rows(report)
    assert row["fail the paper's rule"] == 4 and "more_accurate 1" in row["why"]
