"""pkb's accuracy rule on one tensor (pkb.evaluate.accuracy), in the parent alone: honest answers of other orders
and precisions pass, biased, compressed and one-element-wrong answers fail, and the floors, the NaN placement and
the fallbacks to the tolerance hold. The same rule through rank processes: tests/integration/test_accuracy.py."""

from __future__ import annotations

import math

import pytest
import torch

from pkb.evaluate.accuracy import FACTOR, UNAVAILABLE, ExactAnswer, _half_ulp, judge
from pkb.evaluate.compare import compare
from pkb.problem import Tolerance, reduction_tolerance


def _sums(world_size: int, shape=(64, 64), seed=0):
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(*shape, generator=gen).bfloat16() for _ in range(world_size)]
    ring = parts[0]
    for part in parts[1:]:
        ring = (ring.float() + part.float()).bfloat16()
    return parts, ring, sum(x.double() for x in parts)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_answers_as_accurate_as_the_reference_or_more_pass(world_size):
    parts, ring, exact = _sums(world_size)
    tolerance = reduction_tolerance(torch.bfloat16, world_size)
    reversed_ring = parts[-1]
    for part in reversed(parts[:-1]):
        reversed_ring = (reversed_ring.float() + part.float()).bfloat16()
    for honest in (exact.bfloat16(), sum(x.float() for x in parts).bfloat16(), reversed_ring, ring):
        failure, accuracy = judge(ring, honest, exact, tolerance, torch.bfloat16, "out")
        assert failure is None, failure
        assert accuracy.rms_ratio <= FACTOR


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_a_bias_fp8_on_the_wire_and_one_lost_element_fail(world_size):
    parts, ring, exact = _sums(world_size)
    tolerance = reduction_tolerance(torch.bfloat16, world_size)
    biased = (exact * 1.008).bfloat16()
    failure, accuracy = judge(ring, biased, exact, tolerance, torch.bfloat16, "out")
    assert failure is not None and "a systematic error" in failure.reason and accuracy.bias == pytest.approx(0.008, abs=5e-4)
    compressed = sum(x.float().to(torch.float8_e4m3fn).float() for x in parts).bfloat16()
    assert judge(ring, compressed, exact, tolerance, torch.bfloat16, "out")[0] is not None
    lost = exact.bfloat16().reshape(-1).clone()
    lost[int(exact.abs().argmax())] = 0
    failure, _ = judge(ring, lost.reshape(exact.shape), exact, tolerance, torch.bfloat16, "out")
    assert failure is not None and failure.num_bad == 1 and failure.got == 0.0


def test_one_rounding_of_the_exact_answer_always_passes_even_where_the_reference_is_exact():
    """The floor: a reference that happens to be exact (integers) leaves the candidate one rounding."""
    exact = torch.arange(1, 401, dtype=torch.float64) / 3
    reference = exact.clone().float()  # fp32 of the thirds: the reference's own error is one fp32 rounding
    candidate = (exact * (1 + 2**-25)).float()  # rounds the other way in places
    failure, _ = judge(reference, candidate, exact, Tolerance.exact(), torch.float32, "out")
    assert failure is None


def test_half_an_ulp_is_the_spacing_of_the_dtype_over_two():
    values = torch.tensor([1.0, 1.5, 2.0, 1000.0, 0.0, 1e-45], dtype=torch.float64)
    assert _half_ulp(values, torch.bfloat16)[:4].tolist() == [2**-8, 2**-8, 2**-7, 2.0]
    assert _half_ulp(values, torch.float32)[:3].tolist() == [2**-24, 2**-24, 2**-23]
    assert _half_ulp(values, torch.bfloat16)[4] == 2**-134  # below the smallest normal: the subnormal spacing


def test_nan_and_inf_must_sit_where_the_reference_or_the_rounded_exact_answer_has_them():
    exact = torch.tensor([1.0, float("inf"), 3.0, 70000.0], dtype=torch.float64)
    reference = torch.tensor([1.0, float("inf"), 3.0, float("inf")], dtype=torch.float16)  # overflows fp16
    assert judge(reference, reference.clone(), exact, Tolerance(1e-3, 1e-3), torch.float16, "out")[0] is None
    stray_nan = torch.tensor([float("nan"), float("inf"), 3.0, float("inf")], dtype=torch.float16)
    failure, _ = judge(reference, stray_nan, exact, Tolerance(1e-3, 1e-3), torch.float16, "out")
    assert failure is not None and "NaN or inf" in failure.reason


def test_complex_outputs_are_judged_on_both_parts():
    exact = torch.randn(300, dtype=torch.complex128, generator=torch.Generator().manual_seed(5))
    reference = exact.to(torch.complex64)
    biased = (exact * (1 + 5e-3)).to(torch.complex64)  # inside the tolerance element by element, five times its tenth
    assert judge(reference, reference.clone(), exact, Tolerance(1e-4, 1e-4), torch.float32, "out")[0] is None
    assert judge(reference, biased, exact, Tolerance(1e-2, 1e-2), torch.float32, "out")[0] is not None


def test_compare_needs_the_exact_answer_only_where_a_value_is_not_the_references_bit_for_bit():
    fetched = []
    answer = torch.tensor([1.0, 1.0, 1.0, 1.001], dtype=torch.float64)  # the reference rounded its last element
    exact = ExactAnswer(lambda: fetched.append(1) or [answer], torch.bfloat16, [])
    same = [torch.ones(4, dtype=torch.bfloat16)]
    assert compare(same, [same[0].clone()], lambda dtype: Tolerance(0.1, 0.1), "out", exact) is None
    assert fetched == []
    off = [torch.tensor([1.0, 1.0, 1.0, 1.5], dtype=torch.bfloat16)]
    mismatch = compare(same, off, lambda dtype: Tolerance(0.1, 0.1), "out", exact)
    assert fetched == [1] and mismatch is not None and mismatch.against == "exact"


def test_without_a_more_precise_exact_answer_the_tolerance_against_the_reference_decides():
    """An exact answer that is the reference's bit for bit (a reference in a fixed dtype), or one not computed
    (a case too large to raise), says nothing of the reference's error."""
    reference = torch.full((1000,), 3.0, dtype=torch.float32)
    candidate = reference * (1 + 1e-5)  # a bias inside the tolerance: only an exact answer could see it
    tolerance = lambda dtype: Tolerance(1e-4, 1e-4)  # noqa: E731
    for value in (reference.double(), UNAVAILABLE):
        assert compare(reference, candidate, tolerance, "out", ExactAnswer(lambda v=value: v, torch.float32, [])) is None
    outside = reference * (1 + 1e-3)
    mismatch = compare(reference, outside, tolerance, "out", ExactAnswer(lambda: UNAVAILABLE, torch.float32, []))
    assert mismatch is not None and mismatch.against == "reference"


def test_the_bias_rule_waits_for_enough_elements():
    """Below MIN_AGGREGATE elements a bias of a few ulps cannot be told from rounding: only the element-wise rule."""
    exact = torch.linspace(1, 2, 100, dtype=torch.float64)
    reference = exact.bfloat16()
    biased = (exact * 1.008).bfloat16()
    failure, accuracy = judge(reference, biased, exact, Tolerance(0.02, 0.02), torch.bfloat16, "out")
    assert failure is None and accuracy.numel == 100 and not math.isclose(accuracy.bias, 0)
