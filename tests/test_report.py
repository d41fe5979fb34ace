"""Reports: metrics on known rows, grouping by solution set and by model, `pkb report` outputs, `pkb export-suite`."""

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
from pkb.store.db import ResultStore

REPO = Path(__file__).resolve().parent.parent

# The selection the known rows are judged over: four collectives and one tensor-parallel problem.
SELECTION = {"allreduce": "collectives", "allgather": "collectives", "broadcast": "collectives",
             "reduce": "collectives", "layernorm_backward": "tensor_parallel"}
SELECTION_ARG = "1-4,9"  # the same problems by upstream number


def make_result(problem: str, solution: str, status: Status, speedup: float | None = None,
                roofline: float | None = None, collectives=(), details=None, source: str = "") -> EvalResult:
    timings = [CaseTiming("case_a", 1e-4, 1e-4 / speedup, 0.01, 0.02, speedup, 123.0)] if speedup else []
    return EvalResult(problem=problem, problem_version=1, solution=solution,
                      solution_sha256=hashlib.sha256(source.encode()).hexdigest(), status=status,
                      message=f"{status.value}: {problem} by {solution}", details=details or {}, mode="cuda",
                      world_size=4, num_trials=3, timings=timings, speedup=speedup, roofline_fraction=roofline,
                      collectives_used=list(collectives), times_are_gpu_performance=True)


KNOWN_ROWS = [
    make_result("allreduce", "reference", Status.OK),  # a self-check: never counted
    make_result("allreduce", "alpha/allreduce", Status.OK, 2.5, 0.8),
    make_result("allgather", "alpha/allgather", Status.OK, 0.8, 0.3, collectives=["all_gather_into_tensor"]),
    make_result("broadcast", "alpha/broadcast", Status.MISMATCH),
    make_result("reduce", "alpha/reduce", Status.SKIPPED),
    make_result("layernorm_backward", "alpha/layernorm_backward", Status.OK, 1.2, 0.55),
    make_result("allreduce", "beta/allreduce", Status.TIMEOUT),
    make_result("allgather", "beta/allgather", Status.RUNTIME_ERROR),  # replaced by the rerun below
    make_result("allgather", "beta/allgather", Status.OK, 1.6, 0.9),
    make_result("broadcast", "beta/broadcast", Status.COMPILE_ERROR),
]

