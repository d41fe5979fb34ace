"""pkb's accuracy rule: a candidate's floating outputs judged against the exact answer, not against the reference's.

The exact answer is the reference run again on the same inputs raised to a higher precision (``Problem.exact_dtype``,
fp64 unless the problem says why not: ``pkb.problem.raised``). With ``e`` the candidate's error against it, ``e_ref``
the reference's own error, ``h`` half an ulp of the exact value in the tensor's dtype (what rounding it once costs)
and ``T`` the problem's tolerance at the exact value, a tensor passes when

- element-wise, every ``|e_i| <= max(T_i, FACTOR * max|e_ref|, FACTOR * h_i)``: one element off by more than both the
  problem's tolerance and three times the reference's largest error fails (a lost or stale element);
- in aggregate (tensors of ``MIN_AGGREGATE`` elements or more), ``rms(e) <= max(FACTOR * max(rms(e_ref), rms(h') /
  sqrt 3), TOLERANCE_SHARE * rms(T))`` (the RMS error of one rounding; a tenth of the tolerance) and the systematic
  part of the error, ``beta = <e, x> / <x, x>`` (x the exact values: the relative bias), ``|beta| <= max(FACTOR *
  |beta_ref|, u', TOLERANCE_SHARE * rtol, BIAS_SIGMAS * its noise)``: a biased, compressed or noisier answer fails
  even where each element stays inside the tolerance. ``h'`` and ``u'`` (the unit roundoff) are those of the coarser
  of the tensor's dtype and the run's precision: an fp32 output of a bf16 run may carry the run's rounding in
  aggregate, while its element-wise tolerance still binds.

So an answer at least as accurate as the reference's passes (its errors are no larger anywhere), and so does one that
rounds the exact answer once (``|e_i| <= h_i``); an answer several times worse than the reference's does not. NaN and
infinity must sit where the reference's or the correctly rounded exact answer's do. Integer and bool values never get
here (exact), nor do outputs the problem compares bit for bit (``Tolerance.exact()``: data movement). Where the exact
answer is the reference's own bit for bit (a reference that computes in a fixed dtype whatever its inputs) or was not
computed (a case too large to raise), it says nothing of the reference's error: the tolerance against the
reference's output decides, as for a problem without an exact answer (``Problem.exact_dtype`` None).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from pkb.problem import Tolerance

FACTOR = 3.0  # how much worse than the reference's error (or one rounding) an error may be
MIN_AGGREGATE = 256  # fewer elements: the RMS and the bias of the error cannot be told from noise
BIAS_SIGMAS = 6.0  # a bias within this many standard errors of zero is noise
# An aggregate error (RMS, bias) of up to this share of the problem's element-wise tolerance always passes: where the
# reference's own error is tiny (fp32 runs), honest algorithms of another kind differ from it by more than FACTOR
# (on one CPU, upstream's chunked fp32 Kimi delta attention had 11x the RMS error of pkb's sequential reference, at
# 2e-9 on values near 3e-3), but never on average by a tenth of what the tolerance allows each element.
TOLERANCE_SHARE = 0.1


@dataclass(frozen=True)
class Accuracy:
    """The numbers behind one tensor's judgement (errors against the exact answer, in its units)."""

    path: str
    numel: int
    rms: float  # the candidate's RMS error
    rms_reference: float  # the reference's RMS error
    rms_rounding: float  # the RMS error of rounding the exact answer once (in the coarser dtype)
    max_abs: float  # the candidate's largest error
    max_reference: float  # the reference's largest error
    bias: float  # the candidate's relative systematic error (beta)
    bias_reference: float

    @property
    def rms_ratio(self) -> float:
        """The candidate's RMS error over the larger of the reference's and one rounding's (1.0: as accurate)."""
        scale = max(self.rms_reference, self.rms_rounding)
        return self.rms / scale if scale > 0 else (0.0 if self.rms == 0 else math.inf)

    def to_dict(self) -> dict:
        return {**asdict(self), "rms_ratio": self.rms_ratio}


UNAVAILABLE = object()  # the exact answer of a case too large to raise (pkb.runtime.worker.EXACT_MAX_BYTES)


