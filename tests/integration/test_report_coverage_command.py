"""``pkb report`` on sets that cover part of the selection, as a user runs it (a process each): a partial set
gets one row in the terminal headline, what it covers beside its numbers over the whole selection (the paper's
denominator: a problem without a result counts as failed, said once under the table); the JSON and CSV metrics
keep the whole-selection view and add the covered one.
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import pytest

from helpers.reports import partial_rows, write_db
from test_report_command import pkb


@pytest.fixture(scope="module")
def partial_db(tmp_path_factory) -> Path:
    return write_db(tmp_path_factory.mktemp("coverage") / "r.sqlite", partial_rows())


def test_pkb_report_headline_gives_a_partial_set_one_row_that_says_what_it_covers(partial_db):
    done = pkb("report", "--db", str(partial_db))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    shipped = next(line for line in lines if line.startswith("pkb shipped"))
    assert re.search(r"  8 of 87  +9\.2% / 9\.2%  ", shipped)
    folder = next(line for line in lines if line.startswith("folder"))
    assert re.search(r"  80 of 87  +46\.0% / 46\.0%  ", folder) and "40 mismatch" in folder
    complete = next(line for line in lines if line.startswith("complete"))
    assert re.search(r"  87 of 87  +33\.3% / 33\.3%  ", complete)
    table = lines[lines.index(next(line for line in lines if line.startswith("set "))):lines.index(shipped) + 1]
    assert len(table) == 2 + 3  # a header, its rule, one row per set
    assert done.stdout.count("the paper's denominator") == 1 and "in the suite" not in done.stdout

    selected = pkb("report", "--db", str(partial_db), "--problems", "1-8")  # the part it covers: one row
    shipped = next(line for line in selected.stdout.splitlines() if line.startswith("pkb shipped"))
    assert re.search(r"  8 of 8  +100\.0% / 100\.0%  ", shipped) and "covered" not in selected.stdout.split("\n\n")[1]


def test_the_json_and_csv_metrics_keep_the_suite_view_and_add_the_covered_one(partial_db, tmp_path):
    done = pkb("report", "--db", str(partial_db), "--format", "json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    # the existing keys are the suite view, as before (the paper's denominator)
    assert doc["pass_at_k"]["pkb shipped"]["1"] == pytest.approx(8 / 87)
    assert doc["paper"]["pass_at_k"]["pkb shipped"]["1"] == pytest.approx(8 / 87)
    assert doc["problems"]["pkb shipped"] == {"selected": 87, "attempted": 8, "skipped_only": 0, "samples": 8}
    assert doc["coverage"]["pkb shipped"] == {"selected": 87, "covered": 8, "complete": False}
    assert doc["coverage"]["complete"] == {"selected": 87, "covered": 87, "complete": True}
    assert doc["covered"]["pass_at_k"]["pkb shipped"]["1"] == 1.0
    assert doc["covered"]["paper"]["pass_at_k"]["pkb shipped"]["1"] == 1.0
    assert doc["covered"]["problems"]["pkb shipped"]["selected"] == 8
    assert doc["covered"]["pass_at_k"]["folder"]["1"] == pytest.approx(0.5)
    assert doc["covered"]["by_category"]["pkb shipped"]["collectives"]["pass_at_k"]["1"] == 1.0

    out = tmp_path / "metrics.csv"
    done = pkb("report", "--db", str(partial_db), "--table", "metrics", "--format", "csv", "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = {(r["group"], r["category"], r["protocol"]): r for r in csv.DictReader(io.StringIO(out.read_text()))}
    shipped = rows[("pkb shipped", "all", "pkb")]
    assert (shipped["problems"], float(shipped["pass@1"])) == ("87", pytest.approx(8 / 87))  # unchanged: the suite
    assert (shipped["selected"], shipped["covered"], shipped["covered_problems"]) == ("87", "8", "8")
    assert float(shipped["covered_pass@1"]) == 1.0
    collectives = rows[("pkb shipped", "collectives", "paper")]
    assert (collectives["selected"], collectives["covered"], float(collectives["covered_pass@1"])) == ("8", "8", 1.0)
    assert rows[("pkb shipped", "tensor_parallel", "pkb")]["covered"] == "0"


def test_the_default_selection_is_the_papers_suite_and_a_note_names_pkbs_own_problems(tmp_path):
    """Results for pkb's own problems (beyond upstream) stay out of the paper's denominator by default; the
    note names them and the command that reports them, and that command counts them."""
    from helpers.reports import make_result
    from pkb.options import Status

    db = write_db(tmp_path / "own.sqlite", [
        make_result("allreduce", "mine/allreduce", Status.OK, upstream_ok=True),
        make_result("hierarchical_allreduce", "mine/hierarchical_allreduce", Status.OK, upstream_ok=None)])
    done = pkb("report", "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert re.search(r"  1 of 87  +1\.1% / 1\.1%  ", done.stdout)
    assert ("note: results for 1 of pkb's own problems beyond upstream (hierarchical_allreduce) are outside the "
            "paper's suite this headline counts: `pkb report --problems inter_node` reports them") in done.stdout

    own = pkb("report", "--db", str(db), "--problems", "inter_node")
    assert own.returncode == 0, own.stderr
    lines = own.stdout.splitlines()
    mine = next(line for line in lines if line.startswith("mine"))
    assert re.search(r"  1 of 8  +- / 12\.5%  ", mine)  # the paper has no say on pkb's own problems
    assert "beyond upstream" not in own.stdout and "without an upstream verdict" not in own.stdout
