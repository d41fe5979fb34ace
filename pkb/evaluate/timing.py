"""Timing, the parent's side (docs/timing.md): the ranks run pkb.runtime.timed_loop.TimedLoop, driven phase by phase
(pkb.evaluate.ranks) and timed with the parent's own clock: the reference first, with no process of the candidate's
alive, then the candidate, in processes loaded for it. Here the protocol's numbers are chosen, every timed call is
checked to have run on its own inputs, the timed outputs are judged by pkb's accuracy rule, the ranks' own clocks are
checked against the parent's, and the speedup, bus bandwidth and roofline fraction of each case worked out.

What the parent controls and checks, so that nothing a rank says changes a time:

- the number of calls per repeat is the parent's (from the reference's estimate of one call, and the memory the input
  slots may take), sent with every repeat, the same for both groups; each call has an input slot of its own;
- the values of every repeat come from entropy the parent sends with that repeat's refresh, and each call's inputs are
  changed just before it, from a second instance of its slot's inputs at rows drawn from entropy sent with the repeat
  (``Draws``; pkb.runtime.timed_loop.change_block): nothing in a rank's memory before a refresh determines the values,
  and an answer worked out ahead from the slots is wrong where the call's change wrote;
- after every repeat the parent sends a seed, and each rank returns random projections of every slot's last output
  (pkb.runtime.timed_loop.summarise): a call that did not run leaves its slot's output on the previous repeat's values,
  which the projections tell from the reference's for this repeat (``tampered``), and a wrong one is a mismatch; with
  the seed come a few slots (``FULL_PER_REPEAT``, the parent's choice after the repeat) whose outputs come back in
  full and are judged by pkb's accuracy rule against the exact answer to the same inputs, and for replicas that agree
  (``check_timed_outputs``): an answer that is less accurate only while timed fails as it would in the trials;
- every output must be plain data when its call returns (pkb.runtime.timed_loop.refusal): a tensor subclass, or a
  torch mode left active, could do the call's work when the harness first touches it, off the clock (``tampered``);
- the time per call is everything the parent's clock saw from the first repeat to the end of the last phase,
  divided by the parent's number of calls: work a rank defers past a repeat (threads, streams) lands in a later phase
  and still counts, beyond what the same phase took the reference (``GroupTiming.per_call_s``).
"""

from __future__ import annotations

import functools
import math
import random
import statistics
import traceback
from dataclasses import dataclass, field

from pkb.evaluate.accuracy import Exact, Judge, Where, within_tolerance
from pkb.evaluate.agreement import disagreement
from pkb.evaluate.cases import checked_cases
from pkb.evaluate.compare import Leaf, Mismatch, walk
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.ranks import Ranks
from pkb.evaluate.result import CaseTiming, EvalResult
from pkb.evaluate.session import Session
from pkb.evaluate.verdicts import HarnessError, Verdict
from pkb.hardware.roofline import busbw_gbps, roofline, roofline_fraction
from pkb.options import Mode, Status
from pkb.problem import PRECISIONS, Case, Problem

MAX_COPIES = 1024  # input slots, and so calls, per repeat at most (each refreshed before every repeat)
# The memory all of a rank's input slots (with their donors and their outputs) may take, per mode: on a GPU of its
# own, a CPU, or a share of one GPU. A repeat of slots that fill it lasts at least the memory's size over the device's
# bandwidth.
COPIES_BUDGET_BYTES = {Mode.CUDA: 4 << 30, Mode.SHARED_GPU: 1 << 30, Mode.CPU: 256 << 20}
NUM_PROJECTIONS = 8  # random projections of each output per slot and repeat
PROJECTION_SLACK = 0.5  # a projection may differ from the reference's by this share of the output's norm
FULL_PER_REPEAT = 2  # slots per repeat whose outputs are judged in full (by the accuracy rule, the exact answer)
EMPTY_REPEATS = 3  # repeats of no call that measure what the parent's clock holds besides the calls (the shortest)
# What an honest phase may take beyond the reference's own (``allowed``): a factor of the reference's median (or its
# longest) and seconds on top. A refresh makes inputs (the problem's make_inputs); a check and the outputs run harness
# code alone on outputs of the reference's shapes, so the candidate's take what the reference's take (docs/timing.md,
# "Deferred work", for the measurements behind these numbers).
REFRESH_ALLOWANCE = (1.5, 0.005)
CHECK_ALLOWANCE = (1.2, 0.002)


