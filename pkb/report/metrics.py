"""The numbers a report shows, per group (solution set, model) and per category, on both protocols, in one place.

Two protocols judge every sample (``PROTOCOLS``): ``paper``, correct when it was ok on the upstream cases
alone (the benchmark's own inputs, as ParallelKernelBench's paper judged), and ``pkb``, correct when its
verdict is ``ok`` on every case pkb checked. Every metric exists on both (``Report.paper``,
``Report.overall``).

- ``pass@k``: the unbiased estimator of Chen et al. 2021, ``1 - C(n-c, k) / C(n, k)`` for a problem with
  ``n`` samples of which ``c`` are correct, averaged over the problems of the selection. It is given for
  the k that every attempted problem has at least k samples for (the estimator needs ``n >= k``).
- ``fast_p@k``: the same estimator where a sample counts when it is correct *and* its speedup over the
  reference is above ``p``, for p in ``FAST_P_THRESHOLDS`` (the paper's fast_1, fast_1.5, fast_2 among
  them). ``fast_1@3`` is the paper's fast1@3: the chance that of 3 samples of a problem at least one is
  correct and faster than the reference. ``fast_0`` is correctness (every measured speedup is above 0,
  and a correct sample without timings counts too); for p > 0 a sample needs a speedup timed on GPUs.
- ``geomean_speedup``: the geometric mean of the speedups of correct samples that were timed on GPUs.
- ``roofline``: the distribution of % of roofline over correct samples timed on GPUs: quantiles and a
  histogram in 10 % bins (and a bin for over 100 %, a sign of a hardware profile that is too slow).
- ``off_gpu`` (``OffGpuTimings``): the speedups of correct samples timed in ``cpu`` or ``shared-gpu`` mode, apart.

Speed counts only where it means something: fast_p, the geomean and the roofline read only timings taken on GPUs
in ``cuda`` mode (``gpu_speedup``). A cpu or shared-gpu timing (not GPU performance: the ranks share cores or one
GPU) never enters them; reports show it only when asked for (``pkb report --off-gpu-timings``), labelled, in a
column of its own. A group with no GPU timing has no fast_p for p > 0 (``Metrics.fast``: None, shown ``-``).
- ``moves_data_itself``: the share of correct samples that call no stock collective
  (``collectives_used`` empty).
- ``verdicts``: every verdict's count (on the protocol); ``failures`` are those other than ``ok``,
  ``harness_error``, ``infra_error`` and a ``skipped`` the run caused (a ``skipped`` the candidate caused is one:
  ``num_candidate_skips``).
- ``paper_gaps`` (``PaperGap``): the other direction: of a group's samples ok by pkb's verdict, how many fail the
  paper's, and why (``PAPER_ONLY_REASONS``: e.g. more accurate than the reference, yet outside upstream's allclose).
- ``strict_gaps`` (``StrictGap``): of a group's samples correct on the paper's protocol, how many fail
  pkb's stricter cases, and why: the tags of the case they failed (pkb.problem.CASE_TAGS, each tests
  case's), or one of ``STRICT_ONLY_REASONS`` where no tagged case decided it.
- ``sandbox`` (``Report.sandbox``, ``SandboxTally``): of a group's results with a verdict, how many
  candidates ran without the full sandbox: with ``--sandbox off``, with some protection missing on their
  machine (partial), or with no record of it (rows from a pkb before the sandbox). Protocol-independent.

Two views of the problems (``VIEWS``): ``suite``, over the whole selection, where a problem with no result
for a group counts as failed (0 in pass@k and fast_p: the paper's denominator, and the one a model's
folder is ranked on), and ``covered``, over the problems the group has a result for (``Coverage``): what
a set that covers only part of the selection (pkb's shipped worked examples, a folder missing files)
achieves on its part. The two are the same for a set that covers the whole selection. Every metric exists
on both (``Report.on(protocol, view)``). The paper's protocol counts only the problems the paper has: pkb's
own (beyond upstream, no upstream case) are outside its denominator in both views.

How results count: a problem of the selection with no result for a group counts as failed on the suite
view. A ``skipped`` sample is counted by who caused it (``skipped_by_candidate``, from ``Details.skipped_by``): one the
*candidate* caused (its code or declaration needs a GPU or NVSHMEM the run lacks, or it failed while the GPU the
ranks share was full) is in ``n`` and not passed, as any failure (``num_candidate_skips``; reports say to run it with
``--mode cuda``). One the *run* caused (the problem does not run at this world size, dtype or node count, or its
cases are left out in this mode: every candidate of the problem alike), a ``harness_error`` (pkb's own failure, no
verdict on the candidate), an ``infra_error`` (the machine under it failed) and, on the paper's protocol, a sample
whose upstream verdict is unknown (``num_unknown``) are neither a pass nor a failure: they are left out of ``n``, and
a problem with no other sample leaves the denominator (``num_skipped_problems``). No status a candidate can cause is
better for it than failing. Reference self-checks never count; ``SelfCheck`` summarises them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Iterable

from pkb.options import Status
from pkb.report.records import (PROTOCOLS, SANDBOX_GAPS, Record, registry_case_tags, registry_upstream_cases,
                                sandbox_gap)

FAST_P_THRESHOLDS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0)
VIEWS = ("covered", "suite")  # the problems a group has a result for; the whole selection (the paper's)
DEFAULT_KS = (1, 5, 10, 100)
QUANTILES = {"p10": 0.1, "p25": 0.25, "median": 0.5, "p75": 0.75, "p90": 0.9}
ROOFLINE_BIN_EDGES = tuple(i / 10 for i in range(11))  # 0, 0.1, ..., 1.0, then one bin above 100 %
NOT_FAILURES = (Status.OK, Status.SKIPPED, Status.HARNESS_ERROR, Status.INFRA_ERROR)  # skipped: where the run caused it
NO_VERDICT = (Status.HARNESS_ERROR, Status.INFRA_ERROR)  # pkb or its machine failed: never in n
# A skip's message in a row from before ``Details.skipped_by``, where the candidate caused it (pkb.evaluate.failures,
# pkb.evaluate.candidate.Candidate.missing_in): its code or declaration needs what the run lacks, or a full shared GPU.
_CANDIDATE_SKIP_MESSAGES = ("the candidate ", "GPU the ranks share was full")


def skipped_by_candidate(record: Record, protocol: str = "pkb") -> bool:
    """Whether ``record``'s verdict on ``protocol`` is a ``skipped`` its candidate caused (counted as not passed), not
    one its run caused (left out of ``n``): ``details.skipped_by`` where the row has it, else, for an older row, its
    message (pkb wrote it, never the candidate). A ``skipped`` on the paper's protocol alone (an upstream trial's
    failure, while pkb's verdict is another) is the candidate's: the run's skips come before any trial."""
    result = record.result
    if record.verdict(protocol) is not Status.SKIPPED:
        return False
    if result.status is not Status.SKIPPED:
        return True
    if result.details.skipped_by is not None:
        return result.details.skipped_by != "run"
    message = result.message or ""
    return message.startswith(_CANDIDATE_SKIP_MESSAGES[0]) or _CANDIDATE_SKIP_MESSAGES[1] in message


