"""Reports on known rows, without running pkb: metrics on both protocols, the references' self-check, grouping
by solution set and by model, old databases, the code a report shows, and the sandbox note."""

from __future__ import annotations

import hashlib
import itertools
import json
import sqlite3
from pathlib import Path

import pytest

from pkb.options import Status
from pkb.report import metrics, records
from pkb.store import db as store_db
from pkb.store.db import ResultStore, generated_set
from helpers.reports import (ALPHA_SANDBOX_NOTE, EXPECTED, EXPECTED_PAPER, KNOWN_ROWS, SANDBOX_ROWS, SELECTION, build,
                             make_result, write_db)


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


def test_an_ok_that_left_the_upstream_cases_out_is_a_pass_on_pkbs_protocol_and_unknown_on_the_papers(tmp_path):
    """pkb's verdict is its own: an ok on the tests cases alone passes pkb's protocol; the paper's knows nothing of
    that sample (and a failure on the tests cases alone says nothing of the paper's inputs either)."""
    rows = [make_result("allreduce", "tests_only/allreduce", Status.OK, cases=("small_odd",)),
            make_result("allgather", "tests_only/allgather", Status.OK, upstream_ok=True),
            make_result("broadcast", "tests_only/broadcast", Status.MISMATCH, cases=("small_odd",))]
    selection = {"allreduce": "collectives", "allgather": "collectives", "broadcast": "collectives"}
    report = build(write_db(tmp_path / "u.sqlite", rows), selection=selection)
    pkb, paper = report.overall["tests_only"], report.paper["tests_only"]
    assert (pkb.num_unknown, pkb.denominator, pkb.pass_at_k[1]) == (0, 3, pytest.approx(2 / 3))
    assert (paper.num_unknown, paper.denominator, paper.pass_at_k[1]) == (2, 1, 1.0)


def test_the_two_verdicts_count_apart_each_may_pass_where_the_other_fails(tmp_path):
    """ok by pkb's rule and failed by the paper's (an honest fp32 sum that upstream's allclose misses), and the
    other way round (a biased answer upstream's constants cannot see): each protocol counts its own verdict."""
    failed = {"upstream": {"failed": {"case": "upstream", "trial": 2, "status": "mismatch", "reason": "..."}}}
    rows = [make_result("allreduce", "mixed/allreduce", Status.OK, upstream_ok=False, details=failed),
            make_result("allgather", "mixed/allgather", Status.MISMATCH, upstream_ok=True)]
    report = build(write_db(tmp_path / "o.sqlite", rows), selection={"allreduce": "collectives",
                                                                    "allgather": "collectives"})
    pkb, paper = report.overall["mixed"], report.paper["mixed"]
    assert pkb.pass_at_k[1] == paper.pass_at_k[1] == 0.5
    assert pkb.verdicts == {"ok": 1, "mismatch": 1} and paper.verdicts == {"ok": 1, "mismatch": 1}
    by_sample = {r.problem: (r.verdict("pkb"), r.verdict("paper")) for r in report.records}
    assert by_sample == {"allreduce": (Status.OK, Status.MISMATCH), "allgather": (Status.MISMATCH, Status.OK)}


def test_the_papers_verdict_is_what_its_first_failing_trial_earned():
    upstream = frozenset({"upstream"})
    timed_out = {"upstream": {"failed": {"case": "upstream", "trial": 0, "status": "timeout", "reason": "..."}}}
    assert records.paper_status(make_result("allreduce", "a", Status.OK, upstream_ok=False, details=timed_out),
                                upstream) is Status.TIMEOUT
    assert records.paper_status(make_result("allreduce", "a", Status.IMPORT_ERROR, upstream_ok=False),
                                upstream) is Status.IMPORT_ERROR


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
    # by set (the default), a generated result belongs to its model's run (and to a named set its row was stored
    # under by `pkb run`, below)
    by_set = records.load(path, "set", records.Filter(), selection)
    assert {r.group for r in by_set.records} == {"m1/r1", "m2/r2"}
    assert metrics.build_report(by_set.records, selection, "set", ks=(2,)).overall["m1/r1"].pass_at_k[2] == \
        pytest.approx(m1.pass_at_k[2])


