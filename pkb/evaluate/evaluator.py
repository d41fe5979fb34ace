"""Evaluate one candidate against one problem: the verdict, and with ``perf`` the timings.

Read ``evaluate`` top to bottom: static checks, load, correctness over trials and cases, timing,
verdict. Each step either returns or raises ``Verdict``; nothing the candidate's processes say is
taken as a verdict: they send data (outputs, inputs after the call, errors, times), and the
comparison and the judgement happen here, in the parent.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import secrets
import statistics
import time
from dataclasses import dataclass

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.compare import Mismatch, compare
from pkb.evaluate.result import CaseTiming, EvalResult
from pkb.problem import Case, Problem, Status
from pkb.runtime.group import GroupFailure, RankCrashed, RankGroup, RankTimeout
from pkb.runtime.modes import Mode


class HarnessError(RuntimeError):
    """pkb itself failed (a reference raised, rank processes would not start): not the candidate's fault."""


class Verdict(Exception):
    def __init__(self, status: Status, message: str, **details):
        super().__init__(message)
        self.status = status
        self.message = message
        self.details = details


@dataclass(frozen=True)
class TimingProtocol:
    """How long to time (docs/timing.md): calls per repeat are chosen so a repeat lasts ``min_repeat_s``."""

    num_warmup: int
    warmup_s: float
    num_repeats: int
    min_repeat_s: float
    min_iters: int
    max_iters: int
    cuda_graph: bool = False

    @classmethod
    def for_mode(cls, mode: Mode, cuda_graph: bool = False) -> "TimingProtocol":
        if mode is Mode.CUDA:
            return cls(num_warmup=5, warmup_s=0.5, num_repeats=7, min_repeat_s=0.1, min_iters=3, max_iters=5000,
                       cuda_graph=cuda_graph)
        # cpu / shared-gpu: finishes in seconds; the times are labelled as not GPU performance
        return cls(num_warmup=2, warmup_s=0.0, num_repeats=5, min_repeat_s=0.02, min_iters=2, max_iters=200)


@dataclass(frozen=True)
class EvalConfig:
    world_size: int
    mode: Mode
    num_trials: int = 3
    timeout_s: float = 60.0
    load_timeout_s: float = 900.0  # a first CUDA build can take minutes
    perf: bool = False
    cuda_graph: bool = False

    @property
    def timing(self) -> TimingProtocol:
        return TimingProtocol.for_mode(self.mode, self.cuda_graph)


class Session:
    """Rank groups for one (mode, world size), reused across evaluations.

    The reference group is trusted and lives as long as the session. Every candidate gets a fresh
    group; the next one is spawned while the current one works, so start-up is mostly hidden.
    The run salt behind every seed never leaves this process.
    """

    MAX_TIMING_COPIES = 64

    def __init__(self, mode: Mode, world_size: int):
        self.mode = mode
        self.world_size = world_size
        self._salt = secrets.token_bytes(32)
        self._reference: RankGroup | None = None
        self._reference_problem: str | None = None
        self._spare: RankGroup | None = None

    def seed(self, *parts) -> int:
        digest = hashlib.blake2b("|".join(map(str, parts)).encode(), key=self._salt, digest_size=8).digest()
        return int.from_bytes(digest, "little") & (2**63 - 1)

    def reference_group(self, problem: Problem, timeout: float) -> RankGroup:
        if self._reference is None or self._reference.closed:
            self._reference = RankGroup(self.mode, self.world_size, "reference").spawn()
            self._reference_problem = None
        if self._reference_problem != problem.module:
            replies = self._reference.request([{"op": "load", "problem": problem.module}] * self.world_size, timeout)
            _raise_reference_errors(replies, problem, "load")
            self._reference_problem = problem.module
        return self._reference

    def candidate_group(self) -> RankGroup:
        group = self._spare if self._spare is not None and not self._spare.closed else None
        group = group or RankGroup(self.mode, self.world_size, "candidate").spawn()
        self._spare = RankGroup(self.mode, self.world_size, "candidate").spawn()
        return group

    def close(self) -> None:
        for group in (self._reference, self._spare):
            if group is not None:
                group.close()
        self._reference = self._spare = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def evaluate(problem: Problem, candidate: Candidate, config: EvalConfig, session: Session | None = None) -> EvalResult:
    """One verdict for ``candidate`` on ``problem``; never raises for anything the candidate does."""
    own_session = session is None
    session = session or Session(config.mode, config.world_size)
    started = time.monotonic()
    result = EvalResult(problem=problem.name, problem_version=problem.version, solution=candidate.name,
                        solution_sha256=candidate.sha256, status=Status.OK, mode=config.mode.value,
                        world_size=config.world_size, num_trials=config.num_trials,
                        times_are_gpu_performance=config.mode.times_are_gpu_performance)
    try:
        _check_statically(problem, candidate, config)
        cases = problem.cases("tests", config.world_size)
        result.cases = [c.name for c in cases]
        reference = session.reference_group(problem, config.load_timeout_s)
        group = session.candidate_group()
        try:
            _load(group, problem, candidate, config)
            for trial in range(config.num_trials):
                for case in cases:
                    _check_case(session, reference, group, problem, case, trial, config)
            if config.perf:
                result.timings = [_time_case(session, reference, group, problem, case, config)
                                  for case in _perf_cases(problem, config)]
                _summarise_timings(result)
            result.message = f"all outputs match on {config.world_size} ranks, {len(cases)} cases x {config.num_trials} trials"
        finally:
            group.kill()  # a candidate's processes are never reused: no need to let them wind down
    except Verdict as verdict:
        result.status, result.message, result.details = verdict.status, verdict.message, verdict.details
    finally:
        result.wall_s = time.monotonic() - started
        if own_session:
            session.close()
    return result