class ExactAnswer:
    """The exact answer at one place of a rank's reply (outputs or inputs after the call), fetched only when a value
    there is not the reference's bit for bit: ``fetch`` runs the reference again in the higher precision (for every
    rank at once, kept for the session), or gives ``UNAVAILABLE`` where the case is too large to raise (the tolerance
    against the reference then decides). ``record`` collects the numbers of every tensor judged (``Accuracy``)."""

    def __init__(self, fetch: Callable[[], Any], run_dtype: torch.dtype, record: list[Accuracy], where: str = ""):
        self._fetch = fetch
        self._fetched = False
        self._value = None
        self.run_dtype = run_dtype
        self.record = record
        self.where = where  # e.g. "rank 0, case odd, trial 1": what the record's paths are prefixed with

    def value(self) -> Any:
        if not self._fetched:
            self._value, self._fetched = self._fetch(), True
        return self._value

    def child(self, key: int | str) -> "ExactAnswer":
        """The exact answer at ``[key]`` below this place."""
        return ExactAnswer(lambda: _item(self.value(), key), self.run_dtype, self.record, self.where)

    def judge(self, expected: torch.Tensor, got: torch.Tensor, tolerance: Tolerance, path: str):
        """A Mismatch where ``got`` (the reference's shape and dtype, checked) fails the accuracy rule, or None."""
        from pkb.evaluate.compare import Mismatch, compare_tensors

        exact = self.value()
        if exact is not UNAVAILABLE:
            if isinstance(exact, (int, float)):
                exact = torch.tensor([float(exact)], dtype=torch.float64)
            if not isinstance(exact, torch.Tensor) or exact.numel() != expected.numel():
                raise RuntimeError(f"{path}: the exact answer has another structure than the reference's "
                                   f"({type(exact).__name__}); a problem whose reference cannot run in its "
                                   "exact_dtype must say so (Problem.exact_dtype)")
        # too large to raise, or no more precise than the reference's own answer (its reference computes in a fixed
        # dtype, e.g. fp32 outputs of fp32 arithmetic, and says nothing of its error): the tolerance decides
        if exact is UNAVAILABLE or torch.equal(_flat64(exact), _flat64(expected)):
            return compare_tensors(expected, got, tolerance, path)
        verdict, accuracy = judge(expected, got, exact, tolerance, self.run_dtype,
                                  f"{self.where}: {path}" if self.where else path)
        self.record.append(accuracy)
        if verdict is None:
            return None
        return Mismatch(path, verdict.reason, verdict.num_bad, expected.numel(), verdict.max_abs, verdict.at,
                        verdict.max_rel, verdict.at, verdict.expected, verdict.got, tolerance.atol, tolerance.rtol,
                        against="exact")


def _item(value: Any, key: int | str) -> Any:
    if value is UNAVAILABLE:
        return value
    if isinstance(value, dict) and value.get("__sampled__"):
        return value["values"] if key == "values" else value[key]
    return value[key]


@dataclass(frozen=True)
class Failure:
    reason: str
    num_bad: int
    max_abs: float
    max_rel: float
    at: tuple[int, ...]
    expected: float
    got: float


