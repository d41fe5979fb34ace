"""Final red-team of pkb's accuracy rule (pkb.evaluate.accuracy) and ``bit_equal``, in-process on small CPU tensors, by
a helper who had not written the rule.

What this round attacked: the bias / offset fit on tensors of fewer than ``MIN_CLUSTER_INDICES`` elements (one
cluster: the model's standard error alone) and on tensors with one short axis (the largest clustering's standard
error); the outlier test's median where many elements are structurally exact (ReLU zeros, rows no rank touched);
elements the reference computes as inf or NaN where the exact answer is finite; lossy formats one precision step
below the run's (fp8 in a bf16 run, bf16 in an fp16 run) on outputs whose values are small beside the tolerance's
atol; a complex output rotated instead of scaled; gains confined to one sign or one binade; ``bit_equal`` (rewritten
to compare in the tensors' own dtype) on NaN payloads, signed zeros, fp8, complex views and mixed dtypes.

Honest answers are simulated from real inputs in the run's dtype (a sequential fp32 loop, a bf16 ring, split-K with
bf16 partials); the exact answer is the same function in fp64 and the sensitivity is pkb's (``perturbed`` and
``sensitivity`` of pkb.runtime.exact, ``PERTURBATIONS`` runs).

Holes still open (a wrong answer that passes, an honest one that fails) are ``xfail(strict=True,
raises=AssertionError)``: the final assertion states what the judge should do, and the reason gives the numbers; the
five this round closed (``# Closed``) are ordinary tests now; a precondition that no longer holds
raises ``RuntimeError`` and fails the test outright. Attacks the rule stops, and honest answers it passes, are ordinary
tests.
"""

from __future__ import annotations

import math

import pytest
import torch

from pkb.evaluate.accuracy import PERTURBATIONS, Pool, Where, bit_equal, judge_one
from pkb.problem import default_tolerance, reduction_tolerance
from pkb.runtime.exact import perturbed, sensitivity

torch.set_num_threads(1)

F, B, H, C = torch.float32, torch.bfloat16, torch.float16, torch.complex64
PRECISION = {F: "fp32", B: "bf16", H: "fp16", C: "fp32"}
U = {F: 2.0**-24, B: 2.0**-8, H: 2.0**-11}


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise RuntimeError(f"precondition no longer holds: {what}")


def _judge(reference, got, exact, sens, tolerance, run_dtype):
    """judge_one, and the pooled numbers."""
    pool = Pool("one", "out", run_dtype)
    found = pool.add(reference, got, exact, sens, tolerance, Where(0, "one", 0)) or pool.verdict()
    return found, pool.numbers()


def _exact_and_sensitivity(function, inputs: tuple, dtype: torch.dtype):
    """The function in fp64 on the inputs, and pkb's sensitivity (PERTURBATIONS perturbed fp64 runs)."""
    exact = function(*[x.to(torch.complex128 if x.is_complex() else torch.float64) for x in inputs])
    moved = [[function(*perturbed(inputs, PRECISION[dtype], k))] for k in range(PERTURBATIONS)]
    return exact, sensitivity([exact], moved)[0]


def _gemm(dtype, rows=256, k=64, cols=64, scale=1.0, seed=1):
    """y = x @ w in ``dtype`` (x ~ N(0, 1), w ~ N(0, (scale / 8)^2): y ~ N(0, scale^2)): the exact answer, its
    sensitivity, the reference (fp32 accumulation rounded once) and the fp32 accumulator."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(k, cols, generator=gen) * scale / 8).to(dtype)
    exact, sens = _exact_and_sensitivity(lambda a, b: a @ b, (x, w), dtype)
    accumulator = x.float() @ w.float()
    return exact, sens, accumulator.to(dtype), accumulator


# -- honest answers (the three marked Closed failed before this round) ------------------------------------------


def _mean_losses(seed: int, trials: int, terms: int = 4096):
    """A scalar loss per trial: the mean of ``terms`` positive fp32 values (per-token losses in [1, 5)), the reference
    torch's blocked sum, the candidate a sequential fp32 loop (an honest order: the docstring's 'sequential fp32 loop
    over K terms errs by about sqrt(K) / 2 honest scales')."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(trials, terms, generator=gen) * 4 + 1
    exact, sens = _exact_and_sensitivity(lambda a: a.sum(-1) / terms, (x,), F)
    loop = torch.zeros(trials)
    for j in range(terms):
        loop = loop + x[:, j]
    return exact, sens, x.sum(-1) / terms, loop / terms


