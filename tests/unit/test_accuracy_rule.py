"""pkb's accuracy rule (pkb.evaluate.accuracy), in the parent alone: every honest order and precision passes, every
wrong class fails, whole evaluations at a time (each case x 3 trials, every rank, pooled as ``evaluate`` pools them).
The scenarios and candidates are benchmarks/accuracy_rule.py's (that script measures the rates over 100 evaluations
each; here one evaluation each, every honest kind and every wrong class, W = 2, bf16 and fp32; W = 4 and 8 in the
integration tier). The rule through rank processes: tests/integration/test_accuracy.py and test_verdict_integrity.py."""

from __future__ import annotations

import math

import pytest
import torch

from pkb.evaluate.accuracy import (RUN, Judge, Pool, Regression, Where, _clusterings, _half_ulp, judge_one,
                                   same_answer)
from pkb.problem import Tolerance, reduction_tolerance

from helpers.accuracy_rule import SIM, outcomes, wrong_all_reduce_verdicts


def test_every_honest_all_reduce_passes_and_every_wrong_one_fails():
    """Rings in either order, a tree, fp32 and fp64 rounded once pass; truncation, rounding away from zero, a gain of
    +0.28 %, an offset, sparsified or one rank's lost small entries, fp8 on the wire and a lost element fail (W = 2
    here; W = 4 and 8, a minute and a half: tests/integration/test_accuracy_rule_world_sizes.py)."""
    assert wrong_all_reduce_verdicts(2) == []


def test_honest_sequential_fp32_reductions_pass_and_small_biases_in_them_fail():
    """The plain loops the issue named: a sequential column sum over 1,024 rows (about 5x the RMS error of torch's
    blocked sum) and a per-row sequential sum of squares (errors correlated within a row)."""
    for scenario in (SIM.COLSUM, SIM.RMSNORM):
        wrong_verdicts = [(name, passed) for name, honest, _, _, passed in outcomes(scenario, [(1, torch.float32)], 3)
                          if passed != honest]
        assert wrong_verdicts == [], scenario.name


def test_an_unbiased_rounding_of_the_exact_answer_passes_where_a_nudged_one_fails():
    """Rounding each element of the exact answer to bf16 up or down at random (stochastic rounding: within one ulp,
    unbiased) is honest; scaling by 1 + 2^-9 before rounding to nearest flips the roundings one way only: a bias of
    half a unit roundoff, which 4,000 elements show many standard errors from zero."""
    gen = torch.Generator().manual_seed(2)
    exact = torch.rand(4000, generator=gen, dtype=torch.float64) * 100 + 1
    down = exact.bfloat16()
    step = 2 * _half_ulp(exact.abs(), torch.bfloat16)
    other = down.double() + torch.where(down.double() < exact, step, -step)
    low, high = torch.minimum(down.double(), other), torch.maximum(down.double(), other)
    stochastic = torch.where(torch.rand(4000, generator=gen, dtype=torch.float64) < (exact - low) / (high - low), high, low)
    zero = torch.zeros_like(exact)
    assert judge_one(down, stochastic.bfloat16(), exact, zero, Tolerance.exact(), torch.bfloat16) is None
    nudged = judge_one(down, (exact * (1 + 2**-9)).bfloat16(), exact, zero, Tolerance.exact(), torch.bfloat16)
    assert nudged is not None and "a multiplicative bias" in nudged.reason