def test_a_sets_result_that_a_generation_reuses_stays_in_its_set(tmp_path):
    """`pkb run --solutions runs/mine` stores a result under the set `mine`; a later `pkb generate --model
    replay:runs/mine` judges the same file the same way and links its sample to that result. The result is then a
    sample of the replay's run and still one of `mine`: the set does not vanish from the report."""
    path = tmp_path / "reused.sqlite"
    write_db(path, [make_result("allreduce", "mine/allreduce", Status.OK, 1.2, upstream_ok=True)])
    add_generation(path, model="replay:runs/mine", run="replay-runs-mine-on-cpu", sample=0, step=0, result_id=1)
    selection = {"allreduce": "collectives"}
    by_set = records.load(path, "set", records.Filter(), selection)
    assert {r.group for r in by_set.records} == {"mine", generated_set("replay:runs/mine", "replay-runs-mine-on-cpu")}
    by_model = records.load(path, "model", records.Filter(), selection)
    assert {r.group for r in by_model.records} == {"replay:runs/mine"}


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


# -- the sandbox note ------------------------------------------------------------------------------------


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


# -- speed only where it means something ---------------------------------------------------------------

OFF_GPU_ROWS = [
    make_result("allreduce", "alpha/allreduce", Status.OK, 2.0, 0.5, upstream_ok=True),  # timed on GPUs
    make_result("allgather", "alpha/allgather", Status.OK, 0.7, 0.1, upstream_ok=True, mode="cpu"),
    make_result("allreduce", "beta/allreduce", Status.OK, 1.3, 0.2, upstream_ok=True, mode="cpu"),
    make_result("allgather", "beta/allgather", Status.OK, 1.6, 0.3, upstream_ok=True, mode="shared-gpu"),
]


def test_fast_p_the_geomean_and_the_roofline_count_only_gpu_timings_in_cuda_mode(tmp_path):
    """The issue's cpu speedups (0.68x-1.25x of the same file between runs) filled fast_1 and the geomean: they
    count nowhere now, and are shown apart, labelled, only when asked for."""
    from pkb.report import tables

    loaded = records.load(write_db(tmp_path / "r.sqlite", OFF_GPU_ROWS), "set",
                          records.Filter(problems=frozenset(SELECTION)), SELECTION)
    report = metrics.build_report(loaded.records, SELECTION, "set", (1,))
    alpha, beta = report.overall["alpha"], report.overall["beta"]
    assert (alpha.geomean_speedup, alpha.num_timed, alpha.roofline.count) == (2.0, 1, 1)
    assert alpha.fast(1.0) == pytest.approx(1 / 5) and alpha.pass_at_k[1] == pytest.approx(2 / 5)
    assert (beta.geomean_speedup, beta.num_timed, beta.roofline.count, beta.timed) == (None, 0, 0, False)
    assert beta.fast(1.0) is None and beta.fast(0.0) == beta.pass_at_k[1] == pytest.approx(2 / 5)
    assert beta.off_gpu == metrics.OffGpuTimings(2, pytest.approx((1.3 * 1.6) ** 0.5), ("cpu", "shared-gpu"))
    rows = {row["set"]: row for row in tables.headline_rows(report)}
    assert (rows["beta"]["fast_1 paper / pkb"], rows["beta"]["geomean speedup"]) == ("- / -", "-")
    assert rows["alpha"]["geomean speedup"] == "2.00x" and tables.OFF_GPU_COLUMN not in rows["alpha"]
    document = report.to_json()
    assert document["fast_p"]["beta"]["1"]["1"] is None and document["geomean_speedup"]["beta"] is None
    assert document["fast_p"]["alpha"]["1"]["1"] == pytest.approx(1 / 5) and "off_gpu_timings" not in document
    assert any("`pkb report --off-gpu-timings` shows them apart" in note for note in tables.headline_notes(report))

    shown = metrics.build_report(loaded.records, SELECTION, "set", (1,), off_gpu_shown=True)
    rows = {row["set"]: row for row in tables.headline_rows(shown)}
    assert rows["beta"][tables.OFF_GPU_COLUMN] == "1.44x (cpu, shared-gpu, 2 samples)"
    assert rows["beta"]["geomean speedup"] == "-"  # shown apart, never mixed in
    assert shown.to_json()["off_gpu_timings"]["beta"]["modes"] == ["cpu", "shared-gpu"]