# What a skip the candidate caused says it needs, from pkb's message (pkb.evaluate.failures, Candidate.missing_in).
CANDIDATE_SKIP_NEEDS = {"nvshmem": "need NVSHMEM", "gpu_memory": "failed while the GPU the ranks share was full",
                        "gpu": "need a GPU"}


def candidate_skip_need(record: Record) -> str:
    """What a skip the candidate caused (``skipped_by_candidate``) says it needs: a ``CANDIDATE_SKIP_NEEDS`` key."""
    message = record.result.message or ""
    if "NVSHMEM" in message or "REQUIRES nvshmem" in message:
        return "nvshmem"
    return "gpu_memory" if _CANDIDATE_SKIP_MESSAGES[1] in message else "gpu"


def counted(record: Record, protocol: str = "pkb") -> bool:
    """Whether ``record`` is in pass@k's ``n`` on ``protocol``: every verdict but an unknown one, pkb's or the
    machine's failure and a ``skipped`` the run caused."""
    verdict = record.verdict(protocol)
    if verdict is None or verdict in NO_VERDICT:
        return False
    return verdict is not Status.SKIPPED or skipped_by_candidate(record, protocol)


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k for one problem: ``1 - C(n-c, k) / C(n, k)``; e.g. ``pass_at_k(2, 1, 1) == 0.5``."""
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"need 0 <= correct <= samples, got {num_correct} of {num_samples}")
    if k < 1 or k > num_samples:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples, got n={num_samples}")
    return float(1 - Fraction(math.comb(num_samples - num_correct, k), math.comb(num_samples, k)))


@dataclass(frozen=True)
class ProblemTally:
    """One group's samples of one problem on one protocol: ``num_samples`` are those in n (``counted``: not a skip
    the run caused, not a harness error, not unknown; a skip the candidate caused is in, not passed)."""

    problem: str
    num_samples: int
    num_correct: int
    num_skipped: int  # skipped by the run, a harness error or (paper) unknown: left out of num_samples
    num_fast: tuple[int, ...]  # per FAST_P_THRESHOLDS: correct and speedup > p
    num_unknown: int = 0
    num_candidate_skips: int = 0  # skipped by what the candidate needs or did: in num_samples, not passed


def tally(problem: str, records: Iterable[Record], protocol: str = "pkb") -> ProblemTally:
    verdicts = [(r, r.verdict(protocol)) for r in records]
    unknown = sum(1 for _, verdict in verdicts if verdict is None)
    in_n = [(r, v) for r, v in verdicts if counted(r, protocol)]
    correct = [r for r, verdict in in_n if verdict is Status.OK]
    fast = tuple(sum(1 for r in correct if _is_fast(r, p)) for p in FAST_P_THRESHOLDS)
    return ProblemTally(problem, len(in_n), len(correct), len(verdicts) - len(in_n), fast, unknown,
                        sum(1 for _, v in in_n if v is Status.SKIPPED))


def _is_fast(record: Record, p: float) -> bool:
    speedup = gpu_speedup(record)
    if speedup is None:
        return p == 0.0
    return speedup > p


def gpu_speedup(record: Record) -> float | None:
    """``record``'s speedup where it was timed on GPUs in ``cuda`` mode, else None (untimed, or timed in ``cpu`` or
    ``shared-gpu`` mode: not GPU performance, ``off_gpu_speedup``'s)."""
    result = record.result
    return result.speedup if result.mode == "cuda" and result.times_are_gpu_performance else None