def perf_cases(problem: Problem, config: EvalConfig) -> tuple[Case, ...]:
    """The cases ``--perf`` times: the benchmark shapes on real GPUs (cuda mode); elsewhere the cases the correctness
    trials run (``--cases``), whose times are labelled as not GPU performance."""
    if config.mode.times_are_gpu_performance and problem.cases("benchmarks", config.world_size):
        return problem.cases("benchmarks", config.world_size, config.dtype, config.nodes)
    return checked_cases(problem, config) or problem.cases("tests", config.world_size, config.dtype, config.nodes)


@dataclass(frozen=True)
class Draws:
    """The parent's secret numbers for one case's timing (``attempt``: a retry draws anew), the same for both groups:
    each round's refresh entropy, the entropy of the changes before each call of its repeat, the projections' seed and
    the slots judged in full (drawn after the round's repeat), and each judged call's perturbation seed (its exact
    answer)."""

    session: Session
    problem: str
    case: str
    attempt: int = 1

    def _seed(self, *parts) -> int:
        return self.session.seed(self.problem, self.case, "time", self.attempt, *parts)

    def refresh(self, round_index: int) -> int:
        return self._seed("refresh", round_index)

    def changes(self, round_index: int) -> int:
        return self._seed("changes", round_index)

    def projections(self, round_index: int) -> int:
        return self._seed("check", round_index)

    def full(self, round_index: int, num_slots: int) -> list[int]:
        return sorted(random.Random(self._seed("full", round_index)).sample(range(num_slots),
                                                                            min(FULL_PER_REPEAT, num_slots)))

    def perturbation(self, round_index: int, slot: int) -> int:
        return self._seed("perturbation", round_index, slot)


@dataclass
class GroupTiming:
    """One group's timing of one case, from the parent's own clock unless said otherwise."""

    num_calls: int  # calls per repeat (the parent's), one per input slot
    draws: Draws  # the parent's numbers it ran on
    repeat_s: list[float] = field(default_factory=list)  # seconds per call in each repeat
    refresh_s: list[float] = field(default_factory=list)  # seconds each refresh of the input values took
    check_s: list[float] = field(default_factory=list)  # seconds each check of a repeat's outputs took
    finish_s: float = 0.0  # seconds the final synchronize (and joining leftover threads) took
    outputs_s: float = 0.0  # seconds sending the last outputs took
    rank_clocks: list[float] = field(default_factory=list)  # the slowest rank's own clock, per call, each repeat
    events: list = field(default_factory=list)  # the slowest rank's CUDA-event time per call, each repeat (or None)
    summaries: list = field(default_factory=list)  # per repeat, per rank: each slot's output summaries
    # the reference's alone: per repeat but the last, its outputs' summaries under the next repeat's projections (what
    # a call that did not run on the next repeat would show); untimed, and never sent to the candidate's ranks
    ahead: list = field(default_factory=list)
    full_slots: list = field(default_factory=list)  # per repeat: the slots whose outputs came back in full
    full: list = field(default_factory=list)  # per repeat, per rank: those slots' outputs
    outputs: list = field(default_factory=list)  # per rank: the last output of each slot
    threads_left_running: int = 0
    # the parent's clock of an empty repeat of the reference's group (the job's round trip, the aligned start and the
    # synchronize: about 1 ms on one H100), taken off every repeat of both groups, at most half of it
    overhead_s: float = 0.0

    @property
    def median_s(self) -> float:
        return statistics.median(self.repeat_s)

    @property
    def spread(self) -> float:
        return spread(self.repeat_s)

    def per_call_s(self, allowance: "GroupTiming | None" = None) -> float:
        """The median repeat, or, if larger, all the time the group took divided by its timed calls: the repeats, and
        every refresh, check, the outputs and the end beyond what the same phase took ``allowance`` (the reference;
        itself where None). Work deferred past a repeat lands in a later phase and still counts. (The end counted
        whole made a 1 GiB copy's two calls a repeat four times slower than they ran: its synchronize and message
        were a third of the whole on one H100.)"""
        deferred = sum(self.deferred_s(allowance or self).values())
        total = (sum(self.repeat_s) * self.num_calls + deferred) / (self.num_calls * len(self.repeat_s))
        return max(self.median_s, total)

    def deferred_s(self, allowance: "GroupTiming") -> dict[str, float]:
        """Seconds of each untimed phase beyond its allowance (for the report of a measurement)."""
        refresh = allowed(allowance.refresh_s, *REFRESH_ALLOWANCE)
        check = allowed(allowance.check_s, *CHECK_ALLOWANCE)
        return {"refresh": sum(max(0.0, s - refresh) for s in self.refresh_s),
                "check": sum(max(0.0, s - check) for s in self.check_s),
                "outputs": max(0.0, self.outputs_s - allowed([allowance.outputs_s], *CHECK_ALLOWANCE)),
                "finish": max(0.0, self.finish_s - allowed([allowance.finish_s], *CHECK_ALLOWANCE))}

    @property
    def rank_clock_s(self) -> float:
        """The median over repeats of the slowest rank's own clock, per call (a cross-check of the parent's)."""
        return statistics.median(self.rank_clocks)

    @property
    def event_s(self) -> float | None:
        """The median over repeats of the slowest rank's CUDA-event time per call (None off a GPU)."""
        return None if not self.events or None in self.events else statistics.median(self.events)

    @property
    def timer_disagreement(self) -> bool:
        return self.event_s is not None and abs(self.rank_clock_s - self.event_s) > 0.1 * self.rank_clock_s