# Closed (a hole this round found, closed in the same change: the fit's noise now adds the problem's declared long-
# sum RMS (Tolerance.accumulation) to each element's scale). It was: honest answer fails: a scalar fp32 loss, the
# mean of 4,096 per-token losses in [1, 5), summed by a sequential fp32 loop (15 roundings off; torch's blocked sum
# 1.3; sensitivity 0.87 rounding), fails the bias test at 15.5 standard errors, even where the problem declares the
# long sum (reduction_tolerance(..., local_terms=4096): the accumulation widens the element-wise and RMS bounds,
# never the fit). A tensor of fewer than 16 elements is one cluster, so its only standard error is the model's
# (every element off by its own scale s), and a one-element fit's beta is e / x: the fit asks |e| <= 6 s + 3
# roundings. 12 of 20 seeds fail alone, 7 of 28 pooled over the 3 default trials (here seed 2: 'bias -1.33e-4, 7.8
# SE' over 3 near-equal x, alpha and beta collinear); an 8-element per-sample loss vector fails at 12 SE
def test_a_scalar_loss_summed_by_an_honest_sequential_loop_passes():
    tolerance = reduction_tolerance(F, 1, 3.0, 4096)
    _require(tolerance.accumulation > 0, "the long sum is declared")
    exact, sens, reference, loop = _mean_losses(0, 1)
    _require(float((loop.double() - exact).abs().max() / (exact * U[F]).max()) < 64, "within 64 roundings")
    alone = judge_one(reference[0], loop[0], exact[0], sens[0], tolerance, F)
    exact, sens, reference, loop = _mean_losses(2, 3)
    pool = Pool("c", "out", F)
    for trial in range(3):
        _require(pool.add(reference[trial], loop[trial], exact[trial], sens[trial], tolerance,
                          Where(0, "c", trial)) is None, "element-wise within the bound")
    assert alone is None and pool.verdict() is None, (alone, pool.verdict())


def test_a_scalar_loss_summed_in_fp64_or_by_kahan_passes():
    """The same loss summed more accurately than the reference (fp64 accumulation; Kahan-compensated fp32) passes."""
    exact, sens, reference, _ = _mean_losses(0, 1)
    x = torch.rand(1, 4096, generator=torch.Generator().manual_seed(0)) * 4 + 1
    total, carry = torch.zeros(()), torch.zeros(())
    for j in range(4096):
        term = x[0, j] - carry
        new = total + term
        carry = (new - total) - term
        total = new
    for got in ((x.double().sum() / 4096).float(), total / 4096):
        assert judge_one(reference[0], got, exact[0], sens[0], reduction_tolerance(F, 1, 3.0, 4096), F) is None


def _zero_row_ring(zero_rows: float, world: int = 4, seed: int = 0, rows: int = 256):
    """A bf16 all-reduce at W = ``world`` of [rows, 64] gradients whose rows are zero with probability ``zero_rows``
    on every rank (an embedding's gradient: rows of tokens no rank saw): the exact answer, its sensitivity, the
    reference (fp32, rounded once), a ring in bf16 (a rounding after each addition: reduction_tolerance's own honest
    kernel) and the tolerance (reduction_tolerance(bf16, W))."""
    gen = torch.Generator().manual_seed(seed)
    live = torch.rand(rows, 1, generator=gen) >= zero_rows
    parts = tuple((torch.randn(rows, 64, generator=gen) * live).to(B) for _ in range(world))
    exact, sens = _exact_and_sensitivity(lambda *a: torch.stack(a).sum(0), parts, B)
    reference = torch.stack([p.float() for p in parts]).sum(0).to(B)
    ring = parts[0]
    for part in parts[1:]:
        ring = ring + part
    return exact, sens, reference, ring, reduction_tolerance(B, world)


