"""Reports: metrics on known rows on both protocols, grouping by solution set and by model, old databases,
`pkb report` outputs (headline, --compare, --table), the headline at the end of `pkb run`, `pkb export-suite`."""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from pkb.evaluate.result import CaseTiming, EvalResult
from pkb.problem import Status
from pkb.report import metrics, records
from pkb.store import db as store_db
from pkb.store.db import ResultStore

REPO = Path(__file__).resolve().parent.parent

# The selection the known rows are judged over: four collectives and one tensor-parallel problem.
SELECTION = {"allreduce": "collectives", "allgather": "collectives", "broadcast": "collectives",
             "reduce": "collectives", "layernorm_backward": "tensor_parallel"}
SELECTION_ARG = "1-4,9"  # the same problems by upstream number


def make_result(problem: str, solution: str, status: Status, speedup: float | None = None,
                roofline: float | None = None, collectives=(), details=None, source: str = "",
                upstream_ok: bool | None = None, solution_set: str | None = None, cases=("upstream", "small_odd"),
                mode: str = "cuda") -> EvalResult:
    """A result row; its set defaults to the folder of a ``dir/stem`` name (``reference`` for a self-check)."""
    if solution_set is None:
        solution_set = "reference" if solution == "reference" else solution.split("/")[0] if "/" in solution else ""
    timings = [CaseTiming("case_a", 1e-4, 1e-4 / speedup, 0.01, 0.02, speedup, 123.0)] if speedup else []
    return EvalResult(problem=problem, problem_version=1, solution=solution, solution_set=solution_set,
                      solution_sha256=hashlib.sha256((source or solution).encode()).hexdigest(), status=status,
                      message=f"{status.value}: {problem} by {solution}", details=details or {}, mode=mode,
                      world_size=4, num_trials=3, cases=list(cases), upstream_ok=upstream_ok, timings=timings,
                      speedup=speedup, roofline_fraction=roofline, collectives_used=list(collectives),
                      times_are_gpu_performance=mode == "cuda")


KNOWN_ROWS = [
    make_result("allreduce", "reference", Status.OK, upstream_ok=True),  # a self-check: never counted
    make_result("allreduce", "alpha/allreduce", Status.OK, 2.5, 0.8, upstream_ok=True),
    make_result("allgather", "alpha/allgather", Status.OK, 0.8, 0.3, collectives=["all_gather_into_tensor"],
                upstream_ok=True),
    make_result("broadcast", "alpha/broadcast", Status.MISMATCH, upstream_ok=True),  # only a stricter case failed
    make_result("reduce", "alpha/reduce", Status.SKIPPED),
    make_result("layernorm_backward", "alpha/layernorm_backward", Status.OK, 1.2, 0.55, upstream_ok=True),
    make_result("allreduce", "beta/allreduce", Status.TIMEOUT, upstream_ok=False),
    make_result("allgather", "beta/allgather", Status.RUNTIME_ERROR, upstream_ok=False),  # replaced by the rerun below
    make_result("allgather", "beta/allgather", Status.OK, 1.6, 0.9, upstream_ok=True),
    make_result("broadcast", "beta/broadcast", Status.COMPILE_ERROR, cases=()),  # fails on any inputs
]

# What the known rows must give, worked out by hand (docs/reports.md says how each counts):
# alpha: reduce is skipped only, so 4 problems count; 3 correct on every case; speedups 2.5, 0.8, 1.2. On the
#   paper's protocol broadcast is correct too (its mismatch came from a stricter case): 4 of 4, no new speedup.
# beta: 5 problems count; only allgather correct (its latest row), speedup 1.6; the same on both protocols.
EXPECTED = {
    "alpha": {"problems": 4, "pass@1": 0.75, "fast_1": 0.5, "fast_2": 0.25,
              "geomean_speedup": (2.5 * 0.8 * 1.2) ** (1 / 3), "median_roofline": 0.55,
              "moves_data_itself": 2 / 3, "failures": {"mismatch": 1}},
    "beta": {"problems": 5, "pass@1": 0.2, "fast_1": 0.2, "fast_2": 0.0, "geomean_speedup": 1.6,
             "median_roofline": 0.9, "moves_data_itself": 1.0, "failures": {"compile_error": 1, "timeout": 1}},
}
EXPECTED_PAPER = {
    "alpha": {**EXPECTED["alpha"], "pass@1": 1.0, "moves_data_itself": 3 / 4, "failures": {}},
    "beta": EXPECTED["beta"],
}


def write_db(path: Path, rows=KNOWN_ROWS) -> Path:
    with ResultStore(path) as store:
        for index, result in enumerate(rows):
            store.add(result, f"key{index}")
    return path


def add_generation(path: Path, **values) -> None:
    """A generations row linking a model's sample to a result, whatever other columns the table requires."""
    conn = sqlite3.connect(path)
    columns = conn.execute("PRAGMA table_info(generations)").fetchall()
    if not columns:
        conn.execute("CREATE TABLE generations (id INTEGER PRIMARY KEY AUTOINCREMENT, model TEXT NOT NULL, "
                     "run TEXT, sample INTEGER, step INTEGER, code TEXT, result_id INTEGER)")
        columns = conn.execute("PRAGMA table_info(generations)").fetchall()
    row = dict(values)
    for _, name, type_, not_null, default, is_key in columns:
        if not_null and not is_key and default is None and name not in row:
            row[name] = 0 if type_.upper() in ("INTEGER", "REAL") else ""
    with conn:
        conn.execute(f"INSERT INTO generations ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", list(row.values()))
    conn.close()


def build(path: Path, group_by: str = "set", ks=(1,), selection: dict[str, str] = SELECTION) -> metrics.Report:
    loaded = records.load(path, group_by, records.Filter(problems=frozenset(selection)), selection)
    return metrics.build_report(loaded.records, selection, loaded.group_by, ks, loaded.notes)


# -- the estimator -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_pass_at_k_equals_the_chance_that_k_samples_drawn_without_replacement_hold_a_correct_one(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            draws = list(itertools.combinations(outcomes, k))
            exact = sum(any(d) for d in draws) / len(draws)
            assert metrics.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