def test_a_scalar_kept_in_fp32_is_honest_in_an_fp32_run():
    """x * (1 / 3) with the reciprocal rounded to fp32 shifts every element by the same fraction of a unit roundoff,
    as a kernel that multiplies by a precomputed scale does: under the rule's floor of three fp32 roundings."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 1024, generator=gen, dtype=torch.float64).float()
    exact = x.double() / 3
    reciprocal = x * torch.tensor(1 / 3, dtype=torch.float32)
    assert judge_one((x / 3), reciprocal, exact, exact.abs() * 2**-24, Tolerance(1e-4, 1e-4), torch.float32) is None


def test_half_an_ulp_is_the_spacing_of_the_dtype_over_two():
    values = torch.tensor([1.0, 1.5, 2.0, 1000.0, 0.0, 1e-45], dtype=torch.float64)
    assert _half_ulp(values, torch.bfloat16)[:4].tolist() == [2**-8, 2**-8, 2**-7, 2.0]
    assert _half_ulp(values, torch.float32)[:3].tolist() == [2**-24, 2**-24, 2**-23]
    assert _half_ulp(values, torch.bfloat16)[4] == 2**-134  # below the smallest normal: the subnormal spacing


def test_nan_and_inf_must_sit_where_the_reference_or_the_rounded_exact_answer_has_them():
    exact = torch.tensor([1.0, float("inf"), 3.0, 70000.0], dtype=torch.float64)
    reference = torch.tensor([1.0, float("inf"), 3.0, float("inf")], dtype=torch.float16)  # overflows fp16
    tolerance = Tolerance(1e-3, 1e-3)
    assert judge_one(reference, reference.clone(), exact, None, tolerance, torch.float16) is None
    stray_nan = torch.tensor([float("nan"), float("inf"), 3.0, float("inf")], dtype=torch.float16)
    assert "NaN or inf" in judge_one(reference, stray_nan, exact, None, tolerance, torch.float16).reason
    finite_where_inf = torch.tensor([1.0, 5.0, 3.0, float("inf")], dtype=torch.float16)
    assert judge_one(reference, finite_where_inf, exact, None, tolerance, torch.float16) is not None


def test_a_bias_is_judged_against_its_own_noise_however_small_it_is():
    """A gain of +0.1 % on a 64K-element bf16 output: a quarter of one unit roundoff, inside every element's tolerance
    and rounding, hundreds of standard errors from zero. The message says so in significant digits, not "+0.000%";
    a gain of +5e-5 on an fp32 output (some 800 roundings) fails as far off each element's own scale."""
    gen = torch.Generator().manual_seed(7)
    exact = torch.randn(256, 256, generator=gen, dtype=torch.float64)
    found = judge_one(exact.bfloat16(), (exact * 1.001).bfloat16(), exact, exact.abs() * 2**-8, Tolerance(1e-2, 1e-2),
                      torch.bfloat16)
    assert found is not None and "standard errors" in found.reason, found
    assert abs(float(found.reason.split("a multiplicative bias: ")[1].split(" ")[0]) - 1e-3) < 2e-5, found.reason
    fp32 = judge_one(exact.float(), (exact * (1 + 5e-5)).float(), exact, exact.abs() * 2**-24, Tolerance(1e-2, 1e-2),
                     torch.float32)
    assert fp32 is not None and "honest scales" in fp32.reason


def test_errors_correlated_within_a_row_count_as_one_observation_per_row():
    """Rows normalised by a norm that is off by one rounding each (an honest per-row sum): each row's elements share
    one relative error, so the bias test's noise is that of 64 rows, not of 64K independent elements; taken as
    independent, such errors looked like a bias 6.8 standard errors from zero (the issue's rmsnorm case)."""
    gen = torch.Generator().manual_seed(11)
    exact = torch.randn(64, 1024, generator=gen, dtype=torch.float64).abs() + 1
    row_error = 1 + torch.randn(64, 1, generator=gen, dtype=torch.float64) * 2**-23
    candidate = (exact * row_error).float()
    assert judge_one(exact.float(), candidate, exact, exact * 2**-24, Tolerance(1e-4, 1e-4), torch.float32) is None


