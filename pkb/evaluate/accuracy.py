"""pkb's rule for values: which rule judges each value of a reply, and the accuracy rule for floating values.

Which rule (``Judge.reply``, the only place it is decided):

- numbers that are not floats, strings, None, and integer and bool tensors (indices, counts, masks): exactly equal;
- floating tensors the problem wants exact (``Tolerance.exact()``: data movement): bit for bit, NaN where NaN;
- a floating value bit for bit the reference's: nothing to judge (and no exact answer is computed for it);
- any other floating value: the accuracy rule, against the exact answer (the reference in fp64 arithmetic on the same
  inputs, pkb.runtime.exact) where there is one, else against the reference's own output (a problem whose meaning
  lies in its rounding, ``Problem.exact_dtype`` None: quantisation; or a case too large to raise).

**The accuracy rule.** For one floating tensor, ``x`` the exact answer (or the reference's output), ``c`` the
candidate's, ``r`` the reference's, ``e = c - x`` and ``e_r = r - x`` their errors, ``h`` half an ulp of ``x`` in the
output's dtype and ``h'`` in the coarser of that and the run's precision, ``T = atol + rtol |x|`` the problem's
tolerance, and ``sigma`` each element's sensitivity (the RMS of how far the exact answer moves when every input moves
by one rounding of its dtype, over ``PERTURBATIONS`` perturbed runs: pkb.runtime.exact), the honest error scale of each
element is ``s = sqrt(sigma^2 + h'^2 / 3)``: what rounding the inputs once and the result once costs there (where
the exact value is zero whatever the inputs, ``x`` and ``sigma`` at fp64's noise, as an FFT's structurally zero bins,
``h'`` is one rounding of the tensor's RMS value: such an element is still computed from values of the tensor's
size). An honest
computation in any order or tree, at any precision at least the run's, errs by a sum of roundings, none larger than
the values it rounds: its errors are spread over every element, of either sign, on each element's own scale.

1. **Element-wise**, per tensor: ``|e_i| <= FACTOR max(h_i, |e_r,i|) + min(T_i, Z_ELEMENT s'_i)``, with
   ``s'_i = sqrt(s_i^2 + m_i)``, ``m_i`` the mean of ``e_r^2`` over the tensor's elements of ``x_i``'s binade
   (``floor(log2 |x|)``) where it holds at least ``MIN_REFERENCE_ELEMENTS``, else 0: what the reference's own
   intermediate roundings cost on values of that size (an exp and a log of a softmax, a bf16 activation stored
   between two GEMMs), which the inputs' sensitivity does not see. An element near zero amid larger ones may err as
   its computation's intermediates do, measured on the reference's elements of its size: never learnt from larger
   or smaller values (a few small values among large ones keep their own scale), and averaged (one element's or one
   row's error is a single draw, near zero by chance as often as not). Three
   roundings of the value or three times the reference's own error there, and the tolerance or 64 honest scales,
   whichever is tighter (in bf16 the tolerance is a few honest scales wide; in fp32 thousands, and 64 scales is the bound; where
   the problem declares a long local sum, ``Tolerance.accumulation``, the scales never bind below
   ``ACCUMULATION_SIGMAS`` of it: a sequential fp32 loop over K terms errs by about sqrt(K) / 2 honest scales), the
   error measured from the range 0 to ``b x_i`` where the problem declares a bias ``b`` for the output
   (``Tolerance.bias``, below: with its sign). NaN and
   infinity must sit where the reference's or the correctly rounded exact answer's do; where the reference overflowed
   and the exact answer is finite, a finite candidate is judged against the exact answer alone (``e_r`` taken as 0:
   an fp32 kernel there is right, a value of its choosing is not), and so it is in the pooled tests below. An input
   the reference leaves exactly as it was (its value is the exact answer's bit for bit) must come back bit for bit.
2. The rest is pooled over every tensor of one output of one case (its ranks and trials; a replica once), so that an
   error too small to show in one tensor shows in all of them together. With ``z_i = e_i / s_i``:
   - **RMS**: ``rms(e) <= max(RMS_FACTOR max(rms(e_r), rms(h') / sqrt 3), TOLERANCE_SHARE rms(T))``. An honest order
     may be noisier than the reference's (a sequential fp32 sum of 1,024 rows is about 5x a blocked one, of 4,096
     about 8x), never by much; a lossy format (fp8 on the wire, bf16 or tf32 arithmetic in an fp32 run) is noisier by
     far more. The tolerance's share lets through what a problem accepts anyway where the reference's own error is
     tiny: in fp32, 170 unit roundoffs, a sequential sum of some 10^5 terms; and ``ACCUMULATION_RMS`` times the RMS
     error the problem declares for its long local sums (``Tolerance.accumulation``).
   - **Outliers**: with ``z'_i = e_i / s'_i`` (test 1: the honest scale with the reference's error), the share
     of elements with ``|z'_i|`` beyond ``FAR_FACTOR`` times the median ``|z'|`` (or times a
     quarter of a rounding, ``FAR_LEAST``, where the median is smaller: a tensor whose values mostly come out exact)
     must be at most
     ``max(FAR_REFERENCE_FACTOR`` times the reference's own share, ``FAR_SHARE)``: an honest error is a sum of many
     roundings (a bell on each element's scale, whatever its width), while dropping the entries under a threshold, a
     stale or garbage fraction, or a corrupted lane puts large errors on a few elements and none on the rest. The
     sensitivity is estimated from ``PERTURBATIONS`` runs, so ``z`` has tails of its own (about a Student t with as
     many degrees of freedom): the floor leaves room for them. The median is taken over the elements that are not zero
     whatever the inputs (``x`` and ``sigma`` at fp64's noise: a gradient's rows no token touched, ReLU's negative
     side), which an honest kernel gets exactly right and which would drag the median to zero and make ordinary
     roundings elsewhere look far; an error put there counts as far as anywhere, and the share is of the other
     elements (a mostly zero output's live elements may not carry the whole tensor's share).
   - **Bias and offset**: the weighted least-squares fit ``e_i ~ alpha + beta x_i`` (weights ``1 / s_i^2``, with the
     problem's declared long-sum RMS added to ``s_i^2`` in a tensor of fewer than ``MIN_CLUSTER_INDICES`` elements,
     too few to measure its own noise: a scalar loss summed by a sequential fp32 loop is one draw of that noise, not
     a bias; a larger tensor's noise is measured by the cluster-robust errors, and a declared sum wider than the
     real one would hide a gain there) gives an
     additive offset ``alpha`` and a multiplicative bias ``beta``, each tested against its own statistical noise:
     ``|beta - [0, b]| <= BIAS_SIGMAS SE(beta) + max(FACTOR |beta_r|, FACTOR u_s, BIAS_FLOOR u^2)`` (``[0, b]`` the
     range to the problem's signed ``Tolerance.bias`` for the output: a term of that relative size that honest
     arithmetic in the run's dtype loses; ``u`` the run's unit
     roundoff, ``u_s`` the finer of it and fp32's: a scalar kept in fp32, a scale or a reciprocal, shifts every element
     by one rounding of itself; ``u^2`` bounds the second-order bias of honest non-linear arithmetic), and the same for
     ``alpha`` (its floors scaled by the RMS of ``x``). The standard error is the largest of the model's (every element
     off by its own scale, independently) and the cluster-robust ones with each index of each axis of a tensor (of at
     least ``MIN_CLUSTER_INDICES``) a cluster, and each element and runs of ``RUN`` of a flat one: errors correlated
     within a row (a row's norm or softmax sum rounded once) count as one observation per row. Clusters are rows, not blocks
     of rows, so that noise a candidate adds per block of rows to widen the standard error does not: it would need a
     different error on every row, which the RMS test bounds. Truncating instead of rounding to nearest (about half
     an ulp), a gain of +0.28 %, a stale constant added: each is hundreds of standard errors from zero.
     Values below the smallest normal of the run's dtype (or the output's, if coarser) are fitted apart, weighted
     alike: there rounding steps are absolute (the smallest subnormal), and honest arithmetic on
     values of one sign errs to one side (Adam's second moment in fp16: ``beta2 v`` rounds back to ``v``, a product
     below half a step to zero), by up to 0.8 of a step over two kernels. Their offset may be ``BIAS_SIGMAS`` standard
     errors plus ``SUBNORMAL_STEPS`` steps, their gain as much over the RMS of their values (an offset or gain that
     moves them by more, or an offset confined to them, fails; truncation, half a step, passes as fp16 arithmetic
     does).
   - **Quantised values** (a recipe's output, judged against the reference's: ``Problem.exact_dtype`` None): at most
     ``OFF_SHARE`` of the fp8 codes, and of the values of any dtype coarser than fp32, may differ from the reference's
     at all. The recipe's arithmetic (fp32) in another order moves a handful of them one step; rounding toward zero,
     another scale or one step of noise moves far more.

Where there is no exact answer (a recipe, or a case too large to raise to fp64), ``x`` is the reference's own output
(``e_r = 0``) and there is no sensitivity: the element-wise bound is the larger of the tolerance and three roundings,
and there is no outlier test. Every test runs on
outputs of any size; a reply's first failure is its verdict, and the message names the test, the numbers and what is
allowed.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from pkb.evaluate.compare import Leaf, Mismatch, at, real_shape, unravel, walk
from pkb.problem import ACCUMULATION_RMS, ACCUMULATION_SIGMAS, Tolerance

FACTOR = 3.0  # how many roundings of an element, or of the reference's error there, an element may be off
Z_ELEMENT = 64.0  # element-wise: at most this many honest scales off (where tighter than the tolerance)
RMS_FACTOR = 8.0  # how much noisier than the reference's (or one rounding's) an honest order may be, in RMS
TOLERANCE_SHARE = 0.1  # an RMS error within this share of the tolerance's always passes (fp32: a long sequential sum)
PERTURBATIONS = 8  # perturbed exact runs behind each sensitivity (pkb.runtime.exact)
FAR_FACTOR, FAR_SHARE, FAR_REFERENCE_FACTOR = 8.0, 0.002, 2.0  # beyond 8 medians: 2x the reference's, or 0.2 %
FAR_LEAST = 0.25  # in roundings: the least median the outlier test takes (8 x a quarter rounding: two roundings)
BIAS_SIGMAS = 6.0  # a bias or offset within this many standard errors of zero is noise
BIAS_FLOOR = 4.0  # times u^2: the second-order bias honest arithmetic may carry
SUBNORMAL_STEPS = 1.0  # the offset honest arithmetic may carry below the smallest normal, in subnormal steps (the
# intercept of two kernels of fp16 Adam: 0.8; six honest kernels of a red-team's: a mean of 0.31 at most)
MIN_REFERENCE_ELEMENTS = 32  # the reference's error is averaged over at least this many elements of one binade
MIN_CLUSTER_INDICES = 16  # an axis with fewer indices is not cut into clusters (too few to estimate a variance)
RUN = 64  # a flat tensor's clusters: runs of this many elements
OFF_SHARE = 0.01  # a recipe's quantised values: the share that may differ from the reference's
CODE_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                      "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, name))

ToleranceFor = Callable[[torch.dtype], Tolerance]


@dataclass(frozen=True)
class Exact:
    """The exact answer to one rank's reply: its outputs and inputs after the call (plain data, fp64) and their
    sensitivity; ``unavailable`` says why there is none (the case is too large to raise)."""

    outputs: Any = None
    inputs_after: Any = None
    sensitivity: Any = None  # [outputs' sensitivities, inputs_after's]
    unavailable: str | None = None

    def at(self, part: str, keys: tuple) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The exact value and its sensitivity at ``keys`` of ``part`` (``outputs`` or ``inputs_after``)."""
        index = 0 if part == "outputs" else 1
        value = at(getattr(self, part), keys)
        sensitivity = at(self.sensitivity[index], keys) if isinstance(self.sensitivity, list) else None
        return (value if isinstance(value, torch.Tensor) else None,
                sensitivity if isinstance(sensitivity, torch.Tensor) else None)