def _ring(zero_rows: float, seed: int = 0, world: int = 4):
    """The honest ring of ``_zero_row_ring`` judged: (the verdict, the pooled numbers)."""
    exact, sens, reference, ring, tolerance = _zero_row_ring(zero_rows, world, seed)
    return _judge(reference, ring, exact, sens, tolerance, B)


# Closed (a hole this round found, closed in the same change: the outlier test's median is now taken over the
# elements that are not zero whatever the inputs (they are still counted)). It was: honest answer fails: a bf16 ring
# all-reduce (W = 4) of gradients with 30 % zero rows on every rank fails the outlier test: 412 of 16,384 elements
# beyond 8 medians (the reference, fp32 rounded once, 0; at most ~59 pass). The same ring with no zero rows passes
# (9 far). The zero rows and the ring's exact bf16 sums make 44 % of its errors exactly 0, so the median |z'| is
# 0.15 and 8 medians lies inside the ring's ordinary 2-3 roundings. 20 % zero rows: 58-66 far (the limit); 45 %:
# 904; at W = 8, 30 %: 492
def test_a_bf16_ring_all_reduce_of_gradients_with_zero_rows_passes():
    found, numbers = _ring(0.0)
    _require(found is None and numbers["far_found"] < 20, "the ring passes without zero rows")
    found, numbers = _ring(0.3)
    assert found is None, (found, numbers["far_found"], numbers["far_reference"])


