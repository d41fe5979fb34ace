"""``pkb report`` and ``pkb run`` as a user runs them (a process each) on known rows: the headline, --compare,
--table in every format, usage errors and the sandbox note; the headline at the end of ``pkb run``; ``pkb
export-suite``."""

from __future__ import annotations

import csv
import io
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from pkb.store import db as store_db
from helpers.reports import (ALPHA_SANDBOX_NOTE, EXPECTED, EXPECTED_PAPER, KNOWN_ROWS, SANDBOX_ROWS, SELECTION,
                             SELECTION_ARG, write_db)

REPO = Path(__file__).resolve().parents[2]


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
    meaning = next(i for i, line in enumerate(headline) if line.startswith("what this means: "))
    assert all(line.startswith("note: ") for line in headline[footnote + 2:meaning - 1])  # e.g. a partial sandbox
    assert "references judged here passed against themselves" in headline[meaning]  # the main job says what it means
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