def off_gpu_speedup(record: Record) -> float | None:
    """``record``'s speedup where it was timed off the GPUs (``cpu`` or ``shared-gpu`` mode), else None."""
    return record.result.speedup if gpu_speedup(record) is None else None


@dataclass(frozen=True)
class OffGpuTimings:
    """The speedups of a group's correct samples timed in ``cpu`` or ``shared-gpu`` mode: never in fast_p, the
    geomean or the roofline; a report shows them apart, labelled, when asked for (``--off-gpu-timings``)."""

    num_timed: int
    geomean_speedup: float | None
    modes: tuple[str, ...]  # the modes they were timed in, e.g. ("cpu",)

    def text(self) -> str:
        """e.g. ``1.12x (cpu, 3 samples)``, or ``-`` where none was timed off the GPUs."""
        if not self.num_timed:
            return "-"
        return f"{self.geomean_speedup:.2f}x ({', '.join(self.modes)}, {self.num_timed} " \
               f"sample{'s' * (self.num_timed != 1)})"


def off_gpu_timings(correct: list[Record]) -> OffGpuTimings:
    timed = [(r, off_gpu_speedup(r)) for r in correct]
    timed = [(r, s) for r, s in timed if s is not None and s > 0]
    return OffGpuTimings(len(timed), _geomean([s for _, s in timed]), tuple(sorted({r.result.mode for r, _ in timed})))