def test_pass_at_k_refuses_more_draws_than_samples():
    with pytest.raises(ValueError, match="k <= n"):
        metrics.pass_at_k(3, 1, 5)


# -- metrics over known rows --------------------------------------------------------------------------


@pytest.mark.parametrize("protocol, expected_by_set", [("pkb", EXPECTED), ("paper", EXPECTED_PAPER)])
def test_metrics_of_known_rows_match_the_hand_computed_numbers(tmp_path, protocol, expected_by_set):
    report = build(write_db(tmp_path / "r.sqlite"))
    assert report.group_by == "set" and report.groups == ("alpha", "beta")  # best first
    for group, expected in expected_by_set.items():
        m = report.on(protocol)[group]
        assert m.protocol == protocol
        assert m.denominator == expected["problems"]
        assert m.pass_at_k[1] == pytest.approx(expected["pass@1"])
        assert m.fast_p[1][1.0] == pytest.approx(expected["fast_1"])
        assert m.fast_p[1][2.0] == pytest.approx(expected["fast_2"])
        assert m.fast_p[1][0.0] == pytest.approx(expected["pass@1"])  # fast_0 is correctness
        assert m.geomean_speedup == pytest.approx(expected["geomean_speedup"])
        assert m.roofline.quantiles["median"] == pytest.approx(expected["median_roofline"])
        assert m.moves_data_itself == pytest.approx(expected["moves_data_itself"])
        assert m.failures == expected["failures"]
        assert m.num_unknown == 0
    alpha = report.on(protocol)["alpha"]
    assert alpha.num_skipped_problems == 1 and alpha.verdicts["skipped"] == 1 and "skipped" not in alpha.failures
    assert dict(alpha.roofline.histogram)["30-40%"] == 1 and dict(alpha.roofline.histogram)["80-90%"] == 1


def test_the_references_self_check_is_summarised_apart_from_the_sets(tmp_path):
    rows = KNOWN_ROWS + [make_result("allgather", "reference", Status.RUNTIME_ERROR, upstream_ok=False),
                         make_result("broadcast", "reference", Status.MISMATCH, upstream_ok=False),
                         make_result("broadcast", "reference", Status.OK, upstream_ok=True)]  # the rerun counts
    check = build(write_db(tmp_path / "r.sqlite", rows)).self_check
    assert (check.num_selected, check.num_checked, check.num_ok, check.num_skipped) == (5, 3, 2, 0)
    assert check.failed == {"allgather": "runtime_error"}
    assert check.summary() == ("references: 2 of 3 ok (1 failed: allgather runtime_error; "
                               "2 of 5 selected problems not checked)")


# Three samples per problem (set "triple"), worked out by hand with the estimator 1 - C(n-c, k) / C(n, k):
#   allreduce: ok 1.5x, ok 0.9x, mismatch (ok on the upstream cases)  n=3, c=2 (paper 3), fast_1 1
#   allgather: ok 0.8x, ok 0.7x, ok 0.5x                              n=3, c=3, fast_1 0
#   broadcast: mismatch, timeout, ok 3.0x, and a harness_error (pkb's own failure: left out)  n=3, c=1, fast_1 1
#   reduce:    a harness_error only: no sample, the problem leaves the denominator
TRIPLE_ROWS = [
    make_result("allreduce", "triple/allreduce_s0", Status.OK, 1.5, 0.6, upstream_ok=True),
    make_result("allreduce", "triple/allreduce_s1", Status.OK, 0.9, 0.2, upstream_ok=True),
    make_result("allreduce", "triple/allreduce_s2", Status.MISMATCH, upstream_ok=True),
    make_result("allgather", "triple/allgather_s0", Status.OK, 0.8, 0.4, upstream_ok=True),
    make_result("allgather", "triple/allgather_s1", Status.OK, 0.7, 0.3, upstream_ok=True),
    make_result("allgather", "triple/allgather_s2", Status.OK, 0.5, 0.1, upstream_ok=True),
    make_result("broadcast", "triple/broadcast_s0", Status.MISMATCH, upstream_ok=False),
    make_result("broadcast", "triple/broadcast_s1", Status.TIMEOUT, upstream_ok=False),
    make_result("broadcast", "triple/broadcast_s2", Status.OK, 3.0, 0.9, upstream_ok=True),
    make_result("broadcast", "triple/broadcast_s3", Status.HARNESS_ERROR),
    make_result("reduce", "triple/reduce_s0", Status.HARNESS_ERROR),
]


def test_fast1_at_3_and_pass_at_k_from_three_samples_per_problem(tmp_path):
    selection = {"allreduce": "collectives", "allgather": "collectives", "broadcast": "collectives",
                 "reduce": "collectives"}
    report = build(write_db(tmp_path / "t.sqlite", TRIPLE_ROWS), ks=(1, 3), selection=selection)
    pkb_m, paper = report.overall["triple"], report.paper["triple"]
    assert pkb_m.denominator == 3 and pkb_m.num_samples == 9  # harness errors are in no denominator
    assert pkb_m.pass_at_k == pytest.approx({1: (2 / 3 + 1 + 1 / 3) / 3, 3: 1.0})
    assert paper.pass_at_k == pytest.approx({1: (1 + 1 + 1 / 3) / 3, 3: 1.0})
    # fast1@3: at least one of the 3 samples correct and faster than the reference: allreduce and broadcast
    assert pkb_m.fast_p[3][1.0] == pytest.approx(2 / 3) and paper.fast_p[3][1.0] == pytest.approx(2 / 3)
    assert pkb_m.fast_p[1][1.0] == pytest.approx((1 / 3 + 0 + 1 / 3) / 3)
    assert pkb_m.fast_p[1][1.5] == pytest.approx((0 + 0 + 1 / 3) / 3)  # 1.5x is not above 1.5
    assert pkb_m.fast_p[1][2.0] == pytest.approx(1 / 9) and pkb_m.fast_p[3][2.0] == pytest.approx(1 / 3)
    assert pkb_m.geomean_speedup == pytest.approx((1.5 * 0.9 * 0.8 * 0.7 * 0.5 * 3.0) ** (1 / 6))
    assert pkb_m.roofline.quantiles["median"] == pytest.approx((0.3 + 0.4) / 2)
    assert pkb_m.failures == {"mismatch": 2, "timeout": 1} and paper.failures == {"mismatch": 1, "timeout": 1}
    assert pkb_m.verdicts["harness_error"] == 2 and "harness_error" not in pkb_m.failures


