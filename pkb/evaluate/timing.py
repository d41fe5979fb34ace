"""Timing, the parent's side (docs/timing.md): each group's timed phases driven one at a time and timed
with the parent's own clock (the ranks run pkb.runtime.timed_loop.TimedLoop), the reference and the
candidate one after the other, the ranks' own clocks checked against it, the outputs of the timed calls
checked too, and the speedup, bus bandwidth and roofline fraction of each case.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from dataclasses import dataclass

from pkb.evaluate.compare import compare
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.result import CaseTiming, EvalResult
from pkb.evaluate.session import Session
from pkb.evaluate.verdicts import HarnessError, RankError, Verdict, candidate_failures, checked, raise_candidate_error, used
from pkb.hardware.roofline import busbw_gbps, roofline, roofline_fraction
from pkb.options import Status
from pkb.problem import Case, Problem
from pkb.runtime.group import GroupFailure, RankGroup
from pkb.runtime.modes import Mode


def perf_cases(problem: Problem, config: EvalConfig) -> tuple[Case, ...]:
    """Benchmarks on real GPUs; the small test cases where times are not GPU performance anyway."""
    if config.mode is Mode.CUDA and problem.cases("benchmarks", config.world_size):
        return problem.cases("benchmarks", config.world_size, config.precision, config.nodes)
    return problem.cases("tests", config.world_size, config.precision, config.nodes)


def spread(values: list[float]) -> float:
    """(max - min) / median: how far repeated measurements of one thing fall apart."""
    return (max(values) - min(values)) / statistics.median(values)


@dataclass
class GroupTiming:
    """One group's timing of one case, from the parent's own clock unless said otherwise."""

    repeat_s: list[float]  # seconds per call in each repeat
    refresh_s: list[float]  # seconds each untimed refresh of the input values took
    finish_s: float  # seconds the final synchronize (and joining leftover threads) took
    num_iters: int  # calls per repeat
    rank_clock_s: float  # median of the slowest rank's own wall clock, per call (a cross-check)
    event_s: float | None  # median of the slowest rank's CUDA-event time, per call
    outputs: list  # per rank: the last output computed on each input copy
    threads_left_running: int
    collectives_used: list[str]  # stock calls the group's code made (candidate groups only)

    @property
    def median_s(self) -> float:
        return statistics.median(self.repeat_s)

    @property
    def spread(self) -> float:
        return spread(self.repeat_s)

    def per_call_s(self, refresh_allowance_s: float | None = None) -> float:
        """The median repeat, or, if larger, all the time the group took divided by its timed calls.

        Everything from the first repeat to the end of ``finish`` counts, refreshes included beyond
        ``refresh_allowance_s`` each (what the same refresh took the reference): work a rank defers
        past a repeat's reply (threads, unsynchronised streams) lands in a later phase and still counts.
        """
        allowance = self.refresh_allowance() if refresh_allowance_s is None else refresh_allowance_s
        deferred = sum(max(0.0, r - allowance) for r in self.refresh_s) + self.finish_s
        total = (sum(self.repeat_s) * self.num_iters + deferred) / (self.num_iters * len(self.repeat_s))
        return max(self.median_s, total)

    def refresh_allowance(self) -> float:
        """Time an honest refresh may take: 1.5x this group's median refresh plus 5 ms (for the reference)."""
        return 1.5 * statistics.median(self.refresh_s) + 0.005 if self.refresh_s else 0.0

    @property
    def timer_disagreement(self) -> bool:
        return self.event_s is not None and abs(self.rank_clock_s - self.event_s) > 0.1 * self.rank_clock_s


def time_group(group: RankGroup, session: Session, problem: Problem, case: Case, config: EvalConfig) -> GroupTiming:
    """Drive the timing phases (pkb.runtime.timed_loop.TimedLoop), each timed with the parent's clock.

    Inputs come from the same secret seeds for reference and candidate (different from every
    correctness trial's); before every repeat but the first, the copies get new values in place.
    """
    W, timeout = config.world_size, config.timeout_s + 60
    seeds = [[(session.seed(problem.name, case.name, "time", rank, k), session.seed(problem.name, case.name, "time", k))
              for k in range(Session.MAX_TIMING_COPIES)] for rank in range(W)]
    prepared = checked(group.request([{"op": "time_prepare", "case": case.name, "precision": config.precision,
                                        "nodes": config.nodes,
                                        "seeds": seeds[rank],
                                        "protocol": config.timing.__dict__} for rank in range(W)], timeout))
    num_iters = prepared[0]["num_iters"]
    if any(reply["num_iters"] != num_iters for reply in prepared):
        raise GroupFailure(f"ranks disagree on the number of timed calls: {[r['num_iters'] for r in prepared]}")
    repeat_s, refresh_s, rank_s, event_s = [], [], [], []
    for round_index in range(config.timing.num_repeats):
        if round_index:
            began = time.monotonic()
            checked(group.request([{"op": "time_refresh", "round": round_index}] * W, timeout))
            refresh_s.append(time.monotonic() - began)
        began = time.monotonic()
        replies = checked(group.request([{"op": "time_repeat"}] * W, timeout))
        repeat_s.append((time.monotonic() - began) / num_iters)
        rank_s.append(max(reply["wall_s"] for reply in replies))
        events = [reply["event_s"] for reply in replies]
        event_s.append(max(events) if None not in events else None)
    began = time.monotonic()
    finished = checked(group.request([{"op": "time_finish"}] * W, timeout))
    finish_s = time.monotonic() - began
    sample_seed = session.seed(problem.name, case.name, "sample")
    outputs = checked(group.request([{"op": "time_outputs", "sample_seed": sample_seed}] * W, timeout))
    return GroupTiming(repeat_s=repeat_s, refresh_s=refresh_s, finish_s=finish_s, num_iters=num_iters,
                       rank_clock_s=statistics.median(rank_s),
                       event_s=statistics.median(event_s) if None not in event_s else None,
                       outputs=[reply["outputs"] for reply in outputs],
                       threads_left_running=max(reply["threads_left_running"] for reply in finished),
                       collectives_used=used(outputs))