def allowed(phase_s: list[float], factor: float, slack_s: float) -> float:
    """Time an honest phase may take, from the reference's (``phase_s``): ``factor`` times its median or its longest,
    whichever is more, plus ``slack_s`` seconds. Its longest says how much this machine's load stretched the phase
    while the reference was timed, and the reference never pays for its own noise."""
    return max(factor * statistics.median(phase_s), max(phase_s)) + slack_s if phase_s else 0.0


def spread(values: list[float]) -> float:
    """(max - min) / median: how far repeated measurements of one thing fall apart."""
    return (max(values) - min(values)) / statistics.median(values)


def time_reference(session: Session, problem: Problem, case: Case, config: EvalConfig) -> GroupTiming:
    """The reference's timing of ``case`` alone (``per_call_s()``: seconds per call, from the parent's clock): what
    ``pkb calibrate`` and ``pkb baseline`` measure."""
    return _time_reference(Ranks(session, problem, None, config), case)


def _time_reference(ranks: Ranks, case: Case, attempt: int = 1) -> GroupTiming:
    prepared, _ = ranks.prepare(True, case, MAX_COPIES)
    draws = Draws(ranks.session, ranks.problem.name, case.name, attempt)
    return _measure(ranks, True, num_calls(ranks.config, prepared), draws, _empty_repeat_s(ranks))


def _empty_repeat_s(ranks: Ranks) -> float:
    """The reference group's shortest of EMPTY_REPEATS repeats of no call, by the parent's clock: what the parent's
    clock holds besides the calls. Where a case's inputs are large, the memory for input copies allows only a few calls
    per repeat, and this was as long as the calls (a 1 GiB copy's two calls measured at 1.7 ms a call, 0.83 ms by the
    ranks' own clocks and CUDA events, on one H100). Only the reference's (the candidate's group is ended while the
    reference is timed): nothing in the candidate's processes can make it longer."""
    return min(ranks.repeat(True, 0, 0)[1] for _ in range(EMPTY_REPEATS))


def num_calls(config: EvalConfig, prepared: list) -> int:
    """Calls per repeat, the parent's: enough for a repeat to last ``min_repeat_s`` at the reference's pace
    (``prepared``: the reference's warm-up replies), within the protocol's bounds and the memory the reference's input
    slots may take. The candidate's group makes the same calls on copies of the same inputs."""
    protocol = config.timing
    per_call = max(reply.per_call_s for reply in prepared)
    copy_bytes = max(reply.copy_bytes for reply in prepared)
    wanted = math.ceil(protocol.min_repeat_s / max(per_call, 1e-9))
    budget = COPIES_BUDGET_BYTES[config.mode] // max(copy_bytes, 1)
    return int(max(2, min(protocol.max_iters, MAX_COPIES, budget, max(protocol.min_iters, wanted))))