NO_EXACT = Exact(unavailable="the problem has no exact answer")


@dataclass(frozen=True)
class Where:
    """Where a reply came from: for messages (``rank 1, case odd, trial 2``) and for pooling (``case``)."""

    rank: int
    case: str
    trial: Any

    def __str__(self) -> str:
        return f"rank {self.rank}, case {self.case}, trial {self.trial}"


class Judge:
    """One evaluation's judge of values (the module's docstring): ``reply`` judges one rank's reply to one case and
    trial and pools what the aggregate tests need; ``pooled`` runs those once every reply is in; ``summary`` gives the
    numbers behind the verdict."""

    def __init__(self, run_dtype: torch.dtype, recipe: bool = False):
        self.run_dtype = run_dtype
        self.recipe = recipe  # the problem's answer is a recipe's rounding (Problem.exact_dtype None)
        self.pools: dict[tuple[str, str], Pool] = {}
        self.counts = {"bit_equal": 0, "exact": 0, "against_exact_answer": 0, "against_reference": 0}

    def reply(self, where: Where, part: str, expected: Any, got: Any, tolerance_for: ToleranceFor,
              exact: Callable[[], Exact] | None, path: str) -> Mismatch | None:
        """The first value of ``got`` (one rank's ``part``: outputs or inputs after the call) that fails its rule
        against ``expected`` (the reference's), or None. ``exact`` fetches the exact answer to the whole reply (run
        only when a floating value is not the reference's bit for bit); None: there is none."""
        fetched: list[Exact] = []

        def exact_answer() -> Exact:
            if not fetched:
                fetched.append(exact() if exact is not None else NO_EXACT)
            return fetched[0]

        for leaf in walk(expected, got, path):
            if isinstance(leaf, Mismatch):
                return leaf
            found = self._leaf(leaf, where, part, tolerance_for, exact_answer)
            if found is not None:
                return found
        return None

    def _leaf(self, leaf: Leaf, where: Where, part: str, tolerance_for: ToleranceFor,
              exact_answer: Callable[[], Exact]) -> Mismatch | None:
        expected, got = leaf.expected, leaf.got
        if not isinstance(expected, torch.Tensor):
            if isinstance(expected, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
                expected = torch.tensor([expected], dtype=torch.float64)
                got = torch.tensor([float(got)], dtype=torch.float64)
            else:
                same = type(got) is type(expected) and _equal_objects(expected, got)
                return None if same else Mismatch(leaf.path, f"expected {expected!r:.80}, got {got!r:.80}")
        if not (expected.is_floating_point() or expected.is_complex()):
            self.counts["exact"] += 1
            return _exactly(expected, got, leaf.path, "integer and bool values are compared exactly")
        if bit_equal(expected, got):
            self.counts["bit_equal"] += 1
            return None
        tolerance = tolerance_for(expected.dtype)
        if tolerance.is_exact:
            self.counts["exact"] += 1
            return _exactly(expected, got, leaf.path, "this output moves data: it must be the reference's bit for bit")
        answer = exact_answer()
        value, sensitivity = answer.at(part, leaf.keys) if answer.unavailable is None else (None, None)
        if value is not None and (value.numel() * (2 if expected.is_complex() else 1)
                                  != expected.numel() * (2 if expected.is_complex() else 1) or value.numel() == 0):
            value = None
        self.counts["against_exact_answer" if value is not None else "against_reference"] += 1
        pool = self.pools.setdefault((where.case, leaf.path), Pool(where.case, leaf.path, self.run_dtype, self.recipe))
        return pool.add(expected, got, value, sensitivity, tolerance, where, unchanged_must_stay=part == "inputs_after")

    def pooled(self) -> Mismatch | None:
        """The first output (of one case, over every rank and trial judged) that fails an aggregate test, or None."""
        for pool in self.pools.values():
            found = pool.verdict()
            if found is not None:
                return found
        return None

    def summary(self) -> dict:
        """``details.accuracy``: how every value was judged, and the numbers of the least accurate output."""
        judged = [pool.numbers() for pool in self.pools.values()]
        worst = max(judged, key=lambda numbers: numbers["rms_ratio"], default=None)
        return {"values": dict(self.counts), "outputs_judged": len(judged), "least_accurate": worst}

    def text(self) -> str:
        """What the values came to, in a few words that are true: e.g. ``every output the reference's bit for bit``,
        or ``12 tensors against the exact answer (RMS error at most 1.3x the reference's, at out[0] of case odd)``."""
        counts = self.counts
        if not self.pools:
            what = "every floating output the reference's bit for bit" if counts["bit_equal"] else "no floating output"
            return what + (" and every other value exactly equal" if counts["exact"] else "")
        worst = max((pool.numbers() for pool in self.pools.values()), key=lambda numbers: numbers["rms_ratio"])
        judged = counts["against_exact_answer"] + counts["against_reference"]
        against = ("against the exact answer" if not counts["against_reference"] else "against the reference's output"
                   if not counts["against_exact_answer"] else "against the exact answer or the reference's output")
        return (f"{judged} floating tensor{'s' * (judged != 1)} within pkb's accuracy rule {against} (RMS error at most "
                f"{worst['rms_ratio']:.3g}x the larger of the reference's and one rounding's, at {worst['path']} of "
                f"case {worst['case']}); {counts['bit_equal']} bit for bit the reference's")


def judge_one(expected: torch.Tensor, got: torch.Tensor, exact: torch.Tensor | None, sensitivity: torch.Tensor | None,
              tolerance: Tolerance, run_dtype: torch.dtype, path: str = "out") -> Mismatch | None:
    """One tensor alone through the accuracy rule (element-wise, then the aggregate tests on it alone): for tests and
    benchmarks of the rule; an evaluation pools every tensor of an output (``Judge``)."""
    pool = Pool("one", path, run_dtype)
    return pool.add(expected, got, exact, sensitivity, tolerance, Where(0, "one", 0)) or pool.verdict()


def same_answer(first: Any, again: Any, tolerance_for: ToleranceFor, deterministic: bool, path: str = "out"
                ) -> Mismatch | None:
    """Whether a second run on the same inputs gave the same answer: bit for bit where the problem is deterministic,
    within its tolerance element-wise otherwise (two runs of one candidate, no exact answer involved)."""
    for leaf in walk(first, again, path):
        if isinstance(leaf, Mismatch):
            return leaf
        a, b = leaf.expected, leaf.got
        if not isinstance(a, torch.Tensor):
            if type(a) is not type(b) or not _equal_objects(a, b):
                return Mismatch(leaf.path, f"first {a!r:.80}, then {b!r:.80}")
            continue
        if bit_equal(a, b):
            continue
        tolerance = tolerance_for(a.dtype)
        if deterministic or tolerance.is_exact or not (a.is_floating_point() or a.is_complex()):
            return _exactly(a, b, leaf.path, "the problem is deterministic: a second run must give the same bits")
        found = within_tolerance(a, b, tolerance, leaf.path)
        if found is not None:
            return found
    return None


def within_tolerance(expected: torch.Tensor, got: torch.Tensor, tolerance: Tolerance, path: str) -> Mismatch | None:
    """The element-wise tolerance alone (``|got - expected| <= atol + rtol |expected|``, NaN where NaN): the timed
    outputs against the reference's timed outputs, and a second run against the first."""
    if not (expected.is_floating_point() or expected.is_complex()):
        return _exactly(expected, got, path, "integer and bool values are compared exactly")
    e, g = _flat64(expected), _flat64(got)
    both_nan, same_inf = torch.isnan(e) & torch.isnan(g), torch.isinf(e) & (e == g)
    diff = torch.where(both_nan | same_inf, 0.0, (g - e).abs()).nan_to_num(nan=math.inf)
    bad = diff > tolerance.atol + tolerance.rtol * e.abs().nan_to_num(posinf=0.0)
    num_bad = int(bad.sum())
    if not num_bad:
        return None
    worst = int(diff.argmax())
    return Mismatch(path, f"{num_bad} of {e.numel()} elements off by more than the tolerance (atol={tolerance.atol:g}, "
                          f"rtol={tolerance.rtol:g}); largest error {float(diff[worst]):.4g}", num_bad, e.numel(),
                    float(diff[worst]), unravel(worst, real_shape(expected)), 0.0, (), float(e[worst]), float(g[worst]),
                    tolerance.atol, tolerance.rtol)


# -- one output, pooled over its tensors -------------------------------------------------------------------------


class Pool:
    """One output of one case, judged element-wise tensor by tensor (``add``) and in aggregate over all of them
    (``verdict``): the module's docstring, tests 1 and 2."""

    def __init__(self, case: str, path: str, run_dtype: torch.dtype, recipe: bool = False):
        self.case, self.path, self.run_dtype, self.recipe = case, path, run_dtype, recipe
        self.num_tensors = self.numel = 0
        self.seen: set[bytes] = set()  # the tensors pooled so far, by digest: a replica counts once
        self.against_exact = True  # False once a tensor of it was judged against the reference's output
        self.squares = {"error": 0.0, "reference": 0.0, "rounding": 0.0, "tolerance": 0.0, "exact": 0.0,
                        "accumulation": 0.0}
        self.far = {"judged": 0, "found": 0, "reference": 0}
        self.codes = {"judged": 0, "off": 0}
        self.declared_bias = 0.0  # the problem's Tolerance.bias for this output (signed), where it names it
        self.fit, self.fit_reference = Regression(), Regression()
        # the values below the smallest normal, fitted apart (the module's docstring): their count, the sum of their
        # squares and the step
        self.subnormal = {"numel": 0, "squares": 0.0, "step": 0.0}
        self.fit_subnormal, self.fit_subnormal_reference = Regression(), Regression()

    def add(self, expected: torch.Tensor, got: torch.Tensor, exact: torch.Tensor | None,
            sensitivity: torch.Tensor | None, tolerance: Tolerance, where: Where,
            unchanged_must_stay: bool = False) -> Mismatch | None:
        """Judge one tensor element-wise (a Mismatch naming ``where``) and pool its numbers for ``verdict``.
        ``unchanged_must_stay``: an input after the call, which must come back bit for bit where the reference left
        it exactly as the exact answer has it (unchanged)."""
        dtype = _component_dtype(expected.dtype)
        ref, cand = _flat64(expected), _flat64(got)
        ex = _flat64(exact) if exact is not None else ref
        self.against_exact &= exact is not None
        if unchanged_must_stay and exact is not None and ref.numel() >= MIN_CLUSTER_INDICES and bool((ref == ex).all()):
            return _exactly(expected, got, f"{self.path} ({where})", "an input the reference leaves as it was must come "
                                                                    "back bit for bit")
        sized = exact is not None and sensitivity is not None and sensitivity.numel() == ex.numel()
        sens = _flat64(sensitivity) if sized else None
        # element-wise, every element where the candidate and the exact answer are finite is judged (where the reference
        # overflowed, against the exact answer alone); the pooled tests take those where the reference is finite too
        judged = torch.isfinite(cand) & torch.isfinite(ex)
        finite = judged & torch.isfinite(ref)
        misplaced, special = None, None
        if not bool(finite.all()):
            special = torch.where(torch.isfinite(ex), ref, ex)  # the exact answer's NaN or inf, else the reference's
            rounded = torch.where(torch.isfinite(ex), ex.to(dtype).double(), ex)
            special_ok = _same_special(cand, ref) | _same_special(cand, rounded)
            misplaced = (~torch.isfinite(cand) & ~special_ok) | (torch.isfinite(cand) & ~torch.isfinite(ref)
                                                                   & ~torch.isfinite(rounded))
            ex = torch.where(judged, ex, 0.0)
            sens = None if sens is None else torch.where(judged, sens, 0.0)
        err = torch.where(judged, cand - ex, 0.0)
        ref_err = torch.where(finite, ref - ex, 0.0)
        magnitude = ex.abs()
        half_ulp = _half_ulp(magnitude, dtype)
        coarse = _coarser(dtype, self.run_dtype)
        rounding = half_ulp if coarse == dtype else _half_ulp(magnitude, coarse)
        # an element that is exactly zero whatever the inputs (no sensitivity: an FFT's structurally zero bins) is still
        # computed from values of the tensor's size: one rounding of the tensor's RMS value is its least honest scale
        typical = _half_ulp(magnitude.square().mean().sqrt().reshape(1), coarse) if magnitude.numel() else rounding
        tiny = typical / 64  # fp64 noise: far below any rounding of the run's
        structural = (magnitude <= tiny) & ((sens <= tiny) if sens is not None else True)
        least = torch.where(structural, torch.maximum(rounding, typical), rounding)
        scale = (least.square() / 3 + (sens.square() if sens is not None else 0.0)).sqrt()
        allowed_tolerance = tolerance.atol + tolerance.rtol * magnitude
        declared = _declared_bias(tolerance, self.path)
        # with the rounding the reference's own intermediate steps cost in this tensor (the module's docstring); against
        # the reference's own output its error is nothing
        wide_scale = (scale.square() + _reference_mean_square(ref_err, magnitude)).sqrt() if exact is not None else scale
        if exact is not None:  # the honest scales, or a long local sum's honest order (the problem's accumulation)
            honest = (Z_ELEMENT * wide_scale).clamp_min(ACCUMULATION_SIGMAS * tolerance.accumulation)
            allowance = FACTOR * torch.maximum(half_ulp, ref_err.abs()) + torch.minimum(allowed_tolerance, honest)
        else:
            allowance = torch.maximum(allowed_tolerance, FACTOR * half_ulp)
        beyond = err
        if declared:  # an element may carry the bias the problem declares, with its sign: from 0 to b x
            band = declared * ex
            beyond = err - err.clamp(band.clamp(max=0.0), band.clamp(min=0.0))
        off = (beyond.abs() > allowance) & judged
        if misplaced is not None:
            off |= misplaced
        if bool(off.any()):
            return self._element_failure(off, misplaced, err, ex if special is None else torch.where(finite, ex, special),
                                         cand, allowance, expected, where)
        digest = hashlib.blake2b(_bytes(got) + _bytes(ex), digest_size=16).digest()
        if digest in self.seen:  # another rank's replica of a tensor pooled already: the same observation
            return None
        self.seen.add(digest)
        # below the dtype's smallest normal value rounding steps are absolute: fitted apart (the module's docstring)
        subnormal = (magnitude > 0) & (magnitude < torch.finfo(coarse).tiny)
        if bool(subnormal.any()):
            self.subnormal["step"] = float(torch.finfo(coarse).tiny * torch.finfo(coarse).eps)
        # the fit's honest noise: each element's scale, and in a tensor too small to measure its own noise (one
        # cluster) the problem's declared long local sums too (elsewhere the cluster-robust errors measure it)
        few = ex.numel() < MIN_CLUSTER_INDICES and tolerance.accumulation
        fit_scale = (scale.square() + tolerance.accumulation**2).sqrt() if few else scale
        # pooled: every judged element (where the reference overflowed, with its error taken as 0)
        self._pool(err[judged], ref_err[judged], ex[judged], rounding[judged], allowed_tolerance[judged],
                   fit_scale[judged], wide_scale[judged], sens is not None, _clusterings(real_shape(expected), judged),
                   subnormal[judged], structural[judged])
        self.squares["accumulation"] += tolerance.accumulation**2 * int(judged.sum())
        if declared:
            self.declared_bias = declared
        if exact is None and self.recipe and (dtype in CODE_DTYPES or _coarser(dtype, torch.float32) == dtype
                                              and dtype != torch.float32):
            self.codes["judged"] += int(judged.sum())
            self.codes["off"] += int((err != 0).sum())
        return None

    def _element_failure(self, off, misplaced, err, ex, cand, allowance, expected, where) -> Mismatch:
        ratio = torch.where(off, (err.abs() / allowance).nan_to_num(posinf=math.inf), 0.0)
        if misplaced is not None:
            ratio = torch.where(misplaced, math.inf, ratio)
        worst = int(ratio.argmax())
        against = "the exact answer" if self.against_exact else "the reference's output"
        if misplaced is not None and bool(misplaced[worst]) and not math.isfinite(float(cand[worst])):
            what = "NaN or inf where neither the reference nor the exact answer has one"
        elif misplaced is not None and bool(misplaced[worst]):
            what = "off: finite where the reference and the exact answer hold NaN or inf"
        elif self.against_exact:
            what = (f"off {against} by more than {FACTOR:g} roundings of the value or {FACTOR:g}x the reference's error "
                    f"there, plus the problem's tolerance or {Z_ELEMENT:g} honest scales, whichever is tighter (allowed "
                    f"here {float(allowance[worst]):.3g}, off by {float(err[worst].abs()):.3g})")
        else:
            what = (f"off {against} by more than the problem's tolerance and {FACTOR:g} roundings of the value (allowed "
                    f"here {float(allowance[worst]):.3g}, off by {float(err[worst].abs()):.3g})")
        value = float(ex[worst])
        return Mismatch(f"{self.path} ({where})", f"{int(off.sum())} of {ex.numel()} elements {what}", int(off.sum()),
                        ex.numel(), float(err[worst].abs()), unravel(worst, real_shape(expected)),
                        float(err[worst].abs()) / max(abs(value), 1e-300), unravel(worst, real_shape(expected)), value,
                        float(cand[worst]), against="exact" if self.against_exact else "reference")

    def _pool(self, err, ref_err, ex, rounding, allowed, scale, wide_scale, sensitive, clusterings, subnormal,
              structural) -> None:
        self.num_tensors += 1
        self.numel += err.numel()
        for name, values in (("error", err), ("reference", ref_err), ("rounding", rounding / math.sqrt(3)),
                             ("tolerance", allowed), ("exact", ex)):
            self.squares[name] += float(values.square().sum())
        weights = torch.where(subnormal, 0.0, 1.0 / scale.clamp_min(1e-300).square())
        self.fit.add(ex, err, weights, clusterings)
        if self.against_exact:
            self.fit_reference.add(ex, ref_err, weights, clusterings)
        if bool(subnormal.any()):
            alike = subnormal.double() / self.subnormal["step"] ** 2  # fp64: 1 / step^2 is 2^298 for fp32's step
            self.fit_subnormal.add(ex, err, alike, clusterings)
            if self.against_exact:
                self.fit_subnormal_reference.add(ex, ref_err, alike, clusterings)
            self.subnormal["numel"] += int(subnormal.sum())
            self.subnormal["squares"] += float(ex[subnormal].square().sum())
        if sensitive and err.numel():
            wide = wide_scale.clamp_min(1e-300)
            # an element zero whatever the inputs comes out exact when honest: counted if far, never in the median or
            # the share's denominator (a mostly zero output would let its live elements carry the whole tensor's
            # share); where every element is, all of them
            informative = ~structural if bool((~structural).any()) else torch.ones_like(structural)
            self.far["judged"] += int(informative.sum())
            self.far["found"] += _beyond_median(err, rounding, wide, informative)
            self.far["reference"] += _beyond_median(ref_err, rounding, wide, informative)

    def rms(self, name: str) -> float:
        return math.sqrt(self.squares[name] / self.numel) if self.numel else 0.0

    @property
    def rms_ratio(self) -> float:
        scale = max(self.rms("reference"), self.rms("rounding"))
        return self.rms("error") / scale if scale > 0 else (0.0 if self.rms("error") == 0 else math.inf)

    def numbers(self) -> dict:
        """The pooled numbers, for ``details.accuracy``."""
        beta, alpha = self.fit.estimate()
        return {"case": self.case, "path": self.path, "tensors": self.num_tensors, "numel": self.numel,
                "against": "exact answer" if self.against_exact else "reference's output",
                "rms": self.rms("error"), "rms_reference": self.rms("reference"), "rms_rounding": self.rms("rounding"),
                "rms_ratio": self.rms_ratio, "bias": beta.value, "bias_se": beta.se, "offset": alpha.value,
                "offset_se": alpha.se, **{f"far_{key}": value for key, value in self.far.items()},
                **({"codes_off": self.codes["off"], "codes_judged": self.codes["judged"]} if self.codes["judged"] else {})}

    def verdict(self) -> Mismatch | None:
        """The first aggregate test (the module's docstring, test 2) this output fails, or None."""
        if not self.numel:
            return None
        for test in (self._rms_test, self._far_test, self._bias_test, self._subnormal_test, self._codes_test):
            reason = test()
            if reason is not None:
                where = f"{self.path} (case {self.case}, {self.num_tensors} tensors of all ranks and trials pooled)"
                return Mismatch(where, reason, numel=self.numel, against="exact" if self.against_exact else "reference")
        return None

    def _rms_test(self) -> str | None:
        scale = max(self.rms("reference"), self.rms("rounding"))
        share = TOLERANCE_SHARE * self.rms("tolerance")
        accumulation = ACCUMULATION_RMS * self.rms("accumulation")
        allowed = max(RMS_FACTOR * scale, share, accumulation)
        if self.rms("error") <= allowed:
            return None
        return (f"RMS error {self.rms('error'):.3g} is {self.rms_ratio:.3g}x the larger of the reference's "
                f"({self.rms('reference'):.3g}) and one rounding's ({self.rms('rounding'):.3g}) over {self.numel} "
                f"elements; at most {RMS_FACTOR:g}x passes (or a tenth of the tolerance's RMS, {share:.3g}"
                + (f", or {ACCUMULATION_RMS:g}x a long local sum's honest order, {accumulation:.3g}" if accumulation else "")
                + "): a noisier answer than any honest order gives")

    def _far_test(self) -> str | None:
        judged, found, reference = self.far["judged"], self.far["found"], self.far["reference"]
        allowed = max(FAR_REFERENCE_FACTOR * reference, FAR_SHARE * judged)
        if not judged or found <= _upper(allowed):
            return None
        return (f"{found} of {judged} elements ({found / judged:.3g}) are off by more than {FAR_FACTOR:g} times the "
                f"median error (in units of each element's own honest scale), where the reference has {reference} "
                f"({reference / judged:.3g}); at most {allowed / judged:.3g} passes: large errors on a few elements "
                "and small ones on the rest is lost, stale or corrupted data, not rounding, which is spread over every "
                "element")

    def _bias_test(self) -> str | None:
        u = float(torch.finfo(self.run_dtype).eps) / 2
        u_scalar = min(u, float(torch.finfo(torch.float32).eps) / 2)
        floor = max(FACTOR * u_scalar, BIAS_FLOOR * u * u)
        declared = (min(0.0, self.declared_bias), max(0.0, self.declared_bias))
        beyond = f" beyond the problem's declared bias (0 to {self.declared_bias:+.3g})" if self.declared_bias else ""
        return self._beyond(self.fit, self.fit_reference, (floor, floor * self.rms("exact")),
                            f"over {self.numel} elements", (f"{floor:.3g}{beyond}", f"{floor * self.rms('exact'):.3g}"),
                            "an honest rounding is as often above as below", declared)

    def _subnormal_test(self) -> str | None:
        numel, step = self.subnormal["numel"], self.subnormal["step"]
        if not numel:
            return None
        rms_x = math.sqrt(self.subnormal["squares"] / numel)
        steps = f"{SUBNORMAL_STEPS:g} step{'s' * (SUBNORMAL_STEPS != 1)}"
        return self._beyond(self.fit_subnormal, self.fit_subnormal_reference,
                            (SUBNORMAL_STEPS * step / max(rms_x, step), SUBNORMAL_STEPS * step),
                            f"on the {numel} values below the smallest normal (steps of {step:.3g})",
                            (f"{steps} over their RMS value", steps), "honest arithmetic there errs by less")

    def _beyond(self, fit: "Regression", fit_reference: "Regression", floors: tuple[float, float], over: str,
                floor_texts: tuple[str, str], why: str, declared: tuple[float, float] = (0.0, 0.0)) -> str | None:
        """Why the fit's multiplicative bias or additive offset is beyond ``BIAS_SIGMAS`` standard errors plus the larger
        of ``FACTOR`` x the reference's and its floor (``floors``: the bias's, the offset's), the bias measured from
        the range ``declared`` (the problem's Tolerance.bias and 0); None where both are within."""
        beta, alpha = fit.estimate()
        beta_ref, alpha_ref = fit_reference.estimate() if self.against_exact else (_Estimate(), _Estimate())
        for (name, unit), estimate, reference, floor, floor_text, (low, high) in zip(
                (("a multiplicative bias", "relative"), ("an additive offset", "absolute")),
                (beta, alpha), (beta_ref, alpha_ref), floors, floor_texts, (declared, (0.0, 0.0))):
            allowed = BIAS_SIGMAS * estimate.se + max(FACTOR * abs(reference.value), floor)
            if abs(estimate.value - min(max(estimate.value, low), high)) > allowed:
                return (f"{name}: {estimate.value:+.3g} ({unit}; the reference's {reference.value:+.3g}) {over}, "
                        f"{abs(estimate.value) / max(estimate.se, 1e-300):.3g} standard errors from zero (standard "
                        f"error {estimate.se:.3g}: the largest of the model's and the cluster-robust ones); at most "
                        f"{allowed:.3g} passes ({BIAS_SIGMAS:g} standard errors, and {FACTOR:g}x the reference's or "
                        f"{floor_text}): {why}")
        return None

    def _codes_test(self) -> str | None:
        judged, off = self.codes["judged"], self.codes["off"]
        if not judged or off <= _upper(OFF_SHARE * judged):
            return None
        return (f"{off} of {judged} quantised values ({off / judged:.3g}) differ from the reference's; at most "
                f"{OFF_SHARE:.3g} of them may: the recipe in another order moves a handful, a rounding or scale other "
                "than the recipe's (or noise) moves far more")


def _declared_bias(tolerance: Tolerance, path: str) -> float:
    """The problem's ``Tolerance.bias`` where it applies to the value at ``path`` (``bias_on`` names it, or a value
    inside it: ``input[0]`` covers ``input[0][3]``; empty: every value), else 0."""
    if not tolerance.bias:
        return 0.0
    named = not tolerance.bias_on or any(path == on or path.startswith(on + "[") for on in tolerance.bias_on)
    return tolerance.bias if named else 0.0


def _upper(expected: float) -> float:
    """An upper bound on a count whose honest expectation is at most ``expected`` (Poisson, about 4 sigma, and a few)."""
    return expected + 4.0 * math.sqrt(expected) + 3.0


def _beyond_median(err: torch.Tensor, rounding: torch.Tensor, scale: torch.Tensor, informative: torch.Tensor) -> int:
    """How many of ``err`` are far in ``scale`` (``s'``): ``|err| / scale`` beyond FAR_FACTOR times its median over the
    ``informative`` elements, or times a quarter of a rounding in that scale where that is larger (where more than half
    the elements come out exact, the median is no scale). An element zero whatever the inputs (a gradient's row no
    token touched, ReLU's negative side) errs by nothing when honest: it is counted, never part of the median, which
    it would drag to zero."""
    z = (err / scale).abs()
    median = float(z[informative].median()) if bool(informative.any()) else 0.0
    return int((z > FAR_FACTOR * torch.clamp(FAR_LEAST * rounding / scale, min=median)).sum())


# -- the bias and offset fit ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Estimate:
    value: float = 0.0
    se: float = 0.0


@dataclass
class Regression:
    """The weighted least-squares fit ``e ~ alpha + beta x`` over many tensors, with the model's and cluster-robust
    standard errors (``add`` one tensor and its clusterings; ``estimate`` the pooled fit).

    With ``X = [1, x]``, per cluster ``b`` of a clustering ``S_b = sum w X X^T`` and ``g_b = sum w X e``; the fit is
    ``theta = S^-1 g`` (sums over everything), and a clustering's meat is ``sum_b (g_b - S_b theta)(g_b - S_b
    theta)^T``, a quadratic in ``theta``: per tensor and clustering, ``sum g_b g_b^T``, ``sum g_b (x) S_b`` and ``sum
    S_b (x) S_b`` are all it keeps (28 numbers, however many clusters), so that a row of a million clusters costs no
    memory once added."""

    S: torch.Tensor = field(default_factory=lambda: torch.zeros(2, 2, dtype=torch.float64))
    g: torch.Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.float64))
    tensors: list = field(default_factory=list)  # per tensor: [(count, GG [2,2], GS [2,2,2], SS [2,2,2,2]) per clustering]

    def add(self, x: torch.Tensor, e: torch.Tensor, w: torch.Tensor, clusterings: list[torch.Tensor]) -> None:
        if not x.numel():
            return
        X = torch.stack([torch.ones_like(x), x], dim=1)
        wXX = w[:, None, None] * X[:, :, None] * X[:, None, :]
        wXe = (w * e)[:, None] * X
        self.S += wXX.sum(0)
        self.g += wXe.sum(0)
        per_clustering = []
        for cluster in clusterings:
            count = int(cluster.max()) + 1
            S_b = torch.zeros(count, 2, 2, dtype=torch.float64).index_add_(0, cluster, wXX)
            g_b = torch.zeros(count, 2, dtype=torch.float64).index_add_(0, cluster, wXe)
            per_clustering.append((count, torch.einsum("bi,bj->ij", g_b, g_b), torch.einsum("bi,bjk->ijk", g_b, S_b),
                                   torch.einsum("bij,bkl->ijkl", S_b, S_b)))
        self.tensors.append(per_clustering)

    def estimate(self) -> tuple[_Estimate, _Estimate]:
        """(beta, alpha): the pooled fit and each one's standard error, the largest of the model's (``S^-1``: every
        element off by its own scale, independently) and, per tensor, its clustering's that gives the largest."""
        if not self.tensors:
            return _Estimate(), _Estimate()
        bread = torch.linalg.pinv(self.S)
        theta = bread @ self.g
        meat = torch.zeros(2, 2, dtype=torch.float64)
        for clusterings in self.tensors:
            found = []
            for count, GG, GS, SS in clusterings:
                St = torch.einsum("ijk,k->ij", GS, theta)  # sum_b g_b (S_b theta)^T
                scores = GG - St - St.T + torch.einsum("ijkl,j,l->ik", SS, theta, theta)
                found.append(scores * (count / (count - 1) if count > 1 else 1.0))
            meat += max(found, key=lambda m: float(torch.diagonal(bread @ m @ bread).sum()))
        robust = torch.diagonal(bread @ meat @ bread)
        model = torch.diagonal(bread)
        variance = torch.maximum(robust, model).clamp_min(0.0)
        return (_Estimate(float(theta[1]), math.sqrt(float(variance[1]))),
                _Estimate(float(theta[0]), math.sqrt(float(variance[0]))))