def _relu_split_k(activation):
    """activation(x @ w) in bf16, K = 1,024 in 4 splits whose partials are rounded to bf16 and summed in bf16 (a
    row-parallel linear's bf16 all-reduce, or split-K with bf16 workspace); the reference accumulates in fp32."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(256, 1024, generator=gen).to(B)
    w = (torch.randn(1024, 64, generator=gen) / 32).to(B)
    exact, sens = _exact_and_sensitivity(lambda a, b: activation(a @ b), (x, w), B)
    reference = activation(x.float() @ w.float()).to(B)
    partials = [(x[:, i * 256:(i + 1) * 256].float() @ w[i * 256:(i + 1) * 256].float()).to(B) for i in range(4)]
    total = partials[0]
    for partial in partials[1:]:
        total = total + partial
    fp32_partials = sum(x[:, i * 256:(i + 1) * 256].float() @ w[i * 256:(i + 1) * 256].float() for i in range(4))
    tolerance = default_tolerance(B)
    return (_judge(reference, activation(total.float()).to(B), exact, sens, tolerance, B),
            _judge(reference, activation(fp32_partials).to(B), exact, sens, tolerance, B))


def test_split_k_with_bf16_partials_passes_without_relu():
    """The identity and GELU after split-K with bf16 partials pass (46 and 28 far of 16,384), and so do fp32
    partials."""
    for activation in (lambda t: t, torch.nn.functional.gelu):
        (bf16, _), (fp32, _) = _relu_split_k(activation)
        assert bf16 is None and fp32 is None, (bf16, fp32)


# Closed (a hole this round found, closed in the same change: the outlier test's median is now taken over the
# elements that are not zero whatever the inputs (ReLU's negative side)). It was: honest answer fails: relu(x @ w)
# in bf16 with split-K over 4 bf16 partials summed in bf16 (RMS 1.9x the reference's) fails the outlier test: 1,970
# of 16,384 (12 %) beyond 8 medians, the reference 0. ReLU's exact zeros (49.6 % of the elements) and the bf16
# sum's exact results put the median |z'| at 0.005, so the FAR_LEAST floor (two roundings) is the threshold, so
# every element the partials' rounding moves by more than 2 roundings is 'far'. The same kernel without the ReLU,
# or with GELU, passes; fp32 partials pass
def test_relu_after_split_k_with_bf16_partials_passes():
    (found, numbers), (fp32, _) = _relu_split_k(torch.relu)
    _require(fp32 is None, "fp32 partials pass")
    assert found is None, (found, numbers["far_found"])


# -- wrong answers (four still pass: the xfails) ------------------------------------------------------------------


def _overflowing_fp16_reference():
    """An fp16 output a * b / 64 (a, b ~ N(0, 300^2)) whose reference computes a * b in fp16 and overflows on 1,223 of
    4,096 elements where the exact answer (and its fp16 rounding) is finite."""
    gen = torch.Generator().manual_seed(3)
    a = (torch.randn(4096, generator=gen) * 300).half()
    b = (torch.randn(4096, generator=gen) * 300).half()
    exact, sens = _exact_and_sensitivity(lambda p, q: p * q / 64, (a, b), H)
    reference = a * b / 64
    return exact, sens, reference, (a.float() * b.float() / 64).half()


# Closed (a hole this round found, closed in the same change: every element where the candidate and the exact answer
# are finite is now judged element-wise, against the exact answer alone where the reference overflowed). It was:
# wrong answer passes: where the reference is inf or NaN and the exact answer finite (an fp16 reference whose
# intermediate a * b overflows: 1,223 of 4,096 elements), the candidate may be finite there (right: an fp32 kernel
# is), but its value is never judged: 'finite' in Pool.add needs the reference finite too, so err is 0 there and
# every test skips it. Zeros there pass, and so does the exact answer negated
def test_finite_values_where_the_reference_overflows_are_judged_against_the_exact_answer():
    exact, sens, reference, honest = _overflowing_fp16_reference()
    overflowed = ~torch.isfinite(reference)
    _require(int(overflowed.sum()) > 1000 and bool(torch.isfinite(exact.half()).all()), "the reference overflows")
    _require(judge_one(reference, honest, exact, sens, default_tolerance(H), H) is None, "the fp32 kernel passes")
    for got in (torch.where(overflowed, 0.0, honest), torch.where(overflowed, -honest, honest)):
        assert judge_one(reference, got.half(), exact, sens, default_tolerance(H), H) is not None


def test_inf_where_the_exact_answer_is_finite_and_the_reference_is_not_passes_only_at_the_references_places():
    """The candidate may repeat the reference's overflow (inf where the reference has it), not put inf elsewhere."""
    exact, sens, reference, honest = _overflowing_fp16_reference()
    assert judge_one(reference, reference, exact, sens, default_tolerance(H), H) is None
    elsewhere = torch.where(torch.arange(4096) == int(torch.isfinite(reference).nonzero()[0]), math.inf, honest.float())
    found = judge_one(reference, elsewhere.half(), exact, sens, default_tolerance(H), H)
    assert found is not None and "NaN or inf" in found.reason, found


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "wrong answer passes: a bf16 GEMM output of size ~0.03 (a gradient, a small-init layer) returned through fp8 e4m3 "
    "(3 significand bits) passes under bf16's default tolerance: RMS 17x the reference's, bias 2.7 SE, no outliers. "
    "Element-wise, 64 honest scales is at least 37 bf16 roundings, wider than fp8 e4m3's 16 (and e5m2's 32: e5m2 "
    "passes too at 0.02-0.03, RMS 31x, 4 seeds of 6), and the atol (0.016) is not the tighter bound for values this "
    "small; the RMS test's tolerance share (0.1 rms(T) = 1.6e-3) lets through what 8x the reference's (1.4e-4) would "
    "stop. At values ~1 the same fp8 output fails element-wise"))
