"""The comparison behind differential verdict testing (benchmarks/differential.py, issue 36): a verdict that
moves between arrangements, or is not the one its file expects, is reported. The arrangements themselves, in
cpu mode: tests/integration/test_differential.py."""

from __future__ import annotations

from helpers.benchmarks import load


differential = load("differential")


def test_the_comparison_catches_a_verdict_that_moves_or_is_not_the_expected_one():
    ok = {"status": "ok", "upstream_ok": True, "message": ""}
    timeout = {"status": "timeout", "upstream_ok": False, "message": "did not finish"}
    moved, unexpected = differential.compare({"a": {"alone": ok, "side-by-side": timeout}, "b": {"alone": ok}},
                                             {"a": "ok", "b": "skipped"})
    assert len(moved) == 1 and moved[0].startswith("a: ")
    assert [line.split(":")[0] for line in unexpected] == ["a side-by-side", "b alone"]
