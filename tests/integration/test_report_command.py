"""``pkb report`` and ``pkb run`` as a user runs them (a process each) on known rows: the headline, --compare,
--table in every format, usage errors and the sandbox note; the headline at the end of ``pkb run``; ``pkb
export-suite``."""

from __future__ import annotations

import csv
import io
import json
import re
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
    assert header.split()[:2] == ["set", "covers"] and "pass@1 paper / pkb" in header
    alpha = next(line for line in lines if line.startswith("alpha"))
    assert "5 of 5, 1 left out" in alpha and "100.0% / 75.0%" in alpha and "50.0% / 50.0%" in alpha  # pass@1, fast_1
    # beta has results for 3 of the 5 problems: one row, what it covers beside its numbers over the whole selection
    beta = next(line for line in lines if line.startswith("beta"))
    assert "3 of 5" in beta and "20.0% / 20.0%" in beta and "1 compile_error, 1 timeout" in beta
    assert lines[lines.index(beta) + 1] == ""
    assert lines.index(alpha) < lines.index(beta)  # best first
    assert ("experiment default: pass@1 and fast_1 (paper / pkb) count the 5 selected problems, the paper's "
            "denominator:") in lines


def test_report_shows_one_experiment_compares_several_and_leaves_service_and_rl_traffic_out(tmp_path):
    from helpers.reports import make_result
    from pkb.options import Status

    def named(result, experiment):
        result.experiment = experiment
        return result

    traffic = [named(make_result("allreduce", "candidate", Status.RUNTIME_ERROR, solution_set="served"), "served"),
               named(make_result("allreduce", "allreduce/1/0", Status.MISMATCH, solution_set="rl"), "rl"),
               named(make_result("allreduce", "sweep/allreduce", Status.OK, 3.0, 0.9, upstream_ok=True), "sweep")]
    db = write_db(tmp_path / "r.sqlite", KNOWN_ROWS + traffic)
    done = pkb("report", "--db", str(db), "--problems", SELECTION_ARG)
    assert done.returncode == 0, done.stderr
    headline = done.stdout.split("experiment default: pass@1")[0].splitlines()
    sets = [line.split()[0] for line in headline if line.startswith(("alpha", "beta", "served", "rl", "sweep"))]
    assert sets == ["alpha", "beta"]  # the default experiment: no broken service request, no RL turn, no sweep
    assert ("note: experiment default; also in this database: sweep (1 result), rl (1 result, RL traffic), served "
            "(1 result, service traffic): `pkb report --experiment NAME` reports one, a comma list compares them"
            ) in done.stdout.splitlines()
    both = json.loads(pkb("report", "--db", str(db), "--problems", SELECTION_ARG, "--format", "json",
                          "--experiment", "default,sweep").stdout)
    assert both["groups"] == ["default: alpha", "sweep: sweep", "default: beta"] and both["experiments"] == [
        "default", "sweep"]
    served = json.loads(pkb("report", "--db", str(db), "--problems", SELECTION_ARG, "--format", "json",
                            "--experiment", "served").stdout)
    assert served["groups"] == ["served"] and served["failures"]["served"] == {"runtime_error": 1}
    rows = json.loads(pkb("report", "--db", str(db), "--format", "json", "--table", "rows", "--experiment",
                          "rl").stdout)
    assert [(row["experiment"], row["solution"]) for row in rows] == [("rl", "allreduce/1/0")]
    wrong = pkb("report", "--db", str(db), "--experiment", "a,,b")
    assert wrong.returncode == 2 and "--experiment: an experiment needs a name" in wrong.stderr
    typo = pkb("report", "--db", str(db), "--experiment", "sweeep")  # a new user's walk: this exited 0, empty
    assert typo.returncode == 2 and "no results in experiment 'sweeep': this database holds sweep, rl, served, " \
        "default" in typo.stderr, typo.stderr