def _reference_mean_square(ref_err: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """For each element, the mean of the reference's squared error over the elements of this tensor in its binade
    (``floor(log2 |x|)``, exact zeros apart) where that binade holds at least ``MIN_REFERENCE_ELEMENTS``, else 0:
    elements of one size share one honest scale for the reference's intermediate roundings, learnt from neither larger
    nor smaller values, nor from a handful (an element's own error is a single draw)."""
    if not ref_err.numel():
        return ref_err
    exponent = torch.frexp(magnitude).exponent.long()  # |x| = m 2^exponent, m in [0.5, 1): the binade, exactly
    binade = torch.where(magnitude > 0, exponent, _ZEROS_BINADE)
    binade = torch.where(torch.isfinite(magnitude), binade, _NOT_FINITE_BINADE)
    where = binade - _ZEROS_BINADE  # no sort: a count per binade
    counts = torch.bincount(where)
    sums = torch.zeros(counts.numel(), dtype=ref_err.dtype).index_add_(0, where, ref_err.square())
    means = torch.where(counts >= MIN_REFERENCE_ELEMENTS, sums / counts.clamp_min(1), 0.0)
    return means[where]


_ZEROS_BINADE, _NOT_FINITE_BINADE = -1100, 1100  # beyond fp64's exponents (-1073 to 1024): exact zeros, inf and NaN


def _clusterings(shape: tuple[int, ...], kept: torch.Tensor) -> list[torch.Tensor]:
    """For the kept elements of a tensor of ``shape`` (flat mask ``kept``): their cluster index under each clustering,
    one per axis of at least MIN_CLUSTER_INDICES indices (each index of it a cluster: the hyperplane of a row), and
    where no axis but one has that many, each element (and, from MIN_CLUSTER_INDICES runs on, runs of RUN elements) of
    it flat; a tensor of fewer elements is one cluster."""
    numel = math.prod(shape) if shape else 1
    flat = torch.arange(numel)[kept] if kept.numel() == numel else torch.arange(int(kept.sum()))
    found = []
    stride = numel
    for size in shape:
        stride //= max(size, 1)
        if size >= MIN_CLUSTER_INDICES and size < numel:
            found.append((flat // max(stride, 1)) % size)
    if not found and numel >= MIN_CLUSTER_INDICES:
        found.append(flat)
        if numel >= MIN_CLUSTER_INDICES * RUN:
            found.append(flat // RUN)
    return found or [torch.zeros_like(flat)]


# -- helpers -----------------------------------------------------------------------------------------------------


def bit_equal(expected: torch.Tensor, got: torch.Tensor) -> bool:
    """Whether two tensors of one shape and dtype hold the same values, NaN where NaN (a dtype without arithmetic:
    the same bytes); tensors of other shapes or dtypes never do."""
    if expected.shape != got.shape or expected.dtype != got.dtype:  # torch.equal would promote: 2^53 + 1 == 2.0^53
        return False
    try:
        if torch.equal(expected, got):
            return True
        if not (expected.is_floating_point() or expected.is_complex()):
            return False
        if expected.is_complex():  # a complex number's parts one by one
            expected, got = torch.view_as_real(expected.resolve_conj()), torch.view_as_real(got.resolve_conj())
        # in the tensors' own dtype: no fp64 copy of a large output (a replica's inputs differ on every rank)
        return bool(((expected == got) | (torch.isnan(expected) & torch.isnan(got))).all())
    except (RuntimeError, TypeError):
        return _bytes(expected) == _bytes(got)


def _exactly(expected: torch.Tensor, got: torch.Tensor, path: str, why: str) -> Mismatch | None:
    """Exact equality of every element (NaN where NaN); a dtype without arithmetic compared by its bytes."""
    if bit_equal(expected, got):
        return None
    try:
        e, g = expected.reshape(-1), got.reshape(-1)
        differ = (e != g) & ~(torch.isnan(e) & torch.isnan(g)) if e.is_floating_point() or e.is_complex() else e != g
        num_bad = int(differ.sum())
        first = int(differ.nonzero()[0]) if num_bad else 0
        at_first = unravel(first, expected.shape)
        shown = float(e[first].real if e.is_complex() else e[first]), float(g[first].real if g.is_complex() else g[first])
    except (RuntimeError, TypeError):
        return Mismatch(path, f"values differ ({why}; a {expected.dtype} tensor compared by its bytes)", 1,
                        expected.numel())
    return Mismatch(path, f"{num_bad} of {expected.numel()} elements off ({why})", num_bad, expected.numel(),
                    abs(shown[1] - shown[0]), at_first, 0.0, at_first, *shown)


def _equal_objects(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) or (isinstance(a, float) and math.isnan(a) and math.isnan(b))
    except Exception:  # noqa: BLE001 - a value whose comparison raises is not equal
        return False


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""


def _flat64(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor.resolve_conj())
    return tensor.reshape(-1).to(torch.float64)


def _component_dtype(dtype: torch.dtype) -> torch.dtype:
    return {torch.complex64: torch.float32, torch.complex128: torch.float64, torch.complex32: torch.float16}.get(dtype, dtype)


def _coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if torch.finfo(a).eps >= torch.finfo(b).eps else b


def _half_ulp(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of ``dtype``'s numbers at each of ``magnitude`` (finite fp64 values >= 0): the most that
    rounding to ``dtype`` costs there. Read from the fp64 exponent bits: 2^(floor(log2 |x|) - p), p the
    significand's bits, constant below ``dtype``'s smallest normal number."""
    info = torch.finfo(dtype)
    digits = 1 - round(math.log2(info.eps))  # significand bits, the implicit one included
    smallest = round(math.log2(info.tiny))  # the exponent of the smallest normal number
    exponent = ((magnitude.view(torch.int64) >> 52) & 0x7FF) - 1023
    biased = (exponent.clamp_min(smallest) - digits + 1023).clamp_min(1)
    return (biased << 52).view(torch.float64)


def _same_special(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where ``a`` is NaN or infinite and ``b`` is the same (NaN and NaN, or the same infinity)."""
    return (torch.isnan(a) & torch.isnan(b)) | (torch.isinf(a) & (a == b))
