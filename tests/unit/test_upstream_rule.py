"""Upstream's rule (``outputs_match_rank_outputs``, pkb.evaluate.paper.upstream_compare), leaf by leaf:
allclose on ``.float()`` copies with atol = rtol = 1e-2, shapes exact, dtypes not compared, any NaN fails,
tuples and lists alike (issue 28). The verdicts it gives whole candidates: tests/integration/test_paper_verdict.py.
"""

from __future__ import annotations

import torch

from pkb.evaluate.paper import upstream_compare


def test_upstream_rule_leaves():
    bf16 = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert upstream_compare(bf16, bf16.float()) is None  # dtypes are not compared
    assert upstream_compare(torch.tensor([100.0]), torch.tensor([101.0])) is None  # rtol of the solution's value
    assert upstream_compare(torch.tensor([0.0]), torch.tensor([0.02])).describe().startswith("out:")
    assert upstream_compare(torch.tensor([100]), torch.tensor([101])) is None  # integers too, as float
    assert upstream_compare(torch.tensor([1 + 1j]), torch.tensor([1 + 5j])) is None  # .float() keeps the real part
    nan = torch.tensor([float("nan")])
    assert "NaN" in upstream_compare(nan, nan).reason  # allclose fails on any NaN, even in both
    inf = torch.tensor([float("inf")])
    assert upstream_compare(inf, inf) is None
    assert "shape" in upstream_compare(torch.zeros(2, 3), torch.zeros(3, 2)).reason
    assert upstream_compare({"a": 1, "b": [2, 3]}, {"b": [2, 3], "a": 1}) is None
    assert "keys" in upstream_compare({"a": 1}, {"b": 1}).reason
    assert "items" in upstream_compare([1, 2], [1]).reason
    assert upstream_compare(torch.zeros(1), 0) is not None  # a tensor against a number
    assert upstream_compare("x", "x") is None and upstream_compare(None, None) is None