def test_clusterings_make_each_index_of_each_axis_a_cluster():
    """Rows (each index of an axis of at least 16), not blocks of rows; a flat tensor element by element and in runs of
    RUN elements; a few elements, one cluster."""
    found = _clusterings((20, 100), torch.ones(2000, dtype=torch.bool))
    assert [int(c.max()) + 1 for c in found] == [20, 100]
    assert found[0][:100].unique().tolist() == [0] and found[1][:100].unique().numel() == 100
    assert [int(c.max()) + 1 for c in _clusterings((4, 100), torch.ones(400, dtype=torch.bool))] == [100]
    assert [int(c.max()) + 1 for c in _clusterings((4096,), torch.ones(4096, dtype=torch.bool))] == [4096, 4096 // RUN]
    assert [int(c.max()) + 1 for c in _clusterings((4, 8), torch.ones(32, dtype=torch.bool))] == [32]
    assert [int(c.max()) + 1 for c in _clusterings((3, 3), torch.ones(9, dtype=torch.bool))] == [1]
    assert [int(c.max()) + 1 for c in _clusterings((), torch.ones(1, dtype=torch.bool))] == [1]


def test_the_regression_finds_offset_and_gain_with_standard_errors():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4000, generator=gen, dtype=torch.float64)
    noise = torch.randn(4000, generator=gen, dtype=torch.float64) * 1e-3
    fit = Regression()
    fit.add(x, 0.01 + 0.002 * x + noise, torch.full_like(x, 1e6), _clusterings((4000,), torch.ones(4000, dtype=torch.bool)))
    beta, alpha = fit.estimate()
    assert beta.value == pytest.approx(0.002, abs=1e-4) and alpha.value == pytest.approx(0.01, abs=1e-4)
    assert 0 < beta.se < 1e-4 and 0 < alpha.se < 1e-4


def test_a_replica_on_another_rank_is_pooled_once():
    """An all-reduce's W identical outputs are one observation: pooled W times, the bias test's noise would look W
    times smaller than it is."""
    pool = Pool("c", "out", torch.bfloat16)
    exact = torch.randn(300, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for rank in range(4):
        assert pool.add(exact.bfloat16(), exact.bfloat16(), exact, None, Tolerance(0.1, 0.1), Where(rank, "c", 0)) is None
    assert pool.num_tensors == 1


def test_values_are_judged_by_the_rule_their_kind_has():
    judge = Judge(torch.bfloat16)
    where, close = Where(0, "c", 0), (lambda dtype: Tolerance(0.1, 0.1))
    assert judge.reply(where, "outputs", [torch.tensor([1, 2])], [torch.tensor([1, 3])], close, None, "out") is not None
    assert judge.reply(where, "outputs", ["a", 3, None], ["a", 3, None], close, None, "out") is None
    assert "expected 3, got 4" in judge.reply(where, "outputs", [3], [4], close, None, "out").reason
    moved = judge.reply(where, "outputs", torch.ones(3), torch.ones(3) + 1e-3, lambda dtype: Tolerance.exact(), None, "out")
    assert moved is not None and "bit for bit" in moved.reason
    assert judge.counts["exact"] == 2


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int32, torch.complex64, torch.float8_e4m3fn,
                                   torch.bits8, torch.uint16, torch.quint8])
def test_a_reply_of_any_dtype_is_judged_and_never_raises(dtype):
    """The reply is the candidate's word: any dtype torch has, where the reference's is bf16, is a mismatch, and the
    walk never raises inside pkb."""
    judge = Judge(torch.bfloat16)
    try:
        got = torch.zeros(4, dtype=dtype) if dtype != torch.quint8 else torch.quantize_per_tensor(torch.zeros(4), 1.0, 0,
                                                                                                  torch.quint8)
    except (RuntimeError, TypeError):
        got = torch.zeros(4, dtype=torch.uint8).view(dtype)
    found = judge.reply(Where(0, "c", 0), "outputs", torch.zeros(4, dtype=torch.bfloat16), got,
                        lambda d: Tolerance(0.1, 0.1), None, "out")
    assert found is not None and ("dtype" in found.reason or "plain tensor" in found.reason)