def test_an_untimed_set_shows_a_dash_for_fast_1_in_every_table_and_the_json(tmp_path):
    """The issue's untimed set read `fast_1 0.0%` in one table and `-` in another."""
    from pkb.report import html as report_html
    from helpers.reports import Page

    rows = [make_result("allreduce", "untimed/allreduce", Status.OK, upstream_ok=True),
            make_result("allgather", "timed/allgather", Status.OK, 1.5, 0.4, upstream_ok=True)]
    report = build(write_db(tmp_path / "r.sqlite", rows), ks=(1,))
    page = Page()
    page.feed(report_html.render(report))
    untimed = {metric: text for (group, metric), (_, text) in page.cells.items() if group == "untimed"}
    fast_cells = {metric: text for metric, text in untimed.items() if "fast_" in metric}
    assert fast_cells and set(fast_cells.values()) == {"-"}, fast_cells  # headline, leaderboard, per category
    assert {"headline.pkb.fast_1", "fast_1", "collectives.fast_1"} <= set(fast_cells)
    assert page.cells[("timed", "fast_1")][1] == "20.0%"
    assert report.to_json()["fast_p"]["untimed"]["1"]["1"] is None
    assert report.to_json()["by_category"]["untimed"]["collectives"]["fast_p"]["1"]["1"] is None


def test_the_statuses_left_out_of_pass_at_k_are_the_ones_the_docs_name_with_the_rule_said_once():
    """docs/reports.md says which statuses a set's pass@k leaves out and why they may be (the parent process alone
    decides them), with the rule once; the README and docs/usage.md say the same and point there."""
    repo = Path(__file__).resolve().parents[2]
    left_out = {status.value for status in metrics.NOT_FAILURES} - {"ok"}
    assert left_out == {"skipped", "harness_error", "infra_error"}
    reports, readme, usage = ((repo / name).read_text() for name in ("docs/reports.md", "README.md", "docs/usage.md"))
    rule = "no status a candidate can cause is better for it than failing"
    flat = " ".join(reports.split())
    assert flat.count(rule) == 1 and "the parent process alone decides them" in flat
    assert all(f"`{status}`" in flat.split(rule)[0][-1200:] for status in left_out)  # named beside the rule
    for text in (readme, usage):
        flat = " ".join(text.split())
        assert rule in flat and "docs/reports.md" in flat and all(f"`{status}`" in flat for status in left_out)
        assert "alone decides" in flat


# -- who caused a skip ------------------------------------------------------------------------------------


def _skipped(problem: str, solution: str, message: str, skipped_by: str | None = None):
    """A ``skipped`` row with pkb's ``message``, and ``details.skipped_by`` where given (None: a row from before it)."""
    row = make_result(problem, solution, Status.SKIPPED, details={"skipped_by": skipped_by} if skipped_by else None)
    row.message = message
    return row


SKIP_ROWS = [
    make_result("allreduce", "hacker/allreduce_s0", Status.OK, upstream_ok=True),
    # a wrong file whose dead `x.cuda()` turned its failure into `skipped` (pkb.evaluate.failures): in n, not passed
    _skipped("allreduce", "hacker/allreduce_s1", "the candidate needs a GPU (its source line 15: calls tensor.cuda()) "
             "and mode cpu has none: counted as not passed (run it with --mode cuda or shared-gpu)", "candidate"),
    _skipped("allgather", "hacker/allgather", "the candidate uses NVSHMEM (its source line 3: imports nvshmem.core), "
             "which this run cannot give (cpu mode on 2 node(s))", "candidate"),
    _skipped("broadcast", "hacker/broadcast", "rank 1 failed while the GPU the ranks share was full (GPU 0: 79.1 of "
             "79.6 GiB used): ...", "candidate"),
    _skipped("reduce", "hacker/reduce", "reduce runs at world sizes [2, 4, 8], not 3", "run"),  # every candidate alike
    # rows from before details.skipped_by: pkb's own message says who caused it
    _skipped("allreduce", "old/allreduce", "the candidate declares REQUIRES = ('cuda',); mode cpu has no GPU (run it "
             "with --mode cuda or shared-gpu)"),
    _skipped("allgather", "old/allgather", "allgather runs in bf16, not fp8"),
    make_result("broadcast", "old/broadcast", Status.OK, upstream_ok=True),
]
SKIP_SELECTION = {"allreduce": "collectives", "allgather": "collectives", "broadcast": "collectives",
                  "reduce": "collectives"}