def test_report_counts_speed_from_gpu_timings_only_and_shows_cpu_timings_apart_when_asked(tmp_path):
    from helpers.reports import make_result
    from pkb.options import Status

    rows = [make_result("allreduce", "gpu/allreduce", Status.OK, 2.0, 0.5, upstream_ok=True),
            make_result("allreduce", "cpu/allreduce", Status.OK, 1.25, 0.01, upstream_ok=True, mode="cpu")]
    db = write_db(tmp_path / "r.sqlite", rows)
    document = json.loads(pkb("report", "--db", str(db), "--problems", "1", "--format", "json").stdout)
    assert document["fast_p"]["gpu"]["1"]["1"] == 1.0 and document["geomean_speedup"]["gpu"] == 2.0
    assert document["fast_p"]["cpu"]["1"]["1"] is None and document["geomean_speedup"]["cpu"] is None
    assert document["roofline"]["cpu"]["count"] == 0 and "off_gpu_timings" not in document
    table = pkb("report", "--db", str(db), "--problems", "1")
    cpu = next(line for line in table.stdout.splitlines() if line.startswith("cpu "))
    assert "1.25x" not in table.stdout and re.search(r"100\.0% / 100\.0% +- / - +- +- ", cpu)
    assert "`pkb report --off-gpu-timings` shows them apart" in table.stdout
    shown = pkb("report", "--db", str(db), "--problems", "1", "--off-gpu-timings")
    header = next(line for line in shown.stdout.splitlines() if line.startswith("set "))
    assert header.rstrip().endswith("off-GPU speedup (not GPU performance)")
    cpu = next(line for line in shown.stdout.splitlines() if line.startswith("cpu "))
    assert cpu.rstrip().endswith("1.25x (cpu, 1 sample)") and "- / -" in cpu
    document = json.loads(pkb("report", "--db", str(db), "--problems", "1", "--format", "json",
                              "--off-gpu-timings").stdout)
    assert document["off_gpu_timings"]["cpu"] == {"num_timed": 1, "geomean_speedup": 1.25, "modes": ["cpu"]}
    assert document["geomean_speedup"]["cpu"] is None  # never mixed in


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
    references = pkb("report", "--db", str(db), "--compare", "alpha", "reference")
    assert references.returncode == 2 and "the references are the suite's self-check" in references.stderr


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


def test_pkb_shipped_examples_are_one_row_that_says_what_they_cover(tmp_path):
    """pkb's shipped solutions are worked examples for a few problems: the run's headline gives them one row, what
    they cover beside their pass@1 over the whole selection (the paper's denominator, said once under the table);
    the references' self-check covers the whole selection."""
    done = pkb("run", "--problems", "1,9", "--mode", "cpu", "--trials", "1", "--db", str(tmp_path / "r.sqlite"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "references: 2 of 2 ok" in done.stdout  # 9 (layernorm_backward) has no shipped file
    lines = done.stdout.splitlines()
    (shipped,) = [line for line in lines if line.startswith("pkb shipped")]
    # the all-reduce's CUDA file skips here, a skip its own code causes (it needs a GPU): counted as not passed, so
    # the all-reduce's pass@1 is 1 of its 2 samples, and the selection's (9 has none) 25 %
    assert shipped.split("  ")[1].strip() == "1 of 2" and "25.0% / 25.0%" in shipped and "1 skipped" in shipped
    assert lines[lines.index(shipped) + 1] == "" and "in the suite" not in done.stdout
    assert done.stdout.count("the paper's denominator") == 1


def test_pkb_run_ends_with_the_headline_and_stores_each_result_under_its_set(tmp_path):
    db = tmp_path / "run.sqlite"
    done = pkb("run", "--problems", "1-2", "--mode", "cpu", "--trials", "1", "--db", str(db))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "5 results in " + str(db) + ": 3 ok, 2 skipped"  # nothing failed: no table of failures
    headline = lines[lines.index("references: 2 of 2 ok"):]
    assert headline[2].split()[:3] == ["set", "covers", "pass@1"]
    # pkb's shipped solutions: the two-step all-reduce is ok (on the upstream cases too); the CUDA ones (the peer
    # all-reduce, the all-gather) skip here, a skip their code causes (they need a GPU): counted as not passed (all-reduce
    # 1 of 2, all-gather 0 of 1: 25 %), and a note says so
    (shipped,) = [line for line in headline if line.startswith("pkb shipped")]
    assert shipped.split("  ")[1].strip() == "2 of 2" and "25.0% / 25.0%" in shipped and "2 skipped" in shipped
    assert any(line.startswith("note: pkb shipped: 2 skipped results count as not passed") and "2 need a GPU" in line
               for line in headline), headline
    footnote = next(i for i, line in enumerate(headline) if line.startswith("experiment default: pass@1 and fast_1"))
    meaning = next(i for i, line in enumerate(headline) if line.startswith("what this means: "))
    assert all(line.startswith("note: ") for line in headline[footnote + 3:meaning - 1])  # e.g. a partial sandbox
    assert "references passed against themselves here" in headline[meaning]  # the main job says what it means
    assert meaning == len(headline) - 1  # in one line, the last
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