def test_a_small_valued_bf16_output_through_fp8_is_caught():
    exact, sens, reference, accumulator = _gemm(B, scale=1.0)
    found, _ = _judge(reference, accumulator.to(torch.float8_e4m3fn).to(B), exact, sens, default_tolerance(B), B)
    _require(found is not None, "fp8 at values ~1 is caught")
    exact, sens, reference, accumulator = _gemm(B, scale=0.03)
    found, numbers = _judge(reference, accumulator.to(torch.float8_e4m3fn).to(B), exact, sens, default_tolerance(B), B)
    _require(numbers["rms_ratio"] > 12, "the fp8 output is over 12x noisier than the reference")
    assert found is not None


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "wrong answer passes: an fp16 run's GEMM output rounded through bf16 (an fp16 all-reduce whose all-gather half "
    "ships bf16) passes: 7.9x the reference's RMS error; bf16 has 3 fewer significand bits than fp16, so its rounding "
    "is 2^3 = RMS_FACTOR times fp16's, and it passes or fails by sampling noise at values ~1 (4 of 6 seeds pass, "
    "7.91x-8.04x) and always where values are small (~0.03: RMS 5e-5, a quarter of the tolerance share 2.1e-4)"))
def test_an_fp16_output_rounded_through_bf16_is_caught():
    exact, sens, reference, accumulator = _gemm(H, scale=0.03)
    found, numbers = _judge(reference, accumulator.to(B).to(H), exact, sens, default_tolerance(H), H)
    _require(numbers["rms_ratio"] > 7, "bf16 rounding is ~8x fp16's")
    assert found is not None


def _gained(dtype, gain, column_gains, cols=16, seed=1):
    exact, sens, reference, _ = _gemm(dtype, rows=1024, cols=cols, seed=seed)
    g = torch.randn(cols, generator=torch.Generator().manual_seed(5)).double()
    g = (g - g.mean()) / g.std()
    got = (exact * (1 + U[dtype] * (gain + column_gains * g))).to(dtype)
    return _judge(reference, got, exact, sens, default_tolerance(dtype), dtype)


def test_a_bf16_gain_of_half_a_unit_roundoff_is_caught():
    found, _ = _gained(B, 0.5, 0.0)
    assert found is not None and "multiplicative bias" in found.reason, found


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "wrong answer passes: a +0.78 % gain (2 unit roundoffs of bf16) on a [1024, 16] bf16 output (router logits over "
    "16 experts, 16 heads) passes when each column also gets its own gain of +-0.78 % (sd): bias +7.9e-3 at 4.1 "
    "standard errors (SE 1.9e-3, the column clustering's: 16 clusters), RMS 6.7x, no outliers; the gain alone, even "
    "0.5 u, is caught. The standard error is the largest clustering's, and the candidate chooses the axis: 16 "
    "different errors suffice (not one per row, as the docstring says). With 64 columns the same noise leaves 8 SE"))
def test_a_bf16_gain_hidden_behind_per_column_gains_is_caught():
    found, _ = _gained(B, 2.0, 2.0, cols=64)
    _require(found is not None and "multiplicative bias" in found.reason, "caught with 64 columns")
    found, numbers = _gained(B, 2.0, 2.0)
    _require(numbers["bias"] > 1.5 * U[B], f"the fit sees the gain ({numbers['bias']:.3g})")
    assert found is not None


def _bf16_gemm_gain(where, gain):
    exact, sens, reference, _ = _gemm(B, seed=6)
    got = torch.where(where(exact), exact * (1 + gain * U[B]), exact).to(B)
    return judge_one(reference, got, exact, sens, default_tolerance(B), B)


def test_a_gain_on_the_negative_values_alone_or_on_one_binade_alone_is_caught():
    """+0.5 u on the negative values only (15 SE), on |x| in [0.5, 1) only (11 SE): the fit sees both."""
    for where in (lambda x: x < 0, lambda x: (x.abs() >= 0.5) & (x.abs() < 1)):
        found = _bf16_gemm_gain(where, 0.5)
        assert found is not None and "bias" in found.reason, found