def test_the_paper_verdict_of_a_row_says_unknown_where_the_upstream_cases_did_not_run():
    upstream = frozenset({"upstream"})
    verdict = lambda result, recorded=True: records.paper_status(result, upstream, recorded)  # noqa: E731
    assert verdict(make_result("allreduce", "a", Status.MISMATCH, upstream_ok=True)) is Status.OK
    assert verdict(make_result("allreduce", "a", Status.TIMEOUT, upstream_ok=False)) is Status.TIMEOUT
    # run with --cases tests: ok on pkb's cases, nothing known about the paper's
    assert verdict(make_result("allreduce", "a", Status.OK, cases=("small_odd",))) is None
    assert verdict(make_result("allreduce", "a", Status.MISMATCH, cases=("small_odd",))) is None
    # failed while loading, before the first upstream trial: a failure on the paper's inputs as well
    assert verdict(make_result("allreduce", "a", Status.CRASH)) is Status.CRASH
    assert verdict(make_result("allreduce", "a", Status.CRASH), recorded=False) is None  # an old row: unknown
    compile_error = make_result("allreduce", "a", Status.COMPILE_ERROR, cases=())
    assert verdict(compile_error, recorded=False) is Status.COMPILE_ERROR  # fails on any inputs, old row or not
    assert verdict(make_result("allreduce", "a", Status.SKIPPED)) is Status.SKIPPED


def test_an_ok_that_left_the_upstream_cases_out_is_unknown_on_both_protocols(tmp_path):
    """pkb's ok requires the paper's: an ok on the tests cases alone is no pass on either protocol, and a
    failure there counts on pkb's only (it fails pkb's whatever the upstream cases would say)."""
    rows = [make_result("allreduce", "tests_only/allreduce", Status.OK, cases=("small_odd",)),
            make_result("allgather", "tests_only/allgather", Status.OK, upstream_ok=True),
            make_result("broadcast", "tests_only/broadcast", Status.MISMATCH, cases=("small_odd",))]
    selection = {"allreduce": "collectives", "allgather": "collectives", "broadcast": "collectives"}
    report = build(write_db(tmp_path / "u.sqlite", rows), selection=selection)
    pkb, paper = report.overall["tests_only"], report.paper["tests_only"]
    assert (pkb.num_unknown, pkb.denominator, pkb.pass_at_k[1]) == (1, 2, 0.5)
    assert (paper.num_unknown, paper.denominator, paper.pass_at_k[1]) == (2, 1, 1.0)


def test_an_ok_stored_with_upstream_rule_failed_fails_both_protocols(tmp_path):
    """A row from before pkb's ok required upstream's rule: ok, with upstream_ok False."""
    rows = [make_result("allreduce", "old/allreduce", Status.OK, upstream_ok=False)]
    report = build(write_db(tmp_path / "o.sqlite", rows), selection={"allreduce": "collectives"})
    assert report.overall["old"].pass_at_k[1] == report.paper["old"].pass_at_k[1] == 0.0
    assert report.overall["old"].verdicts == {"mismatch": 1}


def test_pkb_pass_at_k_is_never_above_the_papers_for_any_mix_of_rows():
    """Random rows of every kind (statuses, paper verdicts known and unknown, upstream cases run or not,
    rows from before pkb required upstream's rule): the report builds (its nesting check raises
    otherwise) and pkb's pass@k of every group, overall and per category, is at most the paper's."""
    import random

    rng = random.Random(36)
    problems = {"allreduce": "collectives", "allgather": "collectives", "ddp": "data_parallel", "ring_attention": "cp"}
    statuses = list(Status)
    for _ in range(200):
        rows = []
        for index in range(rng.randint(1, 14)):
            status = rng.choice(statuses + [Status.OK] * 6)
            rows.append(make_result(rng.choice(list(problems)), f"s{index}", status, solution_set=rng.choice("abc"),
                                    upstream_ok=rng.choice([True, False, None]), source=f"{index}",
                                    cases=rng.choice([("upstream", "small_odd"), ("small_odd",), ()])))
        recs = records.from_results(rows, categories=problems, upstream_cases={p: frozenset({"upstream"}) for p in problems})
        report = metrics.build_report(recs, problems, "set", (1, 2, 3), case_tags={})
        for group in report.groups:
            for strict, loose in [(report.overall[group], report.paper[group]),
                                  *((report.by_category[group][c], report.paper_by_category[group][c])
                                    for c in report.by_category[group])]:
                for k in strict.pass_at_k.keys() & loose.pass_at_k.keys():
                    assert strict.pass_at_k[k] <= loose.pass_at_k[k] + 1e-12, (group, k, rows)


def test_the_nesting_check_fails_a_report_where_pkb_is_above_the_paper():
    ok = metrics.compute([], ["allreduce"], (1,))
    above = metrics.Metrics(**{**ok.__dict__, "pass_at_k": {1: 1.0}})
    with pytest.raises(metrics.NestingError, match="pkb's pass@1 1.0000 is above the paper's 0.0000"):
        metrics.check_nesting(({"a": above}, {"a": {}}), ({"a": ok}, {"a": {}}), "suite")