def _check_statically(problem: Problem, candidate: Candidate, config: EvalConfig) -> None:
    error = candidate.syntax_error()
    if error:
        raise Verdict(Status.COMPILE_ERROR, f"syntax error: {error.splitlines()[0]}", error=error)
    missing = candidate.missing_in(config.mode)
    if missing:
        raise Verdict(Status.SKIPPED, missing)
    if config.world_size not in problem.world_sizes:
        raise Verdict(Status.SKIPPED, f"{problem.name} runs at world sizes {list(problem.world_sizes)}, "
                                      f"not {config.world_size}")
    if not problem.cases("tests", config.world_size):
        raise Verdict(Status.SKIPPED, f"{problem.name} has no test case for world size {config.world_size}")


def _load(group: RankGroup, problem: Problem, candidate: Candidate, config: EvalConfig) -> None:
    job = {"op": "load", "problem": problem.module, "candidate": None if candidate.is_reference else str(candidate.path)}
    replies = _candidate_request(group, [job] * config.world_size, config.load_timeout_s, "loading the candidate")
    for rank, reply in enumerate(replies):
        if reply.get("status") != "ok":
            status = Status(reply["status"]) if reply.get("status") in Status._value2member_map_ else Status.RUNTIME_ERROR
            first_line = (reply.get("error") or "").strip().splitlines()[-1:] or [""]
            raise Verdict(status, f"rank {rank}: {first_line[0]}", rank=rank, error=reply.get("error", ""),
                          traceback=reply.get("traceback", ""))


def _check_case(session: Session, reference: RankGroup, group: RankGroup, problem: Problem, case: Case,
                trial: int, config: EvalConfig) -> None:
    W = config.world_size
    shared = session.seed(problem.name, case.name, trial, "shared")
    jobs = [{"op": "run", "case": case.name, "seeds": (session.seed(problem.name, case.name, trial, rank), shared)}
            for rank in range(W)]
    what = f"case {case.name}, trial {trial}"
    reference.submit(jobs)
    with _candidate_failures(what):
        group.submit(jobs)
    expected = reference.collect(config.timeout_s)
    _raise_reference_errors(expected, problem, f"case {case.name}")
    with _candidate_failures(what):
        got = group.collect(config.timeout_s)
    where = {"case": case.name, "trial": trial}
    for rank in range(W):
        if got[rank].get("error"):
            _raise_candidate_error(got, rank, where)
    for rank in range(W):
        tolerance_for = lambda dtype: problem.tolerance_for(case, W, dtype)  # noqa: E731
        mismatch = compare(expected[rank]["outputs"], got[rank].get("outputs"), tolerance_for, "out")
        if mismatch is None:
            mismatch = compare(expected[rank]["inputs_after"], got[rank].get("inputs_after"), tolerance_for, "input")
            if mismatch is not None:
                mismatch = _input_mismatch(mismatch, problem)
        if mismatch is not None:
            raise Verdict(Status.MISMATCH, f"rank {rank}, case {case.name}, trial {trial}: {mismatch.describe()}",
                          rank=rank, **where, mismatch=mismatch.to_dict())


def _input_mismatch(mismatch: Mismatch, problem: Problem) -> Mismatch:
    names = problem.argument_names
    index = int(mismatch.path.split("[")[1].split("]")[0]) if "[" in mismatch.path else 0
    name = names[index] if index < len(names) else mismatch.path
    path = f"input `{name}` after the call" + mismatch.path[mismatch.path.find("]") + 1:]
    return Mismatch(**{**mismatch.to_dict(), "path": path,
                       "reason": mismatch.reason + " (it must end as the reference leaves it)"})


def _raise_candidate_error(replies: list[dict], rank: int, where: dict) -> None:
    # Report the rank that failed first, not one stuck waiting for it.
    real = [r for r, reply in enumerate(replies) if reply.get("error") and not reply.get("stuck")]
    rank = real[0] if real else rank
    reply = replies[rank]
    raise Verdict(Status.RUNTIME_ERROR, f"rank {rank}, case {where['case']}, trial {where['trial']}: {reply['error']}",
                  rank=rank, **where, error=reply["error"], traceback=reply.get("traceback", ""))