def judge(expected: torch.Tensor, got: torch.Tensor, exact: torch.Tensor, tolerance: Tolerance,
          run_dtype: torch.dtype, path: str) -> tuple[Failure | None, Accuracy]:
    """pkb's rule (the module's docstring) for one tensor: the reference's output ``expected``, the candidate's ``got``
    (same shape and dtype) and the exact answer ``exact`` (same number of elements, any floating dtype)."""
    dtype = _component_dtype(expected.dtype)
    ref, cand, ex = (_flat64(t) for t in (expected, got, exact))
    if bool(torch.isfinite(cand).all()) and bool(torch.isfinite(ref).all()) and bool(torch.isfinite(ex).all()):
        judged = reference_judged = misplaced = None  # the common case: no NaN or inf anywhere, no masks
        err, ref_err = cand - ex, ref - ex
    else:
        rounded = ex.to(dtype).double()
        cand_fin, ref_fin, ex_fin = torch.isfinite(cand), torch.isfinite(ref), torch.isfinite(ex)
        special_ok = _same_special(cand, ref) | _same_special(cand, rounded)
        misplaced = (~cand_fin & ~special_ok) | (cand_fin & ~ref_fin & ~torch.isfinite(rounded))
        judged, reference_judged = cand_fin & ex_fin, ref_fin & ex_fin
        ex = torch.where(ex_fin, ex, torch.zeros_like(ex))
        err = torch.where(judged, cand - ex, torch.zeros_like(ex))
        ref_err = torch.where(reference_judged, ref - ex, torch.zeros_like(ex))
    magnitude = ex.abs()
    half_ulp = _half_ulp(magnitude, dtype)
    max_reference = float(ref_err.abs().max()) if ref_err.numel() else 0.0
    allowance = torch.maximum(tolerance.atol + tolerance.rtol * magnitude, FACTOR * half_ulp.clamp_min(max_reference))
    off = err.abs() > allowance
    coarse = _coarser(dtype, run_dtype)
    rounding = half_ulp if coarse == dtype else _half_ulp(magnitude, coarse)
    chosen = (lambda values: values) if judged is None else (lambda values: values[judged])  # noqa: E731
    accuracy = Accuracy(path, int(ex.numel() if judged is None else judged.sum()), _rms(chosen(err)),
                        _rms(ref_err if reference_judged is None else ref_err[reference_judged]),
                        _rms(chosen(rounding)) / math.sqrt(3), float(err.abs().max()) if err.numel() else 0.0,
                        max_reference, _bias(chosen(err), chosen(ex)),
                        _bias(ref_err, ex) if reference_judged is None else _bias(ref_err[reference_judged],
                                                                                    ex[reference_judged]))
    num_bad = int(off.sum()) + (int(misplaced.sum()) if misplaced is not None else 0)
    if num_bad:
        ratio = (err.abs() / allowance).nan_to_num()
        if misplaced is not None:
            ratio = torch.where(misplaced, torch.full_like(ratio, math.inf), ratio)
        worst = int(ratio.argmax())
        what = ("NaN or inf where neither the reference nor the exact answer has one"
                if misplaced is not None and bool(misplaced[worst])
                else f"off by more than the problem's tolerance and {FACTOR:g}x the reference's largest error "
                     f"({max_reference:.3g}; allowed here {float(allowance[worst]):.3g})")
        return _failure(f"{num_bad} of {expected.numel()} elements {what}", num_bad, err, ex, cand, worst,
                        _real_shape(expected)), accuracy
    if accuracy.numel < MIN_AGGREGATE:
        return None, accuracy
    worst = int(err.abs().argmax())
    noise = _rms(chosen(err) - accuracy.bias * chosen(ex)) / max(_rms(chosen(ex)), 1e-300) / math.sqrt(accuracy.numel)
    unit = float(torch.finfo(coarse).eps) / 2
    allowed = max(FACTOR * abs(accuracy.bias_reference), unit, TOLERANCE_SHARE * tolerance.rtol, BIAS_SIGMAS * noise)
    if abs(accuracy.bias) > allowed:
        return _failure(f"a systematic error: the answer is {accuracy.bias:+.3%} off the exact one on average over "
                        f"{accuracy.numel} elements (the reference {accuracy.bias_reference:+.3%}; at most {allowed:.3%} "
                        f"passes: {FACTOR:g}x the reference's, one unit roundoff of {str(coarse)[6:]}, a tenth of the "
                        f"tolerance's rtol, or {BIAS_SIGMAS:g} standard errors)", 0, err, ex, cand, worst,
                        _real_shape(expected)), accuracy
    scale = max(accuracy.rms_reference, accuracy.rms_rounding)
    share = TOLERANCE_SHARE * _rms(chosen(tolerance.atol + tolerance.rtol * magnitude))
    if accuracy.rms > max(FACTOR * scale, share):
        return _failure(f"RMS error {accuracy.rms:.3g} is {accuracy.rms_ratio:.2f}x the reference's "
                        f"({accuracy.rms_reference:.3g}; one rounding {accuracy.rms_rounding:.3g}) over {accuracy.numel} "
                        f"elements; at most {FACTOR:g}x passes (or a tenth of the tolerance, {share:.3g})", 0, err, ex,
                        cand, worst, _real_shape(expected)), accuracy
    return None, accuracy


def _failure(reason: str, num_bad: int, err: torch.Tensor, ex: torch.Tensor, cand: torch.Tensor, worst: int,
             shape: tuple[int, ...]) -> Failure:
    from pkb.evaluate.compare import _unravel

    value = float(ex[worst])
    return Failure(reason, num_bad, float(err[worst].abs()), float(err[worst].abs()) / max(abs(value), 1e-300),
                   _unravel(worst, shape), value, float(cand[worst]))


def _flat64(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor.resolve_conj())
    return tensor.reshape(-1).to(torch.float64)


def _component_dtype(dtype: torch.dtype) -> torch.dtype:
    return {torch.complex64: torch.float32, torch.complex128: torch.float64}.get(dtype, dtype)


def _real_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return (*tensor.shape, 2) if tensor.is_complex() else tuple(tensor.shape)


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


def _rms(values: torch.Tensor) -> float:
    return float(values.pow(2).mean().sqrt()) if values.numel() else 0.0


def _bias(err: torch.Tensor, exact: torch.Tensor) -> float:
    """The relative systematic part of ``err``: the beta of ``err ~ beta * exact`` (least squares)."""
    norm = float(exact.pow(2).sum())
    return float((err * exact).sum()) / norm if norm > 0 else 0.0