def test_categories_are_judged_over_their_own_problems(tmp_path):
    report = build(write_db(tmp_path / "r.sqlite"))
    tensor = report.by_category["beta"]["tensor_parallel"]
    assert tensor.num_problems == 1 and tensor.num_attempted == 0 and tensor.pass_at_k[1] == 0.0
    collectives = report.by_category["alpha"]["collectives"]
    assert collectives.denominator == 3 and collectives.pass_at_k[1] == pytest.approx(2 / 3)
    assert report.paper_by_category["alpha"]["collectives"].pass_at_k[1] == 1.0
    assert report.by_category["alpha"]["tensor_parallel"].pass_at_k[1] == 1.0


def test_reference_self_checks_and_unselected_problems_do_not_count(tmp_path):
    rows = KNOWN_ROWS + [make_result("scatter", "alpha/scatter", Status.OK, 9.0, 0.9)]
    report = build(write_db(tmp_path / "r.sqlite", rows))
    assert "reference" not in report.groups
    assert report.overall["alpha"].geomean_speedup == pytest.approx(EXPECTED["alpha"]["geomean_speedup"])


def test_results_group_by_the_set_they_name_never_by_a_file_name_suffix(tmp_path):
    rows = [make_result("allreduce", "1_allreduce_cuda_peer", Status.OK, 2.0, solution_set="gpt5-oneshot", upstream_ok=True),
            make_result("allgather", "2_allgather_cuda_peer", Status.MISMATCH, solution_set="gpt5-oneshot"),
            make_result("allreduce", "1_allreduce_two_step", Status.OK, 1.1, solution_set="pkb shipped", upstream_ok=True),
            make_result("allreduce", "reference", Status.OK, upstream_ok=True)]
    loaded = records.load(write_db(tmp_path / "s.sqlite", rows), "set", records.Filter(), SELECTION)
    assert {(r.result.solution, r.group) for r in loaded.records} == {
        ("1_allreduce_cuda_peer", "gpt5-oneshot"), ("2_allgather_cuda_peer", "gpt5-oneshot"),
        ("1_allreduce_two_step", "pkb shipped"), ("reference", "reference")}
    report = metrics.build_report(loaded.records, SELECTION, loaded.group_by, (1,))
    assert report.groups == ("gpt5-oneshot", "pkb shipped")
    assert report.overall["gpt5-oneshot"].pass_at_k[1] == pytest.approx(1 / 5)
    by_solution = records.load(tmp_path / "s.sqlite", "solution", records.Filter(), SELECTION)
    assert {r.group for r in by_solution.records} == {"1_allreduce_cuda_peer", "2_allgather_cuda_peer",
                                                      "1_allreduce_two_step", "reference"}


@pytest.mark.parametrize("model, run, expected", [
    ("openai:gpt-5", "openai-gpt-5-cuda", "openai-gpt-5-cuda"),  # pkb's default run names say the model
    ("openai:gpt-5", "trial", "openai:gpt-5/trial"),
])
def test_a_generation_runs_set_names_the_model_and_the_run(model, run, expected):
    assert store_db.generated_set(model, run) == expected


# -- old databases --------------------------------------------------------------------------------------


def write_schema_2_db(path: Path, rows: list[tuple[str, dict]], generations: list[tuple[str, str, int]]) -> None:
    """A database as pkb wrote it at schema version 2: no solution_set or upstream_ok column, rows without a set."""
    conn = sqlite3.connect(path)
    conn.executescript(store_db.MIGRATIONS[0])
    conn.executescript(store_db.MIGRATIONS[1])
    for key, row in rows:
        conn.execute(
            "INSERT INTO results (run_key, problem, problem_version, solution, solution_sha256, status, message, mode, "
            "world_size, num_trials, speedup, roofline_fraction, busbw_gbps, times_are_gpu_performance, "
            "collectives_used, hardware, pkb_version, schema_version, created_at, wall_s, result_json) "
            "VALUES (?, ?, 1, ?, ?, ?, '', 'cuda', 4, 3, ?, NULL, NULL, 1, '[]', 'h200', '0', 2, 0, 0, ?)",
            (key, row["problem"], row["solution"], row["solution_sha256"], row["status"], row.get("speedup"),
             json.dumps(row)))
    for model, run, result_id in generations:
        conn.execute("INSERT INTO generations (run, kind, model, provider, problem, problem_version, sample, step, "
                     "backend, hardware, world_size, case_name, max_tokens, system, prompt, status, attempts, "
                     "result_id, pkb_version, created_at) VALUES (?, 'sample', ?, 'openai', 'allreduce', 1, 0, 0, "
                     "'cuda', 'h200', 4, 'upstream', 100, '', '', 'ok', 1, ?, '0', 0)", (run, model, result_id))
    conn.execute("PRAGMA user_version = 2")
    conn.commit()
    conn.close()


def test_a_schema_2_database_migrates_and_its_rows_get_a_set(tmp_path):
    shipped = sorted(store_db.SHIPPED_SOLUTIONS.glob("[0-9]*.py"))[0]
    shipped_sha = hashlib.sha256(shipped.read_text(encoding="utf-8").encode()).hexdigest()
    old = lambda problem, solution, status, sha="x", **more: {  # noqa: E731
        "problem": problem, "problem_version": 1, "solution": solution, "solution_sha256": sha, "status": status,
        "mode": "cuda", "world_size": 4, "num_trials": 3, "cases": ["upstream", "small_odd"], **more}
    rows = [("k1", old("allreduce", "reference", "ok")),
            ("k2", old("allreduce", "run7/sample_0", "ok", sha="g", speedup=1.3)),  # a generation links to it
            ("k3", old("allreduce", shipped.stem, "ok", sha=shipped_sha)),  # pkb's shipped file, by its hash
            ("k4", old("allgather", "mine/allgather", "mismatch", upstream_ok=True)),  # recorded before the column
            ("k5", old("allgather", "allgather_fast", "mismatch"))]  # a --solutions file: its folder is unknown
    path = tmp_path / "old.sqlite"
    write_schema_2_db(path, rows, [("openai:gpt-5", "run7", 2)])

    with ResultStore(path) as store:
        assert store.schema_version == store_db.SCHEMA_VERSION
        stored = store.conn.execute("SELECT solution, solution_set, upstream_ok FROM results ORDER BY id").fetchall()
        assert [r.solution_set for r in store.results()] == [s for _, s, _ in stored]
    assert stored == [("reference", "reference", None), ("run7/sample_0", "openai:gpt-5/run7", None),
                      (shipped.stem, "pkb shipped", None), ("mine/allgather", "mine", 1),
                      ("allgather_fast", "unnamed", None)]
    loaded = records.load(path, "set", records.Filter(), SELECTION)
    paper = {r.result.solution: r.verdict("paper") for r in loaded.records}
    assert paper["mine/allgather"] is Status.OK  # ok on the upstream cases, as recorded
    assert paper["allgather_fast"] is None  # from before upstream_ok: unknown, not a failure
    assert ResultStore(path).schema_version == store_db.SCHEMA_VERSION  # a second open leaves it as it is


