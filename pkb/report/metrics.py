"""The numbers a report shows, per group (model or solution set) and per category, in one place.

- ``pass@k``: the unbiased estimator of Chen et al. 2021, ``1 - C(n-c, k) / C(n, k)`` for a problem with
  ``n`` samples of which ``c`` are correct, averaged over the problems of the selection. It is given for
  the k that every attempted problem has at least k samples for (the estimator needs ``n >= k``).
- ``fast_p@k``: the same estimator where a sample counts when it is correct *and* its speedup over the
  reference is above ``p``, for p in ``FAST_P_THRESHOLDS``. ``fast_0`` is correctness (every measured
  speedup is above 0, and a correct sample without timings counts too); for p > 0 a sample needs a
  measured speedup.
- ``geomean_speedup``: the geometric mean of the speedups of correct samples that were timed.
- ``roofline``: the distribution of % of roofline over correct samples that have one: quantiles and a
  histogram in 10 % bins (and a bin for over 100 %, a sign of a hardware profile that is too slow).
- ``moves_data_itself``: the share of correct samples that call no stock collective
  (``collectives_used`` empty).
- ``verdicts``: every verdict's count; ``failures`` are those other than ``ok`` and ``skipped``.

How results count: a problem of the selection with no result for a group counts as failed (0 in
pass@k and fast_p). A ``skipped`` sample (it needs what the mode lacks) is neither a pass nor a
failure: it is left out of ``n``, and a problem whose every sample was skipped leaves the denominator
(``num_skipped_problems`` says how many did). Reference self-checks never count.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Iterable

from pkb.problem import Status
from pkb.report.records import Record

FAST_P_THRESHOLDS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0)
DEFAULT_KS = (1, 5, 10, 100)
QUANTILES = {"p10": 0.1, "p25": 0.25, "median": 0.5, "p75": 0.75, "p90": 0.9}
ROOFLINE_BIN_EDGES = tuple(i / 10 for i in range(11))  # 0, 0.1, ..., 1.0, then one bin above 100 %
NOT_FAILURES = (Status.OK, Status.SKIPPED)


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k for one problem: ``1 - C(n-c, k) / C(n, k)``; e.g. ``pass_at_k(2, 1, 1) == 0.5``."""
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"need 0 <= correct <= samples, got {num_correct} of {num_samples}")
    if k < 1 or k > num_samples:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples, got n={num_samples}")
    return float(1 - Fraction(math.comb(num_samples - num_correct, k), math.comb(num_samples, k)))


@dataclass(frozen=True)
class ProblemTally:
    """One group's samples of one problem: ``num_samples`` excludes skipped ones."""

    problem: str
    num_samples: int
    num_correct: int
    num_skipped: int
    num_fast: tuple[int, ...]  # per FAST_P_THRESHOLDS: correct and speedup > p


def tally(problem: str, records: Iterable[Record]) -> ProblemTally:
    records = list(records)
    records = [r for r in records if r.status is not Status.HARNESS_ERROR]  # no verdict on the candidate
    counted = [r for r in records if r.status is not Status.SKIPPED]
    correct = [r for r in counted if r.status is Status.OK]
    fast = tuple(sum(1 for r in correct if _is_fast(r, p)) for p in FAST_P_THRESHOLDS)
    return ProblemTally(problem, len(counted), len(correct), len(records) - len(counted), fast)


def _is_fast(record: Record, p: float) -> bool:
    speedup = record.result.speedup
    if speedup is None:
        return p == 0.0
    return speedup > p


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
    """Every metric of one group over one set of problems (the selection, or one category of it)."""

    num_problems: int  # in the selection
    num_attempted: int  # with at least one sample that was not skipped
    num_skipped_problems: int  # every sample skipped: left out of the denominator
    num_samples: int  # samples counted (not skipped)
    pass_at_k: dict[int, float]
    fast_p: dict[int, dict[float, float]]  # k -> p -> fast_p@k
    geomean_speedup: float | None
    num_timed: int  # correct samples with a speedup (the geomean's count)
    roofline: RooflineSummary
    moves_data_itself: float | None  # share of correct samples with no stock collective
    verdicts: dict[str, int]

    @property
    def failures(self) -> dict[str, int]:
        return {s: n for s, n in self.verdicts.items() if s not in {v.value for v in NOT_FAILURES}}

    @property
    def denominator(self) -> int:
        return self.num_problems - self.num_skipped_problems