def _geomean(values: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


@dataclass(frozen=True)
class RooflineSummary:
    count: int
    quantiles: dict[str, float] = field(default_factory=dict)  # fractions of roofline (0.5 = 50 %)
    histogram: tuple[tuple[str, int], ...] = ()  # ("0-10%", count), ..., (">100%", count)


def roofline_summary(fractions: list[float]) -> RooflineSummary:
    labels = [f"{int(lo * 100)}-{int(hi * 100)}%" for lo, hi in zip(ROOFLINE_BIN_EDGES, ROOFLINE_BIN_EDGES[1:])]
    counts = [0] * (len(labels) + 1)
    for value in fractions:
        index = min(int(value * 10), len(labels) - 1) if value <= 1.0 else len(labels)
        counts[max(index, 0)] += 1
    histogram = tuple(zip(labels + [">100%"], counts))
    if not fractions:
        return RooflineSummary(0, {}, histogram)
    ordered = sorted(fractions)
    return RooflineSummary(len(ordered), {name: _quantile(ordered, q) for name, q in QUANTILES.items()}, histogram)


def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Metrics:
    """Every metric of one group over one set of problems (the selection, or one category of it), on one protocol."""

    num_problems: int  # in the selection
    num_attempted: int  # with at least one sample that has a verdict
    num_skipped_problems: int  # every sample skipped, a harness error or (paper) unknown: left out of the denominator
    num_samples: int  # samples counted (with a verdict)
    pass_at_k: dict[int, float]
    fast_p: dict[int, dict[float, float]]  # k -> p -> fast_p@k
    geomean_speedup: float | None
    num_timed: int  # correct samples with a speedup (the geomean's count)
    roofline: RooflineSummary
    moves_data_itself: float | None  # share of correct samples with no stock collective
    verdicts: dict[str, int]
    protocol: str = "pkb"
    num_unknown: int = 0  # samples whose verdict on this protocol is unknown (paper: upstream cases not checked)
    timed: bool = False  # some counted sample has a speedup timed on GPUs (else fast_p for p > 0 says nothing)
    off_gpu: OffGpuTimings = OffGpuTimings(0, None, ())
    num_candidate_skips: int = 0  # samples skipped by what their code needs or did (a GPU, NVSHMEM): in n, not passed

    def fast(self, p: float = 1.0, k: int = 1) -> float | None:
        """fast_p@k, or None where no sample was timed on GPUs and p > 0 (it would only repeat that nothing was
        measured): what every table, plot and the JSON show (``-``, null)."""
        return self.fast_p.get(k, {}).get(p) if self.timed or p == 0.0 else None

    @property
    def failures(self) -> dict[str, int]:
        """Each failing verdict's count: every verdict but ``ok``, pkb's or the machine's failure and a ``skipped``
        the run caused (``skipped`` here counts those the candidate caused)."""
        found = {s: n for s, n in self.verdicts.items() if s not in {v.value for v in NOT_FAILURES}}
        if self.num_candidate_skips:
            found[Status.SKIPPED.value] = self.num_candidate_skips
        return dict(sorted(found.items()))

    @property
    def denominator(self) -> int:
        return self.num_problems - self.num_skipped_problems


def compute(records: Iterable[Record], problems: Iterable[str], ks: Iterable[int] = DEFAULT_KS,
            protocol: str = "pkb") -> Metrics:
    """Metrics of ``records`` (one group's, reference self-checks already left out) over ``problems``,
    a sample being correct as ``protocol`` (``PROTOCOLS``) judges it."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; use one of {', '.join(PROTOCOLS)}")
    problems = list(dict.fromkeys(problems))
    by_problem: dict[str, list[Record]] = {p: [] for p in problems}
    for record in records:
        if record.problem in by_problem:
            by_problem[record.problem].append(record)
    tallies = [tally(p, rs, protocol) for p, rs in by_problem.items()]
    skipped_only = [t for t in tallies if t.num_samples == 0 and t.num_skipped > 0]
    denominator = len(problems) - len(skipped_only)
    attempted = [t for t in tallies if t.num_samples > 0]
    fewest_samples = min((t.num_samples for t in attempted), default=1)  # nothing attempted: pass@1 is 0
    usable_ks = [k for k in sorted(set(ks)) if k <= fewest_samples] if denominator else []
    average = lambda values: sum(values) / denominator if denominator else 0.0  # noqa: E731
    pass_k = {k: average([pass_at_k(t.num_samples, t.num_correct, k) for t in attempted]) for k in usable_ks}
    fast_p = {k: {p: average([pass_at_k(t.num_samples, t.num_fast[i], k) for t in attempted])
                  for i, p in enumerate(FAST_P_THRESHOLDS)} for k in usable_ks}
    judged = [(r, r.verdict(protocol)) for rs in by_problem.values() for r in rs]
    in_n = [r for r, _ in judged if counted(r, protocol)]
    correct = [r for r, verdict in judged if verdict is Status.OK]
    speedups = [s for s in map(gpu_speedup, correct) if s is not None and s > 0]
    verdicts: dict[str, int] = {}
    for _, verdict in judged:
        if verdict is not None:
            verdicts[verdict.value] = verdicts.get(verdict.value, 0) + 1
    return Metrics(
        num_problems=len(problems), num_attempted=len(attempted), num_skipped_problems=len(skipped_only),
        num_samples=sum(t.num_samples for t in tallies), pass_at_k=pass_k, fast_p=fast_p,
        geomean_speedup=_geomean(speedups), num_timed=len(speedups),
        roofline=roofline_summary([r.result.roofline_fraction for r in correct
                                   if r.result.roofline_fraction is not None and gpu_speedup(r) is not None]),
        moves_data_itself=(sum(1 for r in correct if not r.result.collectives_used) / len(correct)) if correct else None,
        verdicts=dict(sorted(verdicts.items())), protocol=protocol, num_unknown=sum(t.num_unknown for t in tallies),
        timed=any(gpu_speedup(r) is not None for r in in_n), off_gpu=off_gpu_timings(correct),
        num_candidate_skips=sum(t.num_candidate_skips for t in tallies),
    )


@dataclass(frozen=True)
class SandboxTally:
    """Results with a verdict (``num_results``) by how their candidates fell short of the full sandbox
    (``records.sandbox_gap``); a result under the full sandbox is in none of the gaps."""

    num_results: int
    num_by_gap: dict[str, int]  # every one of SANDBOX_GAPS -> results

    @property
    def num_without_full(self) -> int:
        return sum(self.num_by_gap.values())


def sandbox_tally(records: Iterable[Record]) -> SandboxTally:
    """How the candidates of ``records`` were confined. Rows without a verdict (``harness_error``,
    ``infra_error``: the candidate may never have run, and such a row need not record a sandbox) are
    left out, as the metrics leave them out. E.g. rows full, off, partial, an old one: ``4`` results,
    ``{"off": 1, "partial": 1, "unrecorded": 1}``."""
    gaps = [sandbox_gap(r.result) for r in records if r.status.is_verdict]
    return SandboxTally(len(gaps), {gap: gaps.count(gap) for gap in SANDBOX_GAPS})


# Why a sample correct on the paper's protocol failed pkb's, where no tagged tests case says it.
STRICT_ONLY_REASONS = {
    "strict_check": "pkb's stricter comparison on upstream or benchmark inputs (dtype, tolerance, the inputs "
                    "after the call, the same answer twice)",
    "timeout_or_crash": "timed out or crashed on a stricter case",
    "untagged": "a case without tags",
    "unrecorded": "the result does not say which case failed",
}


@dataclass(frozen=True)
class StrictGap:
    """Of a group's samples correct on the paper's protocol (``paper_ok``), those failing pkb's cases
    (``strict_failed``), counted under each reason of the case that failed them (a sample counts once
    under each tag of its case)."""

    paper_ok: int
    strict_failed: int
    reasons: dict[str, int]


def strict_gaps(records: Iterable[Record], problems: dict[str, str],
                case_tags: dict[str, dict[str, tuple[str, ...]]]) -> dict[str, StrictGap]:
    """Per group, the paper-correct samples that fail pkb's cases and why (``StrictGap``); ``case_tags``:
    slug -> tests case -> its tags (``records.registry_case_tags``)."""
    by_group: dict[str, list[Record]] = {}
    for record in records:
        if not record.is_reference and record.problem in problems and record.verdict("paper") is Status.OK:
            by_group.setdefault(record.group, []).append(record)
    gaps = {}
    for group, paper_ok in by_group.items():
        failed = [r for r in paper_ok if r.status is not Status.OK and r.status.is_verdict]
        reasons: dict[str, int] = {}
        for record in failed:
            for reason in strict_failure_reasons(record, case_tags.get(record.problem, {})):
                reasons[reason] = reasons.get(reason, 0) + 1
        gaps[group] = StrictGap(len(paper_ok), len(failed), dict(sorted(reasons.items(), key=lambda kv: -kv[1])))
    return gaps


# Why a sample ok by pkb's verdict fails the paper's (upstream's rule on upstream's inputs): what it says of the rule.
PAPER_ONLY_REASONS = {
    "more_accurate": "closer to the exact answer than the reference (RMS error at most the reference's), yet outside "
                     "upstream's allclose of the reference's outputs: the paper's rule fails an answer it should pass",
    "rounding": "within pkb's accuracy rule, and outside upstream's allclose 1e-2 of the reference's outputs on upstream's "
                "values by a rounding or two",
    "upstream_values": "wrong only on upstream's own input values (constants, its seeds), which pkb's verdict does not use",
    "timeout_or_crash": "timed out or crashed on upstream's inputs only",
}


@dataclass(frozen=True)
class PaperGap:
    """Of a group's samples ok by pkb's verdict (``pkb_ok``), those failing the paper's (``paper_failed``), counted
    under why (``PAPER_ONLY_REASONS``): the other direction of the two verdicts' disagreement."""

    pkb_ok: int
    paper_failed: int
    reasons: dict[str, int]


def paper_gaps(records: Iterable[Record], problems: dict[str, str]) -> dict[str, PaperGap]:
    """Per group, the samples ok by pkb's verdict that the paper's rule fails, and why (``PaperGap``)."""
    by_group: dict[str, list[Record]] = {}
    for record in records:
        if not record.is_reference and record.problem in problems and record.status is Status.OK:
            by_group.setdefault(record.group, []).append(record)
    gaps = {}
    for group, pkb_ok in by_group.items():
        failed = [r for r in pkb_ok if r.result.upstream_ok is False]
        reasons: dict[str, int] = {}
        for record in failed:
            reason = paper_failure_reason(record)
            reasons[reason] = reasons.get(reason, 0) + 1
        gaps[group] = PaperGap(len(pkb_ok), len(failed), dict(sorted(reasons.items(), key=lambda kv: -kv[1])))
    return gaps


def paper_failure_reason(record: Record) -> str:
    """Why a sample ok by pkb's verdict failed the paper's: a ``PAPER_ONLY_REASONS`` key."""
    failed = (record.result.details.upstream or {}).get("failed") or {}
    if failed.get("status") in (Status.TIMEOUT.value, Status.CRASH.value):
        return "timeout_or_crash"
    if failed.get("status") != Status.MISMATCH.value:
        return "upstream_values"
    least = (record.result.details.accuracy or {}).get("least_accurate") or {}
    if least and least.get("rms_ratio", math.inf) <= 1.0:
        return "more_accurate"
    return "rounding" if least else "upstream_values"


def strict_failure_reasons(record: Record, tags_of_case: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """Why ``record`` failed pkb's cases: its failing tests case's tags, or a ``STRICT_ONLY_REASONS`` key."""
    if record.status in (Status.TIMEOUT, Status.CRASH):
        return ("timeout_or_crash",)
    case = record.result.details.case
    if case is None:
        return ("unrecorded",)
    if case not in tags_of_case:  # an upstream or benchmark case: the same inputs, a stricter comparison
        return ("strict_check",)
    return tags_of_case[case] or ("untagged",)


@dataclass(frozen=True)
class Coverage:
    """How much of the selection (or of one category of it) a group has a result for, whatever the verdict:
    e.g. pkb's 8 shipped files over the whole suite are ``Coverage(87, 8)``."""

    num_selected: int
    num_covered: int

    @property
    def complete(self) -> bool:
        return self.num_covered == self.num_selected

    def text(self) -> str:
        """e.g. ``8 of 87``."""
        return f"{self.num_covered} of {self.num_selected}"


def covered_problems(records: Iterable[Record], problems: Iterable[str]) -> list[str]:
    """The problems of ``problems`` (in its order) that ``records`` (one group's) have a row for."""
    present = {r.problem for r in records}
    return [p for p in dict.fromkeys(problems) if p in present]


@dataclass(frozen=True)
class SelfCheck:
    """The references checked against themselves: a check of the suite and of the harness, not a set."""

    num_selected: int  # problems in the selection
    num_checked: int  # of them with a self-check
    num_ok: int
    num_skipped: int
    failed: dict[str, str]  # problem -> its verdict (harness_error included: pkb failed on its own reference)

    def summary(self) -> str:
        """e.g. ``references: 86 of 87 ok (1 failed: allreduce mismatch)``."""
        if not self.num_checked:
            return "references: no self-check in these results"
        details = self.details()
        return f"references: {self.num_ok} of {self.num_checked} ok" + (f" ({'; '.join(details)})" if details else "")

    def details(self) -> list[str]:
        """What the count alone does not say: skipped and failed self-checks, problems left unchecked."""
        extra = []
        if self.num_skipped:
            extra.append(f"{self.num_skipped} skipped")
        if self.failed:
            shown = ", ".join(f"{p} {s}" for p, s in list(self.failed.items())[:5])
            extra.append(f"{len(self.failed)} failed: {shown}" + (", ..." if len(self.failed) > 5 else ""))
        if self.num_checked < self.num_selected:
            extra.append(f"{self.num_selected - self.num_checked} of {self.num_selected} selected problems not checked")
        return extra


def self_check(records: Iterable[Record], problems: Iterable[str]) -> SelfCheck:
    problems = list(dict.fromkeys(problems))
    latest: dict[str, Record] = {}
    for record in records:
        if record.is_reference and record.problem in problems:
            latest[record.problem] = record  # records are in id order: the latest wins
    verdicts = {p: latest[p].status for p in problems if p in latest}
    return SelfCheck(num_selected=len(problems), num_checked=len(verdicts),
                     num_ok=sum(1 for s in verdicts.values() if s is Status.OK),
                     num_skipped=sum(1 for s in verdicts.values() if s is Status.SKIPPED),
                     failed={p: s.value for p, s in verdicts.items() if s not in (Status.OK, Status.SKIPPED)})


@dataclass(frozen=True)
class Report:
    """Metrics per group, overall and per category, on both protocols, over a selection of problems."""

    group_by: str
    problems: dict[str, str]  # the selection: slug -> category
    groups: tuple[str, ...]  # best first (pass@1, then fast_1, then geomean speedup, on pkb's protocol)
    overall: dict[str, Metrics]  # pkb's protocol
    by_category: dict[str, dict[str, Metrics]]  # group -> category -> metrics (pkb's protocol)
    records: tuple[Record, ...]  # every record, reference self-checks included
    notes: tuple[str, ...] = ()
    paper: dict[str, Metrics] = field(default_factory=dict)  # the paper's protocol
    paper_by_category: dict[str, dict[str, Metrics]] = field(default_factory=dict)
    self_check: SelfCheck = SelfCheck(0, 0, 0, 0, {})
    ks: tuple[int, ...] = DEFAULT_KS
    coverage: dict[str, Coverage] = field(default_factory=dict)  # group -> its share of the selection
    covered: dict[str, dict[str, Metrics]] = field(default_factory=dict)  # protocol -> group -> covered view
    covered_by_category: dict[str, dict[str, dict[str, Metrics]]] = field(default_factory=dict)  # protocol -> ...
    strict_gaps: dict[str, StrictGap] = field(default_factory=dict)  # group -> paper-correct samples failing pkb's
    paper_gaps: dict[str, PaperGap] = field(default_factory=dict)  # group -> pkb-correct samples failing the paper's
    experiments: tuple[str, ...] = ()  # the experiments its records are of (pkb.options), as the report was asked
    off_gpu_shown: bool = False  # cpu and shared-gpu timings asked for (--off-gpu-timings): shown apart, labelled

    @property
    def categories(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.problems.values()))

    def on(self, protocol: str, view: str = "suite") -> dict[str, Metrics]:
        """Overall metrics per group on ``protocol``, over the whole selection (``suite``) or over the
        problems each group covers (``covered``)."""
        if view == "covered":
            return self.covered[protocol]
        return self.paper if protocol == "paper" else self.overall

    def on_category(self, protocol: str, view: str = "suite") -> dict[str, dict[str, Metrics]]:
        if view == "covered":
            return self.covered_by_category[protocol]
        return self.paper_by_category if protocol == "paper" else self.by_category

    def partial(self) -> list[str]:
        """The groups that have results for only part of the selection, best first."""
        return [g for g in self.groups if not self.coverage[g].complete]

    def category_coverage(self, group: str, category: str) -> Coverage:
        selected = [p for p, c in self.problems.items() if c == category]
        return Coverage(len(selected), len(covered_problems(
            (r for r in self.records if r.group == group and not r.is_reference), selected)))

    def sandbox(self, group: str, category: str | None = None) -> SandboxTally:
        """How the candidates of ``group``'s counted results (the selection, or one ``category`` of it;
        the latest row of each sample) were confined."""
        return sandbox_tally(r for r in self.records if r.group == group and not r.is_reference
                             and r.problem in self.problems
                             and (category is None or self.problems[r.problem] == category))

    def candidate_skips(self, group: str) -> dict[str, int]:
        """Of ``group``'s counted results (the latest row of each sample), those ``skipped`` by what their code
        needs or did (``skipped_by_candidate``: counted as not passed), by what they need (``CANDIDATE_SKIP_NEEDS``
        key -> results), most first."""
        needs: dict[str, int] = {}
        for record in self.records:
            if (record.group == group and not record.is_reference and record.problem in self.problems
                    and skipped_by_candidate(record)):
                need = candidate_skip_need(record)
                needs[need] = needs.get(need, 0) + 1
        return dict(sorted(needs.items(), key=lambda kv: -kv[1]))

    @property
    def timed_off_gpu(self) -> bool:
        """Some counted result was timed in ``cpu`` or ``shared-gpu`` mode (not GPU performance: left out of fast_p,
        the geomean and the roofline)."""
        return any(off_gpu_speedup(r) is not None
                   for r in self.records if not r.is_reference and r.group in self.overall)

    def to_json(self) -> dict:
        """The ``pkb report --format json`` document (keys documented in docs/reports.md)."""
        return {
            "group_by": self.group_by,
            "experiments": list(self.experiments),
            "num_problems": len(self.problems),
            "groups": list(self.groups),
            "self_check": {"selected": self.self_check.num_selected, "checked": self.self_check.num_checked,
                           "ok": self.self_check.num_ok, "skipped": self.self_check.num_skipped,
                           "failed": self.self_check.failed},
            **_protocol_json(self.overall, self.by_category),
            "paper": _protocol_json(self.paper, self.paper_by_category),
            "coverage": {g: {"selected": c.num_selected, "covered": c.num_covered, "complete": c.complete}
                         for g, c in self.coverage.items()},
            "covered": {**_protocol_json(self.covered["pkb"], self.covered_by_category["pkb"]),
                        "paper": _protocol_json(self.covered["paper"], self.covered_by_category["paper"])},
            "strict_gaps": {g: {"paper_ok": gap.paper_ok, "strict_failed": gap.strict_failed, "reasons": gap.reasons}
                            for g, gap in self.strict_gaps.items()},
            "paper_gaps": {g: {"pkb_ok": gap.pkb_ok, "paper_failed": gap.paper_failed, "reasons": gap.reasons}
                           for g, gap in self.paper_gaps.items()},
            "notes": list(self.notes),
            **({"off_gpu_timings": {g: {"num_timed": m.off_gpu.num_timed, "geomean_speedup": m.off_gpu.geomean_speedup,
                                        "modes": list(m.off_gpu.modes)} for g, m in self.overall.items()}}
               if self.off_gpu_shown else {}),
        }


def _protocol_json(overall: dict[str, Metrics], by_category: dict[str, dict[str, Metrics]]) -> dict:
    return {
        "pass_at_k": {g: _keyed(m.pass_at_k) for g, m in overall.items()},
        "fast_p": {g: _fast_p_json(m) for g, m in overall.items()},
        "geomean_speedup": {g: m.geomean_speedup for g, m in overall.items()},
        "roofline": {g: _roofline_json(m.roofline) for g, m in overall.items()},
        "failures": {g: m.failures for g, m in overall.items()},
        "verdicts": {g: m.verdicts for g, m in overall.items()},
        "unknown": {g: m.num_unknown for g, m in overall.items()},
        "moves_data_itself": {g: m.moves_data_itself for g, m in overall.items()},
        "problems": {g: {"selected": m.num_problems, "attempted": m.num_attempted,
                         "skipped_only": m.num_skipped_problems, "samples": m.num_samples}
                     for g, m in overall.items()},
        "skipped_by_candidate": {g: m.num_candidate_skips for g, m in overall.items()},
        "by_category": {g: {c: _metrics_json(m) for c, m in cats.items()} for g, cats in by_category.items()},
    }


def build_report(records: Iterable[Record], problems: dict[str, str], group_by: str,
                 ks: Iterable[int] = DEFAULT_KS, notes: Iterable[str] = (),
                 case_tags: dict[str, dict[str, tuple[str, ...]]] | None = None, experiments: Iterable[str] = (),
                 off_gpu_shown: bool = False) -> Report:
    """Group ``records`` and compute every metric on both protocols. ``problems``: the selection, slug -> category;
    ``case_tags``: slug -> tests case -> its tags (default: the registry's); ``experiments``: those the records were
    read from; ``off_gpu_shown``: cpu and shared-gpu timings asked for (shown apart, never in the speed metrics)."""
    records = tuple(records)
    case_tags = registry_case_tags() if case_tags is None else case_tags
    ks = tuple(ks)
    by_group: dict[str, list[Record]] = {}
    for record in records:
        if not record.is_reference and record.problem in problems:
            by_group.setdefault(record.group, []).append(record)
    covered = {g: covered_problems(rs, problems) for g, rs in by_group.items()}
    views = {view: {g: {p: problems[p] for p in (covered[g] if view == "covered" else problems)} for g in by_group}
             for view in VIEWS}  # view -> group -> its problems, slug -> category
    # The paper judges only the problems it has: pkb's own (no upstream case) are outside its denominator.
    upstream_cases = registry_upstream_cases()
    beyond = {r.problem for r in records if r.beyond_upstream} | {p for p in problems if upstream_cases.get(p) == frozenset()}
    judged = {view: {g: {p: c for p, c in ps.items() if p not in beyond} for g, ps in views[view].items()}
              for view in VIEWS}
    categories = tuple(dict.fromkeys(problems.values()))
    on_protocol = {(view, protocol): _view_metrics(by_group, (judged if protocol == "paper" else views)[view],
                                                   categories, ks, protocol)
                   for view in VIEWS for protocol in PROTOCOLS}
    overall, by_category = on_protocol[("suite", "pkb")]
    paper, paper_by_category = on_protocol[("suite", "paper")]
    groups = tuple(sorted(overall, key=lambda g: _rank_key(g, overall[g])))  # ranked on the suite: comparable
    ordered = lambda by: {g: by[g] for g in groups}  # noqa: E731
    return Report(group_by, dict(problems), groups, ordered(overall), ordered(by_category), records, tuple(notes),
                  paper=ordered(paper), paper_by_category=ordered(paper_by_category),
                  self_check=self_check(records, problems), ks=ks,
                  coverage={g: Coverage(len(problems), len(covered[g])) for g in groups},
                  covered={p: ordered(on_protocol[("covered", p)][0]) for p in PROTOCOLS},
                  covered_by_category={p: ordered(on_protocol[("covered", p)][1]) for p in PROTOCOLS},
                  strict_gaps={g: gap for g, gap in strict_gaps(records, problems, case_tags).items() if g in groups},
                  paper_gaps={g: gap for g, gap in paper_gaps(records, problems).items() if g in groups},
                  experiments=tuple(experiments), off_gpu_shown=off_gpu_shown)


def _view_metrics(by_group: dict[str, list[Record]], problems_of: dict[str, dict[str, str]],
                  categories: tuple[str, ...], ks: tuple[int, ...],
                  protocol: str) -> tuple[dict[str, Metrics], dict[str, dict[str, Metrics]]]:
    """Each group's metrics over its problems (``problems_of[group]``, slug -> category), overall and per
    category (every one of ``categories``, over no problem where the group's problems have none of it)."""
    overall = {g: compute(rs, problems_of[g], ks, protocol) for g, rs in by_group.items()}
    by_category = {g: {c: compute([r for r in rs if problems_of[g].get(r.problem) == c],
                                  [p for p, pc in problems_of[g].items() if pc == c], ks, protocol)
                       for c in categories} for g, rs in by_group.items()}
    return overall, by_category


def _rank_key(group: str, metrics: Metrics) -> tuple:
    return (-metrics.pass_at_k.get(1, 0.0), -metrics.fast_p.get(1, {}).get(1.0, 0.0),
            -(metrics.geomean_speedup or 0.0), group)


# -- two sets side by side, problem by problem (pkb report --compare) -----------------------------------


@dataclass(frozen=True)
class Side:
    """One set's samples of one problem."""

    num_samples: int  # records, whatever their verdict
    verdicts: dict[str, tuple[str, ...]]  # protocol -> each sample's verdict ("unknown" where the row cannot tell)
    num_correct: dict[str, int]  # protocol -> correct samples
    best_speedup: float | None  # the fastest sample correct on pkb's protocol, timed on GPUs
    roofline: float | None  # that sample's fraction of roofline
    num_counted: dict[str, int] = field(default_factory=dict)  # protocol -> samples in n (``counted``)

    def solved(self, protocol: str) -> bool:
        return self.num_correct[protocol] > 0


@dataclass(frozen=True)
class Comparison:
    sets: tuple[str, str]
    rows: tuple[tuple[str, str, dict[str, Side | None]], ...]  # (problem, category, set -> side or None)
    counts: dict[str, dict[str, int]]  # protocol -> {"both", "only <a>", "only <b>", "neither"} over problems


def compare(report: Report, set_a: str, set_b: str) -> Comparison:
    """``set_a`` and ``set_b`` side by side on every selected problem that either has a result for."""
    sets = (set_a, set_b)
    by_key: dict[tuple[str, str], list[Record]] = {}
    for record in report.records:
        if record.group in sets and not record.is_reference:
            by_key.setdefault((record.group, record.problem), []).append(record)
    rows = []
    counts = {protocol: {"both": 0, f"only {set_a}": 0, f"only {set_b}": 0, "neither": 0} for protocol in PROTOCOLS}
    for problem, category in report.problems.items():
        sides = {name: _side(by_key[(name, problem)]) if (name, problem) in by_key else None for name in sets}
        if all(side is None for side in sides.values()):
            continue
        rows.append((problem, category, sides))
        for protocol in PROTOCOLS:
            a, b = (sides[name] is not None and sides[name].solved(protocol) for name in sets)
            counts[protocol]["both" if a and b else f"only {set_a}" if a else f"only {set_b}" if b else "neither"] += 1
    return Comparison(sets, tuple(rows), counts)


def _side(records: list[Record]) -> Side:
    verdicts = {p: tuple((r.verdict(p).value if r.verdict(p) is not None else "unknown") for r in records)
                for p in PROTOCOLS}
    correct = {p: sum(1 for v in verdicts[p] if v == Status.OK.value) for p in PROTOCOLS}
    timed = [r for r in records if r.status is Status.OK and gpu_speedup(r) is not None]
    best = max(timed, key=lambda r: r.result.speedup, default=None)
    return Side(len(records), verdicts, correct, best.result.speedup if best else None,
                best.result.roofline_fraction if best else None,
                {p: sum(1 for r in records if counted(r, p)) for p in PROTOCOLS})


def _keyed(values: dict) -> dict[str, float]:
    return {_number_key(k): v for k, v in values.items()}


def _number_key(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _roofline_json(summary: RooflineSummary) -> dict:
    return {"count": summary.count, "quantiles": summary.quantiles, "histogram": dict(summary.histogram)}


def _fast_p_json(m: Metrics) -> dict:
    """k -> p -> fast_p@k, null for p > 0 where nothing was timed on GPUs (``Metrics.fast``)."""
    return {str(k): {_number_key(p): m.fast(p, k) for p in by_p} for k, by_p in m.fast_p.items()}


def _metrics_json(m: Metrics) -> dict:
    return {"pass_at_k": _keyed(m.pass_at_k), "fast_p": _fast_p_json(m),
            "geomean_speedup": m.geomean_speedup, "roofline": _roofline_json(m.roofline), "failures": m.failures,
            "moves_data_itself": m.moves_data_itself, "problems": m.num_problems, "attempted": m.num_attempted,
            "unknown": m.num_unknown, "skipped_by_candidate": m.num_candidate_skips}