def test_a_second_run_must_repeat_the_first():
    a = [torch.tensor([1.0, 2.0])]
    assert same_answer(a, [torch.tensor([1.0, 2.0])], lambda d: Tolerance(0.1, 0.1), deterministic=True) is None
    assert same_answer(a, [torch.tensor([1.0, 2.05])], lambda d: Tolerance(0.1, 0.1), deterministic=False) is None
    assert same_answer(a, [torch.tensor([1.0, 2.05])], lambda d: Tolerance(0.1, 0.1), deterministic=True) is not None
    assert math.isfinite(same_answer(a, [torch.tensor([1.0, 3.0])], lambda d: Tolerance(0.1, 0.1), False).max_abs_err)


def _column_sums(rows: int, columns: int, seed: int):
    """A column sum of ``rows`` N(0, 1) fp32 rows: the exact answer, its sensitivity (the RMS shift when every input
    moves by one fp32 rounding, over 8 perturbations), torch's blocked sum and a plain sequential loop's."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, columns, generator=gen, dtype=torch.float64).float()
    exact = x.double().sum(0)
    u = 2.0**-24
    shifts = [(x.double() * (1 + u * (2 * torch.rand(x.shape, generator=gen, dtype=torch.float64) - 1))).sum(0) - exact
              for _ in range(8)]
    sensitivity = torch.stack(shifts).square().mean(0).sqrt()
    sequential = torch.zeros(columns, dtype=torch.float32)
    for row in x:
        sequential += row
    return exact, sensitivity, x.sum(0), sequential


def test_a_long_sequential_fp32_sum_passes_under_the_accumulation_the_problem_declares():
    """A loop over 4,096 rows errs by about sqrt(K) / 2 honest scales (some 30, and 5 sigma of that on the worst
    column): past the problem's tolerance for the rounding of the rows alone and past 64 scales. The problem declares
    the local sum (``reduction_tolerance(..., local_terms=K)``) and the loop passes; 0.5 % of the columns pushed to
    12 sigma of that accumulation still fail, and so does the loop judged without the declaration."""
    rows = 4096
    exact, sensitivity, blocked, sequential = _column_sums(rows, 2048, seed=5)
    declared = reduction_tolerance(torch.float32, 1, scale=math.sqrt(rows), local_terms=rows)
    assert declared.accumulation > 0
    assert judge_one(blocked, sequential, exact, sensitivity, declared, torch.float32) is None
    undeclared = reduction_tolerance(torch.float32, 1, scale=math.sqrt(rows))
    assert undeclared.accumulation == 0
    found = judge_one(blocked, sequential, exact, sensitivity, undeclared, torch.float32)
    assert found is not None and "elements off the exact answer" in found.reason, found
    pushed = sequential.double().clone()
    pushed[::200] += 12 * declared.accumulation
    found = judge_one(blocked, pushed.float(), exact, sensitivity, declared, torch.float32)
    assert found is not None and "elements off the exact answer" in found.reason, found


def test_a_bf16_run_declares_its_local_sums_in_fp32_arithmetic():
    """bf16 and fp16 kernels sum locally in fp32 (torch's matmul and sum do): the accumulation they may add is fp32's,
    next to nothing beside the bf16 tolerance."""
    bf16 = reduction_tolerance(torch.bfloat16, 2, scale=1.0, local_terms=1024)
    assert bf16.accumulation == pytest.approx(2.0**-24 * math.sqrt(2 * 1025 / 6))
    assert bf16.atol == pytest.approx(reduction_tolerance(torch.bfloat16, 2).atol, rel=1e-3)


def test_fp16_arithmetic_whose_small_positive_values_underflow_is_honest_and_truncation_is_not():
    """Adam's second moment computed in fp16 (upstream's DDP and ZeRO files in an fp16 run): 0.001 g^2 of gradients
    near 1e-2 lies below fp16's smallest normal, where rounding steps are absolute; no bias fit runs there (upstream's
    40, 41 and 42 in fp16 failed the bias test by 0.1 % on exp_avg_sq before: tests/integration/test_upstream_corpus.py
    is their regression test). Truncating values in fp16's normal range is still a bias."""
    gen = torch.Generator().manual_seed(13)
    g = (torch.randn(1 << 17, generator=gen, dtype=torch.float64) * 1e-2).half()
    exact = 0.001 * g.double().square()
    reference = (0.001 * g.float().square()).half()
    in_fp16 = g * g * torch.tensor(0.001, dtype=torch.float16)
    assert bool((exact < torch.finfo(torch.float16).tiny).float().mean() > 0.9)  # nearly all of it subnormal
    sensitivity = exact * 2 * 2.0**-11 / math.sqrt(3)
    tolerance = Tolerance(2e-3, 2e-3)
    assert judge_one(reference, in_fp16, exact, sensitivity, tolerance, torch.float16) is None
    normal = torch.rand(1 << 17, generator=gen, dtype=torch.float64) * 100 + 1
    truncated = normal.half()
    truncated = torch.where(truncated.double() > normal, torch.nextafter(truncated, torch.zeros_like(truncated)),
                            truncated)
    found = judge_one(normal.half(), truncated, normal, torch.zeros_like(normal), tolerance, torch.float16)
    assert found is not None and "a multiplicative bias" in found.reason, found