def compute(records: Iterable[Record], problems: Iterable[str], ks: Iterable[int] = DEFAULT_KS) -> Metrics:
    """Metrics of ``records`` (one group's, reference self-checks already left out) over ``problems``."""
    problems = list(dict.fromkeys(problems))
    by_problem: dict[str, list[Record]] = {p: [] for p in problems}
    for record in records:
        if record.problem in by_problem:
            by_problem[record.problem].append(record)
    tallies = [tally(p, rs) for p, rs in by_problem.items()]
    skipped_only = [t for t in tallies if t.num_samples == 0 and t.num_skipped > 0]
    denominator = len(problems) - len(skipped_only)
    attempted = [t for t in tallies if t.num_samples > 0]
    fewest_samples = min((t.num_samples for t in attempted), default=1)  # nothing attempted: pass@1 is 0
    usable_ks = [k for k in sorted(set(ks)) if k <= fewest_samples] if denominator else []
    average = lambda values: sum(values) / denominator if denominator else 0.0  # noqa: E731
    pass_k = {k: average([pass_at_k(t.num_samples, t.num_correct, k) for t in attempted]) for k in usable_ks}
    fast_p = {k: {p: average([pass_at_k(t.num_samples, t.num_fast[i], k) for t in attempted])
                  for i, p in enumerate(FAST_P_THRESHOLDS)} for k in usable_ks}
    kept = [r for rs in by_problem.values() for r in rs]
    correct = [r for r in kept if r.status is Status.OK]
    speedups = [r.result.speedup for r in correct if r.result.speedup is not None and r.result.speedup > 0]
    verdicts: dict[str, int] = {}
    for record in kept:
        verdicts[record.status.value] = verdicts.get(record.status.value, 0) + 1
    return Metrics(
        num_problems=len(problems), num_attempted=len(attempted), num_skipped_problems=len(skipped_only),
        num_samples=sum(t.num_samples for t in tallies), pass_at_k=pass_k, fast_p=fast_p,
        geomean_speedup=math.exp(statistics.fmean(math.log(s) for s in speedups)) if speedups else None,
        num_timed=len(speedups),
        roofline=roofline_summary([r.result.roofline_fraction for r in correct if r.result.roofline_fraction is not None]),
        moves_data_itself=(sum(1 for r in correct if not r.result.collectives_used) / len(correct)) if correct else None,
        verdicts=dict(sorted(verdicts.items())),
    )


@dataclass(frozen=True)
class Report:
    """Metrics per group, overall and per category, over a selection of problems."""

    group_by: str
    problems: dict[str, str]  # the selection: slug -> category
    groups: tuple[str, ...]  # best first (pass@1, then fast_1, then geomean speedup)
    overall: dict[str, Metrics]
    by_category: dict[str, dict[str, Metrics]]  # group -> category -> metrics
    records: tuple[Record, ...]  # every record, reference self-checks included
    notes: tuple[str, ...] = ()

    @property
    def categories(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.problems.values()))

    def to_json(self) -> dict:
        """The ``pkb report --format json`` document (keys documented in docs/reports.md)."""
        return {
            "group_by": self.group_by,
            "num_problems": len(self.problems),
            "groups": list(self.groups),
            "pass_at_k": {g: _keyed(m.pass_at_k) for g, m in self.overall.items()},
            "fast_p": {g: {str(k): _keyed(by_p) for k, by_p in m.fast_p.items()} for g, m in self.overall.items()},
            "geomean_speedup": {g: m.geomean_speedup for g, m in self.overall.items()},
            "roofline": {g: _roofline_json(m.roofline) for g, m in self.overall.items()},
            "failures": {g: m.failures for g, m in self.overall.items()},
            "verdicts": {g: m.verdicts for g, m in self.overall.items()},
            "moves_data_itself": {g: m.moves_data_itself for g, m in self.overall.items()},
            "problems": {g: {"selected": m.num_problems, "attempted": m.num_attempted,
                             "skipped_only": m.num_skipped_problems, "samples": m.num_samples}
                         for g, m in self.overall.items()},
            "by_category": {g: {c: _metrics_json(m) for c, m in cats.items()} for g, cats in self.by_category.items()},
            "notes": list(self.notes),
        }


def build_report(records: Iterable[Record], problems: dict[str, str], group_by: str,
                 ks: Iterable[int] = DEFAULT_KS, notes: Iterable[str] = ()) -> Report:
    """Group ``records`` and compute every metric. ``problems``: the selection, slug -> category."""
    records = tuple(records)
    ks = tuple(ks)
    by_group: dict[str, list[Record]] = {}
    for record in records:
        if not record.is_reference and record.problem in problems:
            by_group.setdefault(record.group, []).append(record)
    overall = {g: compute(rs, problems, ks) for g, rs in by_group.items()}
    categories = tuple(dict.fromkeys(problems.values()))
    by_category = {g: {c: compute([r for r in rs if problems[r.problem] == c],
                                  [p for p, pc in problems.items() if pc == c], ks) for c in categories}
                   for g, rs in by_group.items()}
    groups = tuple(sorted(overall, key=lambda g: _rank_key(g, overall[g])))
    return Report(group_by, dict(problems), groups, {g: overall[g] for g in groups},
                  {g: by_category[g] for g in groups}, records, tuple(notes))


def _rank_key(group: str, metrics: Metrics) -> tuple:
    return (-metrics.pass_at_k.get(1, 0.0), -metrics.fast_p.get(1, {}).get(1.0, 0.0),
            -(metrics.geomean_speedup or 0.0), group)


def _keyed(values: dict) -> dict[str, float]:
    return {_number_key(k): v for k, v in values.items()}


def _number_key(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _roofline_json(summary: RooflineSummary) -> dict:
    return {"count": summary.count, "quantiles": summary.quantiles, "histogram": dict(summary.histogram)}


def _metrics_json(m: Metrics) -> dict:
    return {"pass_at_k": _keyed(m.pass_at_k), "fast_p": {str(k): _keyed(v) for k, v in m.fast_p.items()},
            "geomean_speedup": m.geomean_speedup, "roofline": _roofline_json(m.roofline), "failures": m.failures,
            "moves_data_itself": m.moves_data_itself, "problems": m.num_problems, "attempted": m.num_attempted}
