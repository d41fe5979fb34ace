"""Timing, the parent's side (docs/timing.md): the ranks run pkb.runtime.timed_loop.TimedLoop, driven phase by
phase and timed with the parent's own clock (pkb.evaluate.ranks.Ranks.time), the reference and the candidate one
after the other; here their ranks' own clocks are checked against the parent's, the outputs of the timed calls
checked too, and the speedup, bus bandwidth and roofline fraction of each case worked out.
"""

from __future__ import annotations

import functools
import math

from pkb.evaluate.compare import compare
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.ranks import GroupTiming, Ranks
from pkb.evaluate.result import CaseTiming, EvalResult
from pkb.evaluate.session import Session
from pkb.evaluate.verdicts import Verdict
from pkb.hardware.roofline import busbw_gbps, roofline, roofline_fraction
from pkb.options import Status
from pkb.problem import Case, Problem


def perf_cases(problem: Problem, config: EvalConfig) -> tuple[Case, ...]:
    """Benchmarks on real GPUs; the small test cases where times are not GPU performance anyway."""
    if config.mode.times_are_gpu_performance and problem.cases("benchmarks", config.world_size):
        return problem.cases("benchmarks", config.world_size, config.dtype, config.nodes)
    return problem.cases("tests", config.world_size, config.dtype, config.nodes)


def time_reference(session: Session, problem: Problem, case: Case, config: EvalConfig) -> GroupTiming:
    """The reference's timing on ``case`` alone (``per_call_s()``: seconds per call, from the parent's clock): what
    ``pkb calibrate`` and ``pkb baseline`` measure."""
    return Ranks(session, problem, None, config).time_reference(case)


def time_case(ranks: Ranks, case: Case) -> CaseTiming:
    """One case timed: the reference's and the candidate's time per call, the speedup and the roofline."""
    problem, config = ranks.problem, ranks.config
    # One group at a time, so reference and candidate never share the devices while timed. A rank clock
    # that disagrees with the parent's is timed again, both groups, before it counts: a fake clock
    # disagrees every time, a passing burst of other work on the machine does not (seen in cpu mode at
    # W = 4 on 2 cores: 4 of 7 runs of an honest all-reduce once, none twice in a row).
    for attempt in (1, 2):
        expected, got = ranks.time(case)
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
    datasheet, calibrated = ranks.session.profiles
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