def time_reference(session: Session, problem: Problem, case: Case, config: EvalConfig) -> GroupTiming:
    """The reference's timing on ``case`` (``per_call_s()``: seconds per call, from the parent's clock)."""
    reference = session.reference_group(problem, config.load_timeout_s)
    try:
        return time_group(reference, session, problem, case, config)
    except RankError as exc:
        raise HarnessError(f"the reference of {problem.name} failed while timed: {exc}\n"
                           f"{exc.replies[exc.rank].get('traceback', '')}") from None


def time_case(session: Session, reference: RankGroup, group: RankGroup, problem: Problem, case: Case,
               config: EvalConfig) -> CaseTiming:
    # One group at a time, so reference and candidate never share the devices while timed. A rank clock
    # that disagrees with the parent's is timed again, both groups, before it counts: a fake clock
    # disagrees every time, a passing burst of other work on the machine does not (seen in cpu mode at
    # W = 4 on 2 cores: 4 of 7 runs of an honest all-reduce once, none twice in a row).
    for attempt in (1, 2):
        expected = time_reference(session, problem, case, config)
        with candidate_failures(f"timing case {case.name}"):
            try:
                got = time_group(group, session, problem, case, config)
            except RankError as exc:
                raise_candidate_error(exc.replies, exc.rank, {"case": case.name, "trial": "timing"}, config.mode)
        reference_s = expected.per_call_s()
        candidate_s = got.per_call_s(expected.refresh_allowance())
        try:
            _check_rank_clock(got, candidate_s, case, expected)
            break
        except Verdict:
            if attempt == 2:
                raise
    check_timed_outputs(expected, got, problem, case, config)
    cost = problem.cost(case, config.world_size)
    datasheet, calibrated = session.profiles
    bound = roofline(cost, datasheet, config.world_size)
    return CaseTiming(case=case.name, reference_s=reference_s, candidate_s=candidate_s,
                      reference_spread=expected.spread, candidate_spread=got.spread,
                      speedup=reference_s / candidate_s if candidate_s > 0 else math.inf,
                      busbw_gbps=busbw_gbps(cost, candidate_s), timer_disagreement=got.timer_disagreement,
                      roofline_fraction=roofline_fraction(bound.bound_s, candidate_s) if candidate_s > 0 else None,
                      roofline_fraction_calibrated=(roofline_fraction(roofline(cost, calibrated, config.world_size).bound_s,
                                                                      candidate_s) if calibrated else None),
                      bound_by=bound.bound_by, candidate_rank_clock_s=got.rank_clock_s)


def _check_rank_clock(got: GroupTiming, parent: float, case: Case, reference: GroupTiming) -> None:
    """A rank clock that reports far less time than the parent saw pass has been tampered with.

    The parent's clock also holds a message round trip, a barrier and a synchronize per repeat
    (well under a millisecond on an idle machine): a claim under half the parent's time with over
    50 ms per repeat unaccounted for is no such overhead. The parent's time counts either way.
    A machine busy with other work (evaluations side by side) also slows the parent's clock: the
    gap counts only where it is well beyond the one the reference showed, measured the same way.
    """
    claimed = got.rank_clock_s
    reference_gap = reference.per_call_s() / reference.rank_clock_s if reference.rank_clock_s > 0 else 1.0
    if claimed * max(2.0, 2.0 * reference_gap) < parent and (parent - claimed) * got.num_iters > 0.05:
        raise Verdict(Status.TAMPERED, f"timing case {case.name}: the ranks' own clock reported {claimed * 1e6:.1f} us "
                                       f"per call while the parent observed {parent * 1e6:.1f} us",
                      case=case.name, rank_clock_s=claimed, parent_clock_s=parent)


def check_timed_outputs(expected: GroupTiming, got: GroupTiming, problem: Problem, case: Case, config: EvalConfig) -> None:
    """The outputs of the timed calls must be right too: no replayed or unfinished results while timed."""
    for rank in range(config.world_size):
        tolerance_for = functools.partial(problem.tolerance_for, case, config.world_size)
        mismatch = compare(expected.outputs[rank], got.outputs[rank], tolerance_for, "timed_out")
        if mismatch is not None:
            copy_index = mismatch.path.split("[")[1].split("]")[0] if "[" in mismatch.path else "?"
            raise Verdict(Status.MISMATCH, f"rank {rank}, case {case.name}, while timed (input copy {copy_index}): "
                                           f"{mismatch.describe()}", rank=rank, case=case.name, trial="timing",
                          mismatch=mismatch.to_dict())


def summarise_timings(result: EvalResult) -> None:
    speedups = [t.speedup for t in result.timings if t.speedup > 0 and math.isfinite(t.speedup)]
    if speedups:
        result.speedup = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
    largest = max(result.timings, key=lambda t: t.reference_s, default=None)
    result.busbw_gbps = largest.busbw_gbps if largest else None
    result.roofline_fraction = largest.roofline_fraction if largest else None
    # Faster than the machine allows: the cost model or the profile is wrong, or the result is not
    # honest (a content cache, inputs regenerated instead of moved). A label for review.
    beyond = [t.case for t in result.timings if result.times_are_gpu_performance
              and (t.roofline_fraction_calibrated or t.roofline_fraction or 0) > 1.05]
    if beyond:
        result.details["faster_than_roofline"] = beyond