@pytest.mark.parametrize("run_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_lost_weight_decay_passes_only_where_the_runs_dtype_loses_it(run_dtype):
    """fsdp_step_e2e's AdamW decay, lr * wd = 1e-5 of every parameter: upstream's own separate add in fp16 (or bf16)
    leaves the parameter as it was, and the problem declares that bias (``Tolerance.bias``). In fp32 the add keeps
    it, the problem declares nothing, and a kernel that skips the decay fails."""
    from pkb.registry import get_problem

    problem = get_problem("fsdp_step_e2e")
    case = problem.cases("tests", 2)[0]
    tolerance = problem.tolerance_for(case, 2, run_dtype)
    declared = 1e-5 if run_dtype != torch.float32 else 0.0
    assert tolerance.bias == pytest.approx(declared)
    gen = torch.Generator().manual_seed(7)
    n = 1 << 16
    # parameters ~ N(0, 0.05) after one AdamW step; exact: the decay applied in fp64
    theta = torch.randn(n, generator=gen, dtype=torch.float64) * 0.05
    exact = theta * (1 - 1e-5)
    reference = exact.to(run_dtype)
    sensitivity = exact.abs() * torch.finfo(run_dtype).eps / 2 / math.sqrt(3)
    decay_lost = theta.to(run_dtype)  # the decay's add rounds back to theta in the run's dtype, or is skipped
    found = judge_one(reference, decay_lost, exact, sensitivity, tolerance, run_dtype, path="out[0]")
    if run_dtype == torch.float32:
        assert found is not None, "a skipped decay passed in fp32"  # caught element-wise: 5 roundings on every element
        return
    assert found is None, found
    if run_dtype == torch.float16:  # a gain of 4x the declared bias beyond the decay still fails in fp16
        found = judge_one(reference, (theta * (1 + 3e-5)).to(run_dtype), exact, sensitivity, tolerance, run_dtype,
                          path="out[0]")
        assert found is not None and "multiplicative bias" in found.reason, found


def test_a_finite_value_where_the_answer_is_infinite_is_named_as_such():
    """A log-probability's -inf (a masked entry) answered with a finite value: the message says the candidate is
    finite there and shows the -inf, not 'NaN or inf where neither has one' with the -inf printed as 0."""
    exact = torch.tensor([1.0, float("-inf"), 2.0, 3.0], dtype=torch.float64)
    reference = exact.to(torch.bfloat16)
    got = reference.clone()
    got[1] = 0.0
    found = judge_one(reference, got, exact, None, Tolerance(1e-2, 1e-2), torch.bfloat16)
    assert found is not None and "1 of 4 elements off: finite where the reference and the exact answer hold NaN or inf" \
        in found.reason, found
    assert found.expected == float("-inf") and found.got == 0.0, found
    got = reference.clone()
    got[0] = float("nan")
    found = judge_one(reference, got, exact, None, Tolerance(1e-2, 1e-2), torch.bfloat16)
    assert found is not None and "NaN or inf where neither the reference nor the exact answer has one" in found.reason