def _measure(ranks: Ranks, reference: bool, calls: int, draws: Draws, overhead_s: float) -> GroupTiming:
    """One group's repeats (the reference's or the candidate's), each refreshed before and checked after; each
    repeat's time less ``overhead_s`` (``_empty_repeat_s``: the reference's), at most half of it."""
    timing = GroupTiming(calls, draws, overhead_s=overhead_s)
    ranks.copies(reference, calls)
    repeats = ranks.config.timing.num_repeats
    for round_index in range(repeats):
        timing.refresh_s.append(ranks.refresh(reference, round_index, draws.refresh(round_index))[1])
        replies, elapsed = ranks.repeat(reference, calls, draws.changes(round_index))
        timing.repeat_s.append((elapsed - min(overhead_s, elapsed / 2)) / calls)
        timing.rank_clocks.append(max(reply.wall_s for reply in replies))
        events = [reply.event_s for reply in replies]
        timing.events.append(max(events) if None not in events else None)
        full = draws.full(round_index, calls)
        checked, elapsed = ranks.check(reference, draws.projections(round_index), NUM_PROJECTIONS, full)
        timing.check_s.append(elapsed)
        timing.summaries.append([reply.summaries for reply in checked])
        timing.full_slots.append(full)
        timing.full.append([reply.outputs for reply in checked])
        if reference and round_index + 1 < repeats:
            ahead, _ = ranks.check(reference, draws.projections(round_index + 1), NUM_PROJECTIONS)
            timing.ahead.append([reply.summaries for reply in ahead])
    finished, timing.finish_s = ranks.finish(reference)
    timing.threads_left_running = max(reply.threads_left_running for reply in finished)
    outputs, timing.outputs_s = ranks.outputs(reference)
    timing.outputs = [reply.outputs for reply in outputs]
    return timing


def time_cases(ranks: Ranks, cases: tuple[Case, ...]) -> list[CaseTiming]:
    """Every case timed: the reference's and the candidate's time per call, the speedup and the roofline.

    One group at a time, and never beside the candidate's processes: the candidate's group is ended before the
    reference's timings (nothing it left running, a thread or a kernel, slows the reference down), and a new one is
    loaded to be timed (as the correctness trials ran it, in processes of its own)."""
    ranks.close()
    references = [_time_reference(ranks, case) for case in cases]
    ranks.renew()
    return [_time_candidate(ranks, case, expected) for case, expected in zip(cases, references)]


def _time_candidate(ranks: Ranks, case: Case, expected: GroupTiming) -> CaseTiming:
    """The candidate's timing of ``case``, the same calls on copies of the same inputs as the reference's
    (``expected``), checked call by call, judged, and checked against the ranks' own clocks."""
    problem, config = ranks.problem, ranks.config
    # A rank clock that disagrees with the parent's is timed again before it counts: a fake clock disagrees every
    # time, a passing burst of other work on the machine does not (seen in cpu mode at W = 4 on 2 cores: 4 of 7
    # runs of an honest all-reduce once, none twice in a row; in the full test suite on 2 cores, an honest candidate
    # that all-reduces on a second thread twice in a row, so a fake clock must disagree three times). Each retry draws
    # anew, with the reference timed again on the new draws and the candidate in new processes: the old ones have
    # seen every number of the attempt before.
    for attempt in (1, 2, 3):
        if attempt > 1:
            ranks.close()
            expected = _time_reference(ranks, case, attempt)
            ranks.renew()
        ranks.prepare(False, case, MAX_COPIES)
        got = _measure(ranks, False, expected.num_calls, expected.draws, expected.overhead_s)
        candidate_s = got.per_call_s(expected)
        _judged(lambda: check_every_call(expected, got, case), case)
        _judged(lambda: check_timed_outputs(ranks, expected, got, case), case)
        try:
            _check_rank_clock(got, got.median_s, case, expected)
            break
        except Verdict:
            if attempt == 3:
                raise
    reference_s = expected.per_call_s()
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
                      bound_by=bound.bound_by, candidate_rank_clock_s=got.rank_clock_s, calls_per_repeat=got.num_calls)


def _judged(check, case: Case) -> None:
    """Run ``check`` (a judgement of what the candidate's ranks sent while timed, which raises the Verdict it finds).
    Anything else it raises while handling that data is the candidate's failure (an output pkb could not judge),
    never pkb's; pkb's own failures (HarnessError: the reference's exact answer) stay pkb's."""
    try:
        check()
    except (Verdict, HarnessError):
        raise
    except Exception as exc:  # noqa: BLE001 - the candidate's data made the judgement fail: its failure
        raise Verdict(Status.MISMATCH, f"case {case.name}, while timed: an output pkb could not judge "
                                       f"({type(exc).__name__}: {str(exc)[:200]})", case=case.name, trial="timing",
                      error=traceback.format_exc(limit=-6)) from None