def _fft(got_from_exact):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 256, generator=gen).to(C)
    exact, sens = _exact_and_sensitivity(lambda a: torch.fft.fft(a, dim=-1), (x,), C)
    return _judge(torch.fft.fft(x, dim=-1), got_from_exact(exact).to(C), exact, sens, default_tolerance(C), F)


def test_a_complex_gain_of_four_unit_roundoffs_is_caught():
    found, _ = _fft(lambda exact: exact * (1 + 4 * U[F]))
    assert found is not None and "multiplicative bias" in found.reason, found


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "wrong answer passes: a complex64 FFT (64 x 256) rotated by 4 unit roundoffs (every bin times e^(i 4u), a "
    "coherent phase error) passes: RMS 2.6x, bias -1.7e-10 +- 1.5e-9, 53 of 32,768 far; the same size of gain is 586 "
    "standard errors. The fit regresses each real part on itself and each imaginary part on itself: a rotation moves "
    "each part by the other part's value, which it cannot see; only the element-wise bound stops it (16 u)"))
def test_a_complex_output_rotated_by_four_unit_roundoffs_is_caught():
    angle = 4 * U[F]
    found, _ = _fft(lambda exact: exact * complex(math.cos(angle), math.sin(angle)))
    assert found is not None


# -- bit_equal in the tensors' own dtype ----------------------------------------------------------------------------


def test_bit_equal_in_the_tensors_own_dtype():
    """NaN with any payload is NaN, +0 and -0 are equal (as documented), fp8 compares by value with NaN where NaN,
    a complex conjugate view is read as its values, a NaN in one part of a complex number is not a NaN in the other,
    and broadcastable shapes are not equal."""
    quiet = torch.tensor([float("nan"), 1.0])
    payload = torch.tensor([0x7FC00123, 0x3F800000], dtype=torch.int32).view(torch.float32)
    assert bit_equal(quiet, payload) and bit_equal(quiet.bfloat16(), payload.bfloat16())
    assert bit_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    for name in ("float8_e4m3fn", "float8_e5m2"):
        codes = torch.tensor([1.0, 2.0, float("nan")]).to(getattr(torch, name))
        assert bit_equal(codes, codes.clone())
        assert not bit_equal(codes, torch.tensor([1.0, 2.0, 4.0]).to(getattr(torch, name)))
    z = torch.tensor([1 + 2j, 3 - 1j])
    assert bit_equal(z.conj(), torch.tensor([1 - 2j, 3 + 1j])) and not bit_equal(z.conj(), z)
    assert not bit_equal(torch.tensor([complex(float("nan"), 1.0)]), torch.tensor([complex(float("nan"), 2.0)]))
    assert not bit_equal(torch.ones(2, 1), torch.ones(1, 2))
    assert not bit_equal(torch.tensor(1.0), torch.tensor([1.0]))


# Closed (a latent hole this round found, closed in the same change: bit_equal now says no to tensors of other dtypes
# or shapes before torch.equal, which promotes). It was not reachable (the judge's callers check dtype and shape
# first: compare.tensor_metadata, agreement._same): a one-element complex tensor and a one-element real one compared
# [re, im] with [v] by broadcasting, so 1+1j 'equalled' 1.0 (either way round), and an int64 2^53 + 1 'equalled' the
# float64 2^53 (both raised to fp64).
def test_bit_equal_of_mixed_dtypes_compares_values():
    assert not bit_equal(torch.tensor([1 + 1j]), torch.tensor([1.0]))
    assert not bit_equal(torch.tensor([1.0]), torch.tensor([1 + 1j]))
    assert not bit_equal(torch.tensor([2.0**53], dtype=torch.float64), torch.tensor([2**53 + 1]))