# What the known rows must give, worked out by hand (docs/reports.md says how each counts):
# alpha: reduce is skipped only, so 4 problems count; 3 correct; speedups 2.5, 0.8, 1.2.
# beta: 5 problems count; only allgather correct (its latest row), speedup 1.6.
EXPECTED = {
    "alpha": {"problems": 4, "pass@1": 0.75, "fast_1": 0.5, "fast_2": 0.25,
              "geomean_speedup": (2.5 * 0.8 * 1.2) ** (1 / 3), "median_roofline": 0.55,
              "moves_data_itself": 2 / 3, "failures": {"mismatch": 1}},
    "beta": {"problems": 5, "pass@1": 0.2, "fast_1": 0.2, "fast_2": 0.0, "geomean_speedup": 1.6,
             "median_roofline": 0.9, "moves_data_itself": 1.0, "failures": {"compile_error": 1, "timeout": 1}},
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


def build(path: Path, group_by: str = "auto", ks=(1,), selection: dict[str, str] = SELECTION) -> metrics.Report:
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


def test_metrics_of_known_rows_match_the_hand_computed_numbers(tmp_path):
    report = build(write_db(tmp_path / "r.sqlite"))
    assert report.group_by == "set" and report.groups == ("alpha", "beta")  # best first
    for group, expected in EXPECTED.items():
        m = report.overall[group]
        assert m.denominator == expected["problems"]
        assert m.pass_at_k[1] == pytest.approx(expected["pass@1"])
        assert m.fast_p[1][1.0] == pytest.approx(expected["fast_1"])
        assert m.fast_p[1][2.0] == pytest.approx(expected["fast_2"])
        assert m.fast_p[1][0.0] == pytest.approx(expected["pass@1"])  # fast_0 is correctness
        assert m.geomean_speedup == pytest.approx(expected["geomean_speedup"])
        assert m.roofline.quantiles["median"] == pytest.approx(expected["median_roofline"])
        assert m.moves_data_itself == pytest.approx(expected["moves_data_itself"])
        assert m.failures == expected["failures"]
    alpha = report.overall["alpha"]
    assert alpha.num_skipped_problems == 1 and alpha.verdicts["skipped"] == 1 and "skipped" not in alpha.failures
    assert dict(alpha.roofline.histogram)["30-40%"] == 1 and dict(alpha.roofline.histogram)["80-90%"] == 1


def test_categories_are_judged_over_their_own_problems(tmp_path):
    report = build(write_db(tmp_path / "r.sqlite"))
    tensor = report.by_category["beta"]["tensor_parallel"]
    assert tensor.num_problems == 1 and tensor.num_attempted == 0 and tensor.pass_at_k[1] == 0.0
    collectives = report.by_category["alpha"]["collectives"]
    assert collectives.denominator == 3 and collectives.pass_at_k[1] == pytest.approx(2 / 3)
    assert report.by_category["alpha"]["tensor_parallel"].pass_at_k[1] == 1.0


def test_reference_self_checks_and_unselected_problems_do_not_count(tmp_path):
    rows = KNOWN_ROWS + [make_result("scatter", "alpha/scatter", Status.OK, 9.0, 0.9)]
    report = build(write_db(tmp_path / "r.sqlite", rows))
    assert "reference" not in report.groups
    assert report.overall["alpha"].geomean_speedup == pytest.approx(EXPECTED["alpha"]["geomean_speedup"])


@pytest.mark.parametrize("solution, problem, expected", [
    ("1_allreduce_cuda_peer", "allreduce", "cuda_peer"),
    ("7_reducescatter_triton", "reducescatter", "triton"),
    ("allreduce", "allreduce", "solutions"),
    ("allgather_mine", "allgather", "mine"),
    ("runs/gpt/allreduce", "allreduce", "runs/gpt"),
])
def test_solution_sets_come_from_the_directory_or_the_name_after_the_problem(solution, problem, expected):
    assert records.solution_set(solution, problem) == expected


# -- grouping by model -------------------------------------------------------------------------------


def test_generations_group_results_by_model_with_unbiased_pass_at_k(tmp_path):
    path = tmp_path / "g.sqlite"
    statuses = [Status.OK, Status.MISMATCH, Status.OK, Status.MISMATCH]
    write_db(path, [make_result("allreduce", f"allreduce_s{i}", s, 1.5 if s is Status.OK else None, source=str(i))
                    for i, s in enumerate(statuses)] + [make_result("allgather", "allgather_s0", Status.OK, 0.5)])
    for sample in range(4):
        add_generation(path, model="m1", run="r1", sample=sample, step=0, code=f"# sample {sample}",
                       result_id=sample + 1)
    add_generation(path, model="m2", run="r2", sample=0, step=0, result_id=5)
    selection = {"allreduce": "collectives", "allgather": "collectives"}
    loaded = records.load(path, "auto", records.Filter(), selection)
    report = metrics.build_report(loaded.records, selection, loaded.group_by, ks=(1, 2, 8))
    assert report.group_by == "model" and set(report.groups) == {"m1", "m2"}
    m1 = report.overall["m1"]
    # allreduce: 4 samples, 2 correct; allgather: no sample (a failure)
    assert m1.pass_at_k == pytest.approx({1: 0.5 / 2, 2: (1 - 1 / 6) / 2})  # k=8 > n is not estimated
    assert m1.fast_p[2][1.0] == pytest.approx((1 - 1 / 6) / 2)
    assert report.overall["m2"].fast_p[1] == pytest.approx({0.0: 0.5, 0.5: 0.0, 1.0: 0.0, 1.5: 0.0, 2.0: 0.0, 3.0: 0.0})
    code = {r.sample: r.code.text for r in loaded.records if r.group == "m1"}
    assert code["r1 sample 3"] == "# sample 3"


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

    pq = pytest.importorskip("pyarrow.parquet", reason="pip install 'pkb[report]' for parquet")
    out = tmp_path / "rows.parquet"
    assert pkb("report", "--db", str(db), "--format", "parquet", "--out", str(out)).returncode == 0
    table = pq.read_table(out)
    assert table.num_rows == len(KNOWN_ROWS)
    assert table.column("speedup").to_pylist()[1] == 2.5 and table.column("status").to_pylist()[3] == "mismatch"


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