def _check_rank_clock(got: GroupTiming, parent: float, case: Case, reference: GroupTiming) -> None:
    """A rank clock that reports far less time than the parent saw pass has been tampered with: ``parent`` is the
    parent's clock of the same repeats the rank's clock measured (their median, per call), never the phases after them
    (work a thread or stream carries past a repeat counts in the candidate's time, and is no lie of its clock: an
    honest file's 20 ms a call on a thread was called tampered on a loaded machine once each repeat was timed less the
    reference's empty repeat, which took the slack the reference's round trip had given).

    The parent's clock also holds a message round trip, a barrier and a synchronize per repeat
    (well under a millisecond on an idle machine): a claim under half the parent's time with over
    50 ms per repeat unaccounted for is no such overhead. The parent's time counts either way.
    A machine busy with other work (evaluations side by side) also slows the parent's clock: the
    gap counts only where it is well beyond the one the reference showed, measured the same way.
    """
    claimed = got.rank_clock_s
    reference_gap = reference.median_s / reference.rank_clock_s if reference.rank_clock_s > 0 else 1.0
    if claimed * max(2.0, 2.0 * reference_gap) < parent and (parent - claimed) * got.num_calls > 0.05:
        raise Verdict(Status.TAMPERED, f"timing case {case.name}: the ranks' own clock reported {claimed * 1e6:.1f} us "
                                       f"per call while the parent observed {parent * 1e6:.1f} us",
                      case=case.name, rank_clock_s=claimed, parent_clock_s=parent)


def check_every_call(expected: GroupTiming, got: GroupTiming, case: Case) -> None:
    """Every timed call ran on its own inputs: after each repeat, each slot's output summaries (random projections
    chosen after the repeat) match the reference's for that repeat. One that matches the reference's of the repeat
    before (under the same projections) did not run (``tampered``: a skipped, shortened or replayed call); any other
    difference is a wrong answer while timed (``mismatch``), as is a reply of the wrong shape."""
    for round_index, (reference_round, candidate_round) in enumerate(zip(expected.summaries, got.summaries)):
        if len(candidate_round) != len(reference_round):
            raise Verdict(Status.MISMATCH, f"case {case.name}, timed repeat {round_index + 1}: {len(candidate_round)} "
                                           f"ranks' checks for {len(reference_round)} ranks", case=case.name,
                          trial="timing")
        for rank, (reference_copies, candidate_copies) in enumerate(zip(reference_round, candidate_round)):
            if not isinstance(candidate_copies, list) or len(candidate_copies) != len(reference_copies):
                raise Verdict(Status.MISMATCH, f"rank {rank}, case {case.name}, timed repeat {round_index + 1}: the "
                                               f"check sent {_count(candidate_copies)} for {len(reference_copies)} "
                                               "input slots", rank=rank, case=case.name, trial="timing")
            for copy, (want, have) in enumerate(zip(reference_copies, candidate_copies)):
                if _same_summaries(want, have):
                    continue
                before = expected.ahead[round_index - 1][rank][copy] if round_index else None
                if before is not None and _same_summaries(before, have):
                    raise Verdict(Status.TAMPERED, f"rank {rank}, case {case.name}, timed repeat {round_index + 1}: the "
                                                   f"output of input copy {copy} is the one of the repeat before, so "
                                                   "its call did not run on this repeat's inputs (a skipped, shortened "
                                                   "or replayed timed call)", rank=rank, case=case.name, trial="timing")
                raise Verdict(Status.MISMATCH, f"rank {rank}, case {case.name}, timed repeat {round_index + 1}, input copy "
                                               f"{copy}: the output differs from the reference's for the same inputs "
                                               "(by random projections of it)", rank=rank, case=case.name,
                              trial="timing")


def _count(value) -> str:
    return f"{len(value)} summaries" if isinstance(value, list) else f"a {type(value).__name__}"


def _same_summaries(want: list, have) -> bool:
    """Whether two outputs' summaries (pkb.runtime.timed_loop.summarise) agree: floating values within
    PROJECTION_SLACK of the output's norm on every projection and in norm, the same count of non-finite values;
    integers and everything else exactly. ``have`` is the candidate's word: anything malformed does not agree."""
    if not isinstance(have, list) or len(have) != len(want):
        return False
    for w, h in zip(want, have):
        if isinstance(w, list) and w and w[0] in ("int", "meta"):
            if type(h) is not list or w != h:
                return False
        elif isinstance(w, list):
            if (type(h) is not list or len(h) != len(w) or not all(_number(v) for v in h) or h[1] != w[1]):
                return False
            norm = w[0]
            slack = PROJECTION_SLACK * norm + 1e-30
            if not abs(h[0] - norm) <= slack or not all(abs(a - b) <= slack for a, b in zip(w[2:], h[2:])):
                return False
        elif type(h) is not type(w) or w != h:
            return False
    return True