def test_a_database_from_a_newer_pkb_is_refused(tmp_path):
    path = tmp_path / "new.sqlite"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {store_db.SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(records.ReportError, match="newer than this pkb"):
        records.load(path, "set", records.Filter(), SELECTION)


# -- grouping by model -------------------------------------------------------------------------------


def test_generations_group_results_by_model_with_unbiased_pass_at_k(tmp_path):
    path = tmp_path / "g.sqlite"
    statuses = [Status.OK, Status.MISMATCH, Status.OK, Status.MISMATCH]
    write_db(path, [make_result("allreduce", f"allreduce_s{i}", s, 1.5 if s is Status.OK else None, source=str(i),
                                upstream_ok=True) for i, s in enumerate(statuses)]
             + [make_result("allgather", "allgather_s0", Status.OK, 0.5, upstream_ok=True)])
    for sample in range(4):
        add_generation(path, model="m1", run="r1", sample=sample, step=0, code=f"# sample {sample}",
                       result_id=sample + 1)
    add_generation(path, model="m2", run="r2", sample=0, step=0, result_id=5)
    selection = {"allreduce": "collectives", "allgather": "collectives"}
    loaded = records.load(path, "model", records.Filter(), selection)
    report = metrics.build_report(loaded.records, selection, loaded.group_by, ks=(1, 2, 8))
    assert report.group_by == "model" and set(report.groups) == {"m1", "m2"}
    m1 = report.overall["m1"]
    # allreduce: 4 samples, 2 correct; allgather: no sample (a failure)
    assert m1.pass_at_k == pytest.approx({1: 0.5 / 2, 2: (1 - 1 / 6) / 2})  # k=8 > n is not estimated
    assert m1.fast_p[2][1.0] == pytest.approx((1 - 1 / 6) / 2)
    assert report.overall["m2"].fast_p[1] == pytest.approx({0.0: 0.5, 0.5: 0.0, 1.0: 0.0, 1.5: 0.0, 2.0: 0.0, 3.0: 0.0})
    code = {r.sample: r.code.text for r in loaded.records if r.group == "m1"}
    assert code["r1 sample 3"] == "# sample 3"
    # by set (the default), a generated result belongs to its model's run, whatever set its row names
    by_set = records.load(path, "set", records.Filter(), selection)
    assert {r.group for r in by_set.records} == {"m1/r1", "m2/r2"}
    assert metrics.build_report(by_set.records, selection, "set", ks=(2,)).overall["m1/r1"].pass_at_k[2] == \
        pytest.approx(m1.pass_at_k[2])


def test_an_agent_sample_counts_its_best_step(tmp_path):
    path = tmp_path / "a.sqlite"
    write_db(path, [make_result("allreduce", "step0", Status.MISMATCH, source="0"),
                    make_result("allreduce", "step1", Status.OK, 2.0, source="1"),
                    make_result("allreduce", "step2", Status.RUNTIME_ERROR, source="2")])
    for step in range(3):
        add_generation(path, model="agent", run="a", sample=0, step=step, result_id=step + 1)
    loaded = records.load(path, "model", records.Filter(), {"allreduce": "collectives"})
    (counted,) = [r for r in loaded.records]
    assert counted.result.solution == "step1" and len(loaded.rows) == 3


def test_model_grouping_without_generations_falls_back_to_solution_sets_and_says_so(tmp_path):
    loaded = records.load(write_db(tmp_path / "r.sqlite"), "model", records.Filter(), SELECTION)
    assert {r.group for r in loaded.records} == {"alpha", "beta", "reference"}
    assert any("grouped by solution set" in note for note in loaded.notes)


def test_code_is_read_from_a_stored_path_only_while_the_file_is_unchanged(tmp_path):
    source = "def solution(tensor):\n    return tensor\n"
    kept, changed = tmp_path / "kept.py", tmp_path / "changed.py"
    kept.write_text(source)
    changed.write_text(source + "# edited after the run\n")
    path = write_db(tmp_path / "r.sqlite", [
        make_result("allreduce", "kept", Status.OK, details={"solution_path": str(kept)}, source=source),
        make_result("allgather", "changed", Status.OK, details={"solution_path": str(changed)}, source=source),
        make_result("broadcast", "nopath", Status.OK, source=source)])
    code = {r.result.solution: r.code for r in records.load(path, "set", records.Filter(), SELECTION).records}
    assert code["kept"].text == source
    assert code["changed"].text is None and "changed since it was evaluated" in code["changed"].origin
    assert code["nopath"].text is None and "unavailable" in code["nopath"].origin


# -- the command -------------------------------------------------------------------------------------


def pkb(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    # as the `pkb` script runs it: under `python -m pkb.cli` the module is __main__, and pkb.cli.UsageError
    # raised by a subcommand module would be a different class from the one main() catches
    command = [sys.executable, "-c", "import sys; from pkb.cli import main; sys.exit(main())", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=300)


def test_report_json_has_the_documented_keys_and_the_database_numbers(tmp_path):
    db = write_db(tmp_path / "r.sqlite")
    done = pkb("report", "--db", str(db), "--problems", SELECTION_ARG, "--format", "json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert {"pass_at_k", "fast_p", "geomean_speedup", "roofline", "failures"} <= set(doc)
    assert doc["num_problems"] == 5 and doc["groups"] == ["alpha", "beta"]
    for group, expected in EXPECTED.items():
        assert doc["pass_at_k"][group]["1"] == pytest.approx(expected["pass@1"])
        assert doc["fast_p"][group]["1"]["1"] == pytest.approx(expected["fast_1"])
        assert doc["fast_p"][group]["1"]["1.5"] is not None
        assert doc["geomean_speedup"][group] == pytest.approx(expected["geomean_speedup"])
        assert doc["roofline"][group]["quantiles"]["median"] == pytest.approx(expected["median_roofline"])
        assert doc["failures"][group] == expected["failures"]
    assert doc["by_category"]["alpha"]["tensor_parallel"]["pass_at_k"]["1"] == 1.0
    for group, expected in EXPECTED_PAPER.items():
        assert doc["paper"]["pass_at_k"][group]["1"] == pytest.approx(expected["pass@1"])
        assert doc["paper"]["failures"][group] == expected["failures"]
    assert doc["self_check"] == {"selected": 5, "checked": 1, "ok": 1, "skipped": 0, "failed": {}}


def test_report_table_is_the_headline_self_check_first_then_a_row_per_set(tmp_path):
    db = write_db(tmp_path / "r.sqlite")
    done = pkb("report", "--db", str(db), "--problems", SELECTION_ARG)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "references: 1 of 1 ok (4 of 5 selected problems not checked)"
    header = next(line for line in lines if line.startswith("set "))
    assert header.split()[:2] == ["set", "problems"] and "pass@1 paper / pkb" in header
    alpha = next(line for line in lines if line.startswith("alpha"))
    assert "4 of 4" in alpha and "100.0% / 75.0%" in alpha and "50.0% / 50.0%" in alpha  # pass@1, fast_1
    # beta has results for 3 of the 5 problems: a row on those, then one on the whole selection (the paper's)
    beta = next(line for line in lines if line.startswith("beta"))
    assert "3 of 3 covered" in beta and "33.3% / 33.3%" in beta and "1 compile_error, 1 timeout" in beta
    beta_suite = lines[lines.index(beta) + 1]
    assert beta_suite.split("  ")[0] == "" and "3 of 5 in the suite" in beta_suite and "20.0% / 20.0%" in beta_suite
    assert any(line.startswith("note: beta has results for 3 of the 5 selected problems") for line in lines)
    assert lines.index(alpha) < lines.index(beta)  # best first
    assert any(line.startswith("paper: correct on the upstream cases") for line in lines)


def test_report_compare_puts_two_sets_side_by_side_problem_by_problem(tmp_path):
    db = write_db(tmp_path / "r.sqlite")
    done = pkb("report", "--db", str(db), "--problems", SELECTION_ARG, "--compare", "alpha", "beta", "--format", "csv")
    assert done.returncode == 0, done.stderr
    rows = {row["problem"]: row for row in csv.DictReader(io.StringIO(done.stdout))}
    assert list(rows) == ["allreduce", "allgather", "broadcast", "reduce", "layernorm_backward"]
    assert (rows["allreduce"]["alpha pkb"], rows["allreduce"]["beta pkb"], rows["allreduce"]["beta paper"]) == \
        ("ok", "timeout", "timeout")
    assert (rows["broadcast"]["alpha paper"], rows["broadcast"]["alpha pkb"]) == ("ok", "mismatch")
    assert rows["layernorm_backward"]["beta pkb"] == "no result" and rows["reduce"]["alpha pkb"] == "skipped"
    assert float(rows["allreduce"]["alpha speedup"]) == 2.5 and rows["allreduce"]["beta speedup"] == ""

    table = pkb("report", "--db", str(db), "--problems", SELECTION_ARG, "--compare", "alpha", "beta")
    assert table.returncode == 0, table.stderr
    assert "pkb: both 1, only alpha 2, only beta 0, neither 2" in table.stdout
    assert "paper: both 1, only alpha 3, only beta 0, neither 1" in table.stdout
    assert "2.50x" in next(line for line in table.stdout.splitlines() if line.startswith("allreduce"))

    unknown = pkb("report", "--db", str(db), "--compare", "alpha", "gamma")
    assert unknown.returncode == 2 and "'gamma' is not one" in unknown.stderr and "alpha, beta" in unknown.stderr


@pytest.mark.parametrize("file_format", ["csv", "json", "parquet"])
def test_report_metrics_table_exports_the_same_numbers_in_every_format(tmp_path, file_format):
    if file_format == "parquet":
        pq = pytest.importorskip("pyarrow.parquet", reason="pip install 'pkb[report]' for parquet")
    db = write_db(tmp_path / "r.sqlite")
    out = tmp_path / f"metrics.{file_format}"
    done = pkb("report", "--db", str(db), "--problems", SELECTION_ARG, "--table", "metrics", "--format", file_format,
               "--k", "1,3", "--out", str(out))
    assert done.returncode == 0, done.stderr
    if file_format == "csv":
        rows = list(csv.DictReader(io.StringIO(out.read_text())))
    elif file_format == "json":
        rows = json.loads(out.read_text())
    else:
        rows = pq.read_table(out).to_pylist()
    # per set: overall and two categories, on two protocols
    assert len(rows) == 2 * 3 * 2
    number = lambda value: None if value in (None, "") else float(value)  # noqa: E731
    cells = {(r["group"], r["category"], r["protocol"]): r for r in rows}
    for group in ("alpha", "beta"):
        for protocol, expected in (("pkb", EXPECTED[group]), ("paper", EXPECTED_PAPER[group])):
            row = cells[(group, "all", protocol)]
            assert number(row["pass@1"]) == pytest.approx(expected["pass@1"])
            assert number(row["fast_1"]) == pytest.approx(expected["fast_1"])
            assert number(row["fast_2"]) == pytest.approx(expected["fast_2"])
            assert number(row["geomean_speedup"]) == pytest.approx(expected["geomean_speedup"])
            assert number(row["median_roofline"]) == pytest.approx(expected["median_roofline"])
            assert json.loads(row["failures"]) == expected["failures"]
            assert number(row["pass@3"]) is None  # one sample per problem: pass@3 cannot be estimated
    assert number(cells[("alpha", "tensor_parallel", "pkb")]["pass@1"]) == 1.0


def test_report_table_csv_and_parquet(tmp_path):
    db = write_db(tmp_path / "r.sqlite")
    table = pkb("report", "--db", str(db), "--problems", SELECTION_ARG)
    assert table.returncode == 0, table.stderr
    alpha_line = next(line for line in table.stdout.splitlines() if line.startswith("alpha"))
    assert "75.0%" in alpha_line and "1.34x" in alpha_line and "1 mismatch" in alpha_line

    done = pkb("report", "--db", str(db), "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(done.stdout)))
    assert len(rows) == len(KNOWN_ROWS)  # every stored row, reruns and self-checks included
    assert [r["status"] for r in rows] == [r.status.value for r in KNOWN_ROWS]
    assert rows[1]["group"] == "alpha" and float(rows[1]["speedup"]) == 2.5 and rows[1]["category"] == "collectives"
    assert json.loads(rows[2]["collectives_used"]) == ["all_gather_into_tensor"]
    assert (rows[3]["solution_set"], rows[3]["status"], rows[3]["upstream_ok"], rows[3]["paper_verdict"]) == \
        ("alpha", "mismatch", "True", "ok")

    pq = pytest.importorskip("pyarrow.parquet", reason="pip install 'pkb[report]' for parquet")
    out = tmp_path / "rows.parquet"
    assert pkb("report", "--db", str(db), "--format", "parquet", "--out", str(out)).returncode == 0
    table = pq.read_table(out)
    assert table.num_rows == len(KNOWN_ROWS)
    assert table.column("speedup").to_pylist()[1] == 2.5 and table.column("status").to_pylist()[3] == "mismatch"


def test_pkb_shipped_examples_are_counted_on_the_problems_they_cover(tmp_path):
    """pkb's shipped solutions are worked examples for a few problems: the run's headline counts those on
    a row of their own, then the whole selection (the paper's denominator) on the next, and a note says
    which is which; the references' self-check covers the whole selection."""
    done = pkb("run", "--problems", "1,9", "--mode", "cpu", "--trials", "1", "--db", str(tmp_path / "r.sqlite"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "references: 2 of 2 ok" in done.stdout  # 9 (layernorm_backward) has no shipped file
    lines = done.stdout.splitlines()
    (shipped,) = [line for line in lines if line.startswith("pkb shipped")]
    assert shipped.split("  ")[1].strip() == "1 of 1 covered" and "100.0% / 100.0%" in shipped  # not 50 %
    suite = lines[lines.index(shipped) + 1]
    assert suite.startswith(" ") and suite.strip().startswith("1 of 2 in the suite  ") and "50.0% / 50.0%" in suite
    assert ("note: pkb shipped has results for 1 of the 2 selected problems: its `covered` row counts those, its "
            "`in the suite` row every selected problem (the 1 without a result as failed)") in lines


def test_pkb_run_ends_with_the_headline_and_stores_each_result_under_its_set(tmp_path):
    db = tmp_path / "run.sqlite"
    done = pkb("run", "--problems", "1-2", "--mode", "cpu", "--trials", "1", "--db", str(db))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "5 results in " + str(db) + ": 3 ok, 2 skipped"  # nothing failed: no table of failures
    headline = lines[lines.index("references: 2 of 2 ok"):]
    assert headline[2].split()[:3] == ["set", "problems", "pass@1"]
    # pkb's shipped solutions: the two-step all-reduce is ok (on the upstream cases too); the CUDA ones skip here
    (shipped,) = [line for line in headline if line.startswith("pkb shipped")]
    assert shipped.split("  ")[1].strip() == "1 of 1 (+1 left out)" and "100.0% / 100.0%" in shipped
    footnote = next(i for i, line in enumerate(headline) if line.startswith("paper: correct on the upstream cases"))
    assert all(line.startswith("note: ") for line in headline[footnote + 2:])  # e.g. a partial sandbox here
    query = "SELECT solution, solution_set, upstream_ok FROM results ORDER BY id"
    stored = sqlite3.connect(db).execute(query).fetchall()
    assert stored == [("reference", "reference", 1), ("1_allreduce_cuda_peer", "pkb shipped", None),
                      ("1_allreduce_two_step", "pkb shipped", 1), ("reference", "reference", 1),
                      ("2_allgather_cuda_peer", "pkb shipped", None)]

    # the same file in a folder of one's own: its verdict is reused (same file, same settings), stored under the set
    folder = tmp_path / "my-folder"
    folder.mkdir()
    (folder / "allreduce_two_step.py").write_text((store_db.SHIPPED_SOLUTIONS / "1_allreduce_two_step.py").read_text())
    mine = pkb("run", "--problems", "1", "--mode", "cpu", "--trials", "1", "--db", str(db), "--solutions", str(folder),
               "--set", "mine")
    assert mine.returncode == 0, mine.stdout + mine.stderr
    assert "(stored earlier)" in mine.stderr
    assert "references: no self-check in these results" in mine.stdout
    assert [line.split()[:3] for line in mine.stdout.splitlines() if line.startswith("mine")] == [["mine", "1", "of"]]
    row = sqlite3.connect(db).execute("SELECT solution, solution_set, status, result_json FROM results "
                                      "ORDER BY id DESC LIMIT 1").fetchone()
    assert row[:3] == ("allreduce_two_step", "mine", "ok") and json.loads(row[3])["details"]["verdict_of"] == 3


def test_report_usage_errors_say_what_to_do(tmp_path):
    missing = pkb("report", "--db", str(tmp_path / "none.sqlite"))
    assert missing.returncode == 2 and "run `pkb run` first" in missing.stderr
    assert not (tmp_path / "none.sqlite").exists()  # reporting never creates a database
    db = write_db(tmp_path / "r.sqlite")
    binary = pkb("report", "--db", str(db), "--format", "parquet")
    assert binary.returncode == 2 and "--out" in binary.stderr
    bad_k = pkb("report", "--db", str(db), "--k", "0")
    assert bad_k.returncode == 2 and "positive integers" in bad_k.stderr


def test_export_suite_writes_a_datasets_directory_with_every_problem(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="pip install 'pkb[report]' for parquet")
    from pkb.registry import all_problems

    out = tmp_path / "suite"
    done = pkb("export-suite", "--format", "parquet", str(out))
    assert done.returncode == 0, done.stderr
    table = pq.read_table(out / "data" / "train-00000-of-00001.parquet")
    rows = {row["slug"]: row for row in table.to_pylist()}
    problems = all_problems()
    assert set(rows) == set(problems)
    for slug, problem in problems.items():
        row = rows[slug]
        assert (row["version"], row["upstream_id"], row["category"]) == (problem.version, problem.upstream_id,
                                                                        problem.category)
        assert row["world_sizes"] == list(problem.world_sizes)
        assert "def reference(" in row["reference_source"] and "PROBLEM" in row["reference_source"]
        assert [c["name"] for c in json.loads(row["tests"])] == [c.name for c in problem.tests]
    card = (out / "README.md").read_text()
    header = card.split("---")[1]
    assert "configs:" in header and "split: train" in header and "path: data/train-*.parquet" in header
    assert f"{len(problems)} distributed workloads" in card


# -- the sandbox note ------------------------------------------------------------------------------------


def sandboxed(level: str = "auto", missing: dict[str, str] | None = None) -> dict:
    """A row's ``details["sandbox"]`` as the evaluator records it."""
    missing = missing or {}
    enforced = [] if level == "off" else [name for name in ("landlock-fs", "network-namespace", "uid-drop")
                                          if name not in missing]
    return {"sandbox": {"level": level, "full": level != "off" and not missing, "enforced": enforced,
                        "missing": missing}}


SANDBOX_ROWS = [
    make_result("allreduce", "reference", Status.OK, upstream_ok=True),  # a self-check with no record: not a set's
    make_result("allreduce", "alpha/allreduce", Status.OK, 2.0, upstream_ok=True),  # older pkb: replaced below
    make_result("allreduce", "alpha/allreduce", Status.OK, 2.0, upstream_ok=True, details=sandboxed()),
    make_result("allgather", "alpha/allgather", Status.OK, 1.5, upstream_ok=True, details=sandboxed("off")),
    make_result("broadcast", "alpha/broadcast", Status.MISMATCH, upstream_ok=False,
                details=sandboxed(missing={"network-namespace": "unprivileged user namespaces disabled"})),
    make_result("reduce", "alpha/reduce", Status.OK, upstream_ok=True),  # older pkb: no record
    make_result("reduce", "alpha/reduce_v2", Status.INFRA_ERROR),  # never ran: no verdict, not counted
    make_result("layernorm_backward", "alpha/layernorm_backward", Status.OK, upstream_ok=True,
                details=sandboxed("required")),
    make_result("allreduce", "beta/allreduce", Status.OK, 1.1, upstream_ok=True, details=sandboxed()),
    make_result("allgather", "beta/allgather", Status.TIMEOUT, upstream_ok=False, details=sandboxed("required")),
]
ALPHA_SANDBOX_NOTE = ("3 of 5 results in set alpha ran without the full sandbox (--sandbox off: 1; partial: 1; "
                      "no record (older pkb): 1)")


def test_the_sandbox_note_counts_off_partial_and_unrecorded_results_per_set(tmp_path):
    from pkb.report import tables

    report = build(write_db(tmp_path / "r.sqlite", SANDBOX_ROWS))
    alpha = report.sandbox("alpha")
    assert (alpha.num_results, alpha.num_without_full) == (5, 3)
    assert alpha.num_by_gap == {"off": 1, "partial": 1, "unrecorded": 1}
    assert report.sandbox("alpha", "tensor_parallel").num_without_full == 0
    assert report.sandbox("beta").num_without_full == 0
    assert tables.sandbox_notes(report) == {"alpha": ALPHA_SANDBOX_NOTE}  # beta ran fully sandboxed: no note
    assert ALPHA_SANDBOX_NOTE in tables.headline_notes(report)

    metric_rows = {(r["group"], r["category"], r["protocol"]): r for r in tables.metrics_table(report)}
    assert metric_rows[("alpha", "all", "pkb")]["results_without_full_sandbox"] == 3
    assert metric_rows[("alpha", "collectives", "paper")]["results_without_full_sandbox"] == 3
    assert metric_rows[("alpha", "tensor_parallel", "pkb")]["results_without_full_sandbox"] == 0
    assert metric_rows[("beta", "all", "pkb")]["results_without_full_sandbox"] == 0


def test_no_sandbox_note_when_every_result_ran_under_the_full_sandbox(tmp_path):
    from pkb.report import tables

    rows = [row for row in SANDBOX_ROWS if row.solution_set == "beta" or row.solution == "reference"]
    report = build(write_db(tmp_path / "r.sqlite", rows))
    assert report.groups == ("beta",) and tables.sandbox_notes(report) == {}
    assert not any("sandbox" in note for note in tables.headline_notes(report))


def test_pkb_report_and_pkb_runs_headline_print_the_sandbox_note(tmp_path, capsys):
    from pkb.cli import print_run_summary
    from pkb.registry import get_problem

    db = write_db(tmp_path / "r.sqlite", SANDBOX_ROWS)
    done = pkb("report", "--db", str(db), "--problems", SELECTION_ARG)
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stdout.splitlines() if "sandbox" in line]
    assert notes == [f"note: {ALPHA_SANDBOX_NOTE}"]

    print_run_summary(SANDBOX_ROWS, [get_problem(name) for name in SELECTION], str(db))
    notes = [line for line in capsys.readouterr().out.splitlines() if "sandbox" in line]
    assert notes == [f"note: {ALPHA_SANDBOX_NOTE}"]
