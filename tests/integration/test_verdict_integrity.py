"""The verdict-integrity corpus's ``ci`` rows, each judged once by ``pkb eval`` as a user runs it (issues 53 and 56):
every wrong answer and every attempt to choose a status ends in the candidate's failure, every honest kernel is
``ok``. benchmarks/integrity_corpus.py runs every row, several times each, and reports the rates."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.benchmarks import load

CORPUS = load("integrity_corpus")

ROWS = CORPUS.rows()


def test_every_corpus_file_has_a_row_and_the_ci_rows_cover_both_halves_and_every_kind_of_attack():
    ci = [row for row in ROWS if row.tier == "ci"]
    assert {Path(row.path).parent.name for row in ci} >= {"wrong", "honest"}
    assert {Path(row.path).parent.name for row in ROWS} == {"wrong", "honest", "below"}
    kinds = {flag for row in ci for flag in ("--perf", "--policy", "--world-size 4", "--cases") if flag in row.flags}
    assert kinds == {"--perf", "--policy", "--world-size 4", "--cases"}
    assert all(row.allowed == ("ok",) for row in ROWS if row.path.startswith("honest/"))
    # below/: honest arithmetic below the problem's precision in one dtype, decided per file (its docstring): one
    # status in each dtype, `ok` where it is within the precision, `mismatch` where it is not
    below = [row for row in ROWS if row.path.startswith("below/")]
    assert below and all(row.allowed in (("ok",), ("mismatch",)) for row in below)
    assert all({row.allowed for row in below if row.path == path} == {("ok",), ("mismatch",)}
               for path in {row.path for row in below})
    # `skipped` is allowed only where the candidate's own code needs a GPU (counted as not passed: docs/reports.md)
    assert not any("ok" in row.allowed or "harness_error" in row.allowed or "infra_error" in row.allowed
                   or ("skipped" in row.allowed and "dead_cuda_code" not in row.path)
                   for row in ROWS if row.path.startswith("wrong/") and "slows_the_reference" not in row.path)


@pytest.mark.parametrize("row", [row for row in ROWS if row.tier == "ci"], ids=lambda row: row.name)
def test_the_corpus_file_gets_an_allowed_status(row):
    if row.missing(has_gpu=False):
        pytest.skip(f"needs {', '.join(row.missing(has_gpu=False))}")
    got = CORPUS.evaluate(row, mode="cpu", timeout=600.0)
    assert got["status"] in row.allowed, f"{row.name}: {got['status']} ({got['message'][:1500]})"