def _number(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def check_timed_outputs(ranks: Ranks, expected: GroupTiming, got: GroupTiming, case: Case) -> None:
    """The timed outputs judged as the trials judge outputs: the slots the parent named after each repeat, every rank,
    by pkb's accuracy rule (pkb.evaluate.accuracy: a fresh Judge, each value against the exact answer to the inputs
    that call ran on, computed by the reference's ranks in fp64, then the aggregate tests over every judged call) and
    for replicas that agree (pkb.evaluate.agreement); then the last repeat's outputs of every slot, element by element,
    within the problem's tolerance of the reference's, and for replicas that agree."""
    problem, config = ranks.problem, ranks.config
    tolerance_for = functools.partial(problem.tolerance_for, case, config.world_size)
    judge = Judge(PRECISIONS[config.dtype])
    draws = expected.draws
    for round_index, slots in enumerate(expected.full_slots):
        for position, slot in enumerate(slots):
            exact = _timed_exact(ranks, case, draws, round_index, slot, config.timing.cuda_graph)
            want = [reply[position] for reply in expected.full[round_index]]
            have = [reply[position] for reply in got.full[round_index]]
            trial = f"timing (repeat {round_index + 1}, input copy {slot})"
            for rank in range(config.world_size):
                fetch = None if exact is None else functools.partial(lambda r: exact()[r], rank)
                found = judge.reply(Where(rank, case.name, trial), "outputs", want[rank], have[rank], tolerance_for,
                                    fetch, "out")
                if found is not None:
                    _timed_mismatch(found, case, rank)
            if not problem.replicas_may_differ:
                _timed_mismatch(disagreement(want, have, "out"), case, None, f"{trial}: ")
    _timed_mismatch(judge.pooled(), case, None, "timing: ")
    for rank in range(config.world_size):
        for leaf in walk(expected.outputs[rank], got.outputs[rank], "timed_out"):
            found = leaf if isinstance(leaf, Mismatch) else _within(leaf, problem, case, config)
            if found is not None:
                copy_index = found.path.split("[")[1].split("]")[0] if "[" in found.path else "?"
                raise Verdict(Status.MISMATCH, f"rank {rank}, case {case.name}, while timed (input copy {copy_index}): "
                                               f"{found.describe()}", rank=rank, case=case.name, trial="timing",
                              mismatch=found.to_dict())
    if not problem.replicas_may_differ:
        _timed_mismatch(disagreement(expected.outputs, got.outputs, "timed_out"), case, None, "the last timed repeat: ")


def _timed_exact(ranks: Ranks, case: Case, draws: Draws, round_index: int, slot: int, graph: bool):
    """A fetch of every rank's exact answer to one timed call (run at the first value that is not the reference's bit
    for bit, then kept); None where the trials have none either (no exact answer to the problem, a benchmark shape),
    or where the repeats replayed a CUDA graph (which changes no input between calls: the inputs are not rebuilt)."""
    if ranks.problem.exact_dtype is None or case.kind == "benchmarks" or graph:
        return None

    @functools.cache
    def fetch() -> list[Exact]:
        try:
            return ranks.timed_exact(case, slot, round_index, draws.refresh(round_index), draws.changes(round_index),
                                     draws.perturbation(round_index, slot))
        except (HarnessError, Verdict):
            raise
        except Exception as exc:  # the reference's side: pkb's failure, never the candidate's
            raise HarnessError(f"the exact answer to a timed call of case {case.name}: {type(exc).__name__}: "
                               f"{exc}") from exc
    return fetch


def _timed_mismatch(found: Mismatch | None, case: Case, rank: int | None, where: str = "") -> None:
    if found is None:
        return
    place = f"rank {rank}, " if rank is not None and f"rank {rank}" not in found.path else ""
    raise Verdict(Status.MISMATCH, f"{place}{where}while timed: {found.describe()}", rank=rank, case=case.name,
                  trial="timing", mismatch=found.to_dict())


def _within(leaf: Leaf, problem: Problem, case: Case, config: EvalConfig) -> Mismatch | None:
    import torch

    if not isinstance(leaf.expected, torch.Tensor):
        return None if leaf.expected == leaf.got else Mismatch(leaf.path, f"expected {leaf.expected!r:.80}, "
                                                                          f"got {leaf.got!r:.80}")
    return within_tolerance(leaf.expected, leaf.got, problem.tolerance_for(case, config.world_size, leaf.expected.dtype),
                            leaf.path)


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
        result.details.faster_than_roofline = beyond