def _raise_reference_errors(replies: list[dict], problem: Problem, what: str) -> None:
    for rank, reply in enumerate(replies):
        if reply.get("error") or reply.get("status") not in (None, "ok"):
            raise HarnessError(f"the reference of {problem.name} failed on rank {rank} ({what}): "
                               f"{reply.get('error')}\n{reply.get('traceback', '')}")


def _candidate_request(group: RankGroup, jobs: list[dict], timeout: float, what: str) -> list[dict]:
    with _candidate_failures(what):
        group.submit(jobs)
        return group.collect(timeout)


@contextlib.contextmanager
def _candidate_failures(what: str):
    """Turn a candidate group's timeout or death into the verdict it earns."""
    try:
        yield
    except RankTimeout as exc:
        raise Verdict(Status.TIMEOUT, f"{what}: {exc}", rank=exc.rank, log_tail=exc.log_tail) from None
    except RankCrashed as exc:
        raise Verdict(Status.CRASH, f"{what}: {exc}", rank=exc.rank, log_tail=exc.log_tail) from None
    except GroupFailure as exc:
        raise Verdict(Status.CRASH, f"{what}: {exc}") from None


# -- timing -------------------------------------------------------------------------------------------


def _perf_cases(problem: Problem, config: EvalConfig) -> tuple[Case, ...]:
    """Benchmarks on real GPUs; the small test cases where times are not GPU performance anyway."""
    if config.mode is Mode.CUDA and problem.cases("benchmarks", config.world_size):
        return problem.cases("benchmarks", config.world_size)
    return problem.cases("tests", config.world_size)


def _timing_jobs(session: Session, problem: Problem, case: Case, config: EvalConfig, role: str) -> list[dict]:
    protocol = config.timing.__dict__
    return [{"op": "time", "case": case.name, "protocol": protocol,
             "seeds": [(session.seed(problem.name, case.name, "time", role, rank, k),
                        session.seed(problem.name, case.name, "time", role, "shared", k))
                       for k in range(Session.MAX_TIMING_COPIES)]} for rank in range(config.world_size)]


def _time_case(session: Session, reference: RankGroup, group: RankGroup, problem: Problem, case: Case,
               config: EvalConfig) -> CaseTiming:
    # One group at a time, so reference and candidate never share the devices while timed.
    ref_s, ref_spread, _ = time_reference(session, problem, case, config)
    got = _candidate_request(group, _timing_jobs(session, problem, case, config, "candidate"), config.timeout_s + 60,
                             f"timing case {case.name}")
    for rank, reply in enumerate(got):
        if reply.get("error"):
            _raise_candidate_error(got, rank, {"case": case.name, "trial": "timing"})
    cand_s, cand_spread, disagree = _per_call_seconds(got)
    link_bytes = problem.cost(case, config.world_size).link_bytes
    return CaseTiming(case=case.name, reference_s=ref_s, candidate_s=cand_s, reference_spread=ref_spread,
                      candidate_spread=cand_spread, speedup=ref_s / cand_s if cand_s > 0 else math.inf,
                      busbw_gbps=link_bytes / cand_s / 1e9 if link_bytes and cand_s > 0 else None,
                      timer_disagreement=disagree)


def time_reference(session: Session, problem: Problem, case: Case, config: EvalConfig) -> tuple[float, float, bool]:
    """The reference's seconds per call on ``case`` (median over repeats of the slowest rank), the
    spread over repeats, and whether CUDA events and the wall clock disagreed."""
    reference = session.reference_group(problem, config.load_timeout_s)
    replies = reference.request(_timing_jobs(session, problem, case, config, "reference"), config.timeout_s + 60)
    _raise_reference_errors(replies, problem, f"timing case {case.name}")
    return _per_call_seconds(replies)


def _per_call_seconds(replies: list[dict]) -> tuple[float, float, bool]:
    """Median over repeats of the slowest rank's seconds per call, the spread, and timer disagreement."""
    walls = [reply["timing"]["wall_s"] for reply in replies]
    per_repeat = [max(rank_walls[i] for rank_walls in walls) for i in range(len(walls[0]))]
    median = statistics.median(per_repeat)
    spread = (max(per_repeat) - min(per_repeat)) / median if median > 0 else 0.0
    events = [reply["timing"].get("event_s") or [] for reply in replies]
    disagree = False
    if all(events):
        event_median = statistics.median(max(e[i] for e in events) for i in range(len(events[0])))
        disagree = abs(median - event_median) > 0.1 * median
    return median, spread, disagree


def _summarise_timings(result: EvalResult) -> None:
    speedups = [t.speedup for t in result.timings if t.speedup > 0 and math.isfinite(t.speedup)]
    if speedups:
        result.speedup = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
    largest = max(result.timings, key=lambda t: t.reference_s, default=None)
    result.busbw_gbps = largest.busbw_gbps if largest else None