@pytest.mark.parametrize("protocol", ["pkb", "paper"])
def test_a_skip_the_candidate_caused_counts_as_not_passed_and_one_the_run_caused_leaves_n(tmp_path, protocol):
    """The red team's holes: a wrong file that makes its own failure ``skipped`` (dead CUDA code, NVSHMEM in a
    comment, a shared GPU it filled) left pass@k's n, so a problem of such files alone left the denominator. A skip
    the candidate caused now counts in n as not passed, on both protocols; a skip the run caused (the problem does not
    run at this world size: every candidate alike) still leaves n."""
    report = build(write_db(tmp_path / "s.sqlite", SKIP_ROWS), selection=SKIP_SELECTION)
    hacker, old = report.on(protocol)["hacker"], report.on(protocol)["old"]
    # hacker: allreduce 1 of 2, allgather 0 of 1, broadcast 0 of 1; reduce left out (the run's skip)
    assert (hacker.denominator, hacker.num_samples, hacker.num_candidate_skips) == (3, 4, 3)
    assert hacker.pass_at_k[1] == pytest.approx((1 / 2 + 0 + 0) / 3)
    assert hacker.failures == {"skipped": 3} and hacker.verdicts == {"ok": 1, "skipped": 4}
    # old rows: the declared REQUIRES is the candidate's (allreduce 0 of 1); the dtype the run's (allgather left out)
    assert (old.denominator, old.num_samples, old.pass_at_k[1]) == (3, 2, pytest.approx(1 / 3))
    assert old.failures == {"skipped": 1}
    assert report.to_json()["skipped_by_candidate"] == {"hacker": 3, "old": 1}
    (run_skip,) = [r for r in report.records if r.sample == "hacker/reduce"]
    assert metrics.skipped_by_candidate(run_skip, protocol) is False and metrics.counted(run_skip, protocol) is False


def test_a_skip_on_the_papers_trials_alone_is_the_candidates(tmp_path):
    """A trial of the upstream cases that ends ``skipped`` (the candidate's code needs a GPU) while pkb's verdict is
    another comes from the candidate's failure: the run's skips come before any trial. It counts as not passed."""
    failed = {"upstream": {"failed": {"case": "upstream", "trial": 0, "status": "skipped", "reason": "needs a GPU"}}}
    rows = [make_result("allreduce", "paper_skip/allreduce", Status.OK, upstream_ok=False, details=failed)]
    report = build(write_db(tmp_path / "p.sqlite", rows), selection={"allreduce": "collectives"})
    paper = report.paper["paper_skip"]
    assert (paper.denominator, paper.num_samples, paper.pass_at_k[1], paper.failures) == (1, 1, 0.0, {"skipped": 1})
    assert report.overall["paper_skip"].pass_at_k[1] == 1.0


def test_the_headline_says_how_many_skips_count_as_not_passed_and_what_they_need(tmp_path):
    from pkb.report import tables

    report = build(write_db(tmp_path / "n.sqlite", SKIP_ROWS), selection=SKIP_SELECTION)
    notes = tables.headline_notes(report)
    (hacker,) = [note for note in notes if note.startswith("hacker: ")]
    assert hacker.startswith("hacker: 3 skipped results count as not passed")
    for said in ("1 needs a GPU", "1 needs NVSHMEM", "1 failed while the GPU the ranks share was full", "--mode cuda"):
        assert said in hacker, hacker
    assert any(note.startswith("old: 1 skipped result counts as not passed") for note in notes), notes
    rows = {row["set"]: row for row in tables.headline_rows(report)}
    assert rows["hacker"]["failures (pkb)"] == "3 skipped" and rows["hacker"]["covers"] == "4 of 4, 1 left out"


def test_two_sets_compared_count_a_skip_the_candidate_caused_among_the_samples(tmp_path):
    from pkb.report import tables

    report = build(write_db(tmp_path / "c.sqlite", SKIP_ROWS), selection=SKIP_SELECTION)
    rows = {row["problem"]: row for row in tables.compare_table(metrics.compare(report, "hacker", "old"))}
    assert rows["allreduce"]["hacker pkb"] == "1/2 ok"  # the skipped sample is in n, not passed
    assert rows["allgather"]["old pkb"] == "skipped"
