"""Evaluate one candidate against one problem: the verdict, and with ``perf`` the timings.

Read ``evaluate`` top to bottom: static checks, load, correctness over trials and cases, timing,
verdict. Each step either returns or raises ``Verdict``; nothing the candidate's processes say is
taken as a verdict: they send data (outputs, inputs after the call, errors, times), and the
comparison and the judgement happen here, in the parent.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import secrets
import statistics
import time
import traceback
from dataclasses import dataclass

from pkb.evaluate.candidate import Candidate, gpu_needed_by
from pkb.evaluate.compare import Mismatch, compare, upstream_compare
from pkb.evaluate.result import CaseTiming, EvalResult
from pkb.evaluate.tripwire import scan
from pkb.hardware.roofline import busbw_gbps, roofline, roofline_fraction
from pkb.problem import DEFAULT_PRECISION, PRECISIONS, Case, Problem, Status, Tolerance
from pkb.protocol import UPSTREAM_TRIALS
from pkb.runtime.builds import BuildBroker
from pkb.runtime.group import GroupFailure, RankCrashed, RankGroup, RankTimeout, StartFailure
from pkb.runtime.guards import SYNC_ONLY
from pkb.runtime.modes import Mode
from pkb.runtime.sandbox import SANDBOX_LEVELS, SandboxStatus, check_sandbox, new_plan


POLICIES = ("report", "forbid-collectives")
# What `--cases` selects for the correctness trials. `all` is the upstream cases and the tests; the
# benchmark shapes are checked after they are timed (--perf), or on their own with `benchmarks`.
CASE_SELECTIONS = {"all": ("upstream", "tests"), "upstream": ("upstream",), "tests": ("tests",),
                   "benchmarks": ("benchmarks",)}


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
    policy: str = "report"  # or "forbid-collectives": stock collectives on the hot path are `forbidden`
    cases: str = "all"  # a key of CASE_SELECTIONS
    sandbox: str = "auto"  # a SANDBOX_LEVELS entry: what candidate processes run under (pkb.runtime.sandbox)
    precision: str = DEFAULT_PRECISION  # a PRECISIONS key: the dtype of the inputs upstream's factory builds
    upstream_trials: int = UPSTREAM_TRIALS  # the upstream cases run max(num_trials, this) trials (the paper's 5)

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {self.precision!r}")
        if self.sandbox not in SANDBOX_LEVELS:
            raise ValueError(f"sandbox must be one of {SANDBOX_LEVELS}, got {self.sandbox!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.cases not in CASE_SELECTIONS:
            raise ValueError(f"cases must be one of {tuple(CASE_SELECTIONS)}, got {self.cases!r}")

    @property
    def timing(self) -> TimingProtocol:
        return TimingProtocol.for_mode(self.mode, self.cuda_graph)


class Session:
    """Rank groups for one (mode, world size), reused across evaluations.

    The reference group is trusted and lives as long as the session. Every candidate gets a fresh
    group, in a sandbox of its own unless ``sandbox`` is ``off`` (``required``: SandboxUnavailable
    here unless this machine gives the full set); the next one is spawned while the current one works,
    so start-up is mostly hidden. The run salt behind every seed never leaves this process.
    """

    MAX_TIMING_COPIES = 64

    def __init__(self, mode: Mode, world_size: int, sandbox: str = "auto", broker: BuildBroker | None = None,
                 cpu_threads: int | None = None):
        self.mode = mode
        self.world_size = world_size
        self.sandbox = sandbox
        self.cpu_threads = cpu_threads  # each rank's CPU threads when sessions run side by side (None: torch's default)
        self.sandbox_offered = check_sandbox(sandbox, mode)
        # ``broker``: one shared with other sessions of this sandbox level (a source is then built once
        # for all of them, however many evaluate it at once); default: a broker of its own
        self._broker = None if sandbox == "off" else broker or new_broker(sandbox)
        self._salt = secrets.token_bytes(32)
        self._reference: RankGroup | None = None
        self._reference_problem: str | None = None
        self._spare: RankGroup | None = None
        self._current: RankGroup | None = None  # the candidate group handed out last

    def _plan_for(self, scratch: str):
        """The sandbox of one candidate group whose private directory is ``scratch``."""
        return new_plan(self.sandbox, scratch, self.world_size, cpu_mode=self.mode is Mode.CPU,
                        cache_roots=[str(self._broker.cache_root)])

    def seed(self, *parts) -> int:
        digest = hashlib.blake2b("|".join(map(str, parts)).encode(), key=self._salt, digest_size=8).digest()
        return int.from_bytes(digest, "little") & (2**63 - 1)

    def start(self, timeout: float = 120.0) -> "Session":
        """Start the reference group now and wait until its ranks are up (before any problem is loaded)."""
        if self._reference is None or self._reference.closed:
            self._reference = RankGroup(self.mode, self.world_size, "reference", cpu_threads=self.cpu_threads).spawn()
            self._reference_problem = None
        self._reference.wait_ready(timeout)
        return self

    def root_pids(self) -> list[int]:
        """The processes at the top of every rank group this session holds now (all their processes are
        below them): what its evaluations take of the machine."""
        groups = (self._reference, self._spare, self._current)
        return [pid for group in groups if group is not None and not group.closed for pid in group.root_pids()]

    def reference_group(self, problem: Problem, timeout: float) -> RankGroup:
        if self._reference is None or self._reference.closed:
            self._reference = RankGroup(self.mode, self.world_size, "reference", cpu_threads=self.cpu_threads).spawn()
            self._reference_problem = None
        if self._reference_problem != problem.module:
            replies = self._reference.request([{"op": "load", "problem": problem.module}] * self.world_size, timeout)
            _raise_reference_errors(replies, problem, "load")
            self._reference_problem = problem.module
        return self._reference

    @functools.cached_property
    def profiles(self) -> tuple:
        """(datasheet profile, calibrated profile or None) for this machine and mode."""
        from pkb.hardware.detect import choose_profile, detect

        machine = detect()
        if self.mode is Mode.CPU:
            from pkb.hardware.profiles import get_profile

            return get_profile("cpu"), None
        datasheet = choose_profile(machine, calibrated=False)
        calibrated = choose_profile(machine, calibrated=True)
        return datasheet, (calibrated if calibrated is not datasheet and calibrated.calibrated else None)

    def candidate_group(self) -> RankGroup:
        group = self._spare if self._spare is not None and not self._spare.closed else None
        group = group or self._new_candidate_group()
        self._spare = self._new_candidate_group()
        self._current = group
        return group

    def _new_candidate_group(self) -> RankGroup:
        if self.sandbox == "off":
            return RankGroup(self.mode, self.world_size, "candidate", cpu_threads=self.cpu_threads).spawn()
        return RankGroup(self.mode, self.world_size, "candidate", self._plan_for, self._broker,
                         cpu_threads=self.cpu_threads).spawn()

    def close(self) -> None:
        for group in (self._reference, self._spare):
            if group is not None:
                group.close()
        self._reference = self._spare = self._current = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def _phase(phases: dict[str, float], name: str):
    """Adds the seconds the block takes to ``phases[name]`` (also when it ends with a verdict)."""
    began = time.monotonic()
    try:
        yield
    finally:
        phases[name] = round(phases.get(name, 0.0) + time.monotonic() - began, 4)


def new_broker(sandbox: str, max_parallel: int = BuildBroker.MAX_PARALLEL) -> BuildBroker:
    """A build broker whose builds run in the sandbox of ``sandbox`` (a level other than ``off``)."""
    return BuildBroker(lambda scratch: new_plan(sandbox, scratch, 1, cpu_mode=False, cache_roots=[]),
                       max_parallel=max_parallel)


def new_result(problem: Problem, candidate: Candidate, config: EvalConfig, status: Status) -> EvalResult:
    """A result row for ``candidate`` on ``problem`` under ``config``, before anything is decided."""
    return EvalResult(problem=problem.name, problem_version=problem.version, solution=candidate.name,
                      solution_sha256=candidate.sha256, status=status, mode=config.mode.value,
                      world_size=config.world_size, precision=config.precision, num_trials=config.num_trials,
                      details={"solution_path": str(candidate.path) if candidate.path else None},
                      times_are_gpu_performance=config.mode.times_are_gpu_performance)


def evaluate(problem: Problem, candidate: Candidate, config: EvalConfig, session: Session | None = None) -> EvalResult:
    """One verdict for ``candidate`` on ``problem``; never raises for anything the candidate does."""
    own_session = session is None
    session = session or Session(config.mode, config.world_size, config.sandbox)
    started = time.monotonic()
    result = new_result(problem, candidate, config, Status.OK)
    result.details["sandbox"] = session.sandbox_offered.to_dict()  # until a group says what it enforced
    result.details["tripwire"] = [str(label) for label in scan(candidate.source)] if not candidate.is_reference else []
    cases = checked_cases(problem, config)
    left_out = left_out_cases(problem, config)
    upstream_checked = any(problem.case_kind(c.name) == "upstream" for c in cases)
    group = None
    try:
        if upstream_checked:
            result.upstream_ok = False  # until every upstream trial has passed upstream's rule
        _check_statically(problem, candidate, config)
        result.cases = [c.name for c in cases]
        if left_out:
            result.details["cases_left_out"] = {c.name: f"minutes on the CPU in {config.mode} mode; checked in cuda "
                                                        "and shared-gpu modes" for c in left_out}
        phases = result.details["phase_s"] = {}  # where the wall time went: load (import, builds), check, time
        with _phase(phases, "start"):
            reference = session.reference_group(problem, config.load_timeout_s)
            group = session.candidate_group()
        try:
            with _phase(phases, "load"):
                _load(group, problem, candidate, config)
            result.details["sandbox"] = _sandbox_of(group, session)
            with _phase(phases, "check"):
                first = _check_trials(session, reference, group, problem, candidate, cases, config, result)
                last = _check_case(session, reference, group, problem, cases[0], 0, config)
                _check_repeatable(first, last, problem, cases[0], config)
            result.collectives_used = _used(last)  # each reply carries everything recorded so far
            if config.perf:
                timed = perf_cases(problem, config)
                with _phase(phases, "time"):
                    result.timings = [_time_case(session, reference, group, problem, case, config) for case in timed]
                    for case in timed:  # fresh inputs after timing, in the same processes: no cache survives
                        last = _check_case(session, reference, group, problem, case, "after-timing", config)
                result.collectives_used = _used(last)
                _summarise_timings(result)
            _apply_policy(result, config)
            result.message = (f"all outputs match on {config.world_size} ranks: {_trials_text(problem, cases, config)}"
                              + (f" ({', '.join(c.name for c in left_out)} left out: too slow on the CPU)" if left_out else ""))
        finally:
            group.kill()  # a candidate's processes are never reused: no need to let them wind down
    except Verdict as verdict:
        result.status, result.message = verdict.status, verdict.message
        result.details.update(verdict.details)
        if verdict.status is Status.SKIPPED:
            result.upstream_ok = None
        if group is not None and group.limits_hit:  # refused by a bound of pkb's, which the verdict names
            result.details["pkb_limits"] = list(group.limits_hit)
    except Exception as exc:  # pkb's own failure (HarnessError or a bug): said so, never the candidate's verdict
        result.status = Status.HARNESS_ERROR
        result.upstream_ok = None
        result.message = f"pkb failed, not the candidate: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        result.details["error"] = traceback.format_exc(limit=-12)
        session.close()  # its rank processes may be in any state: the next evaluation starts new ones
    finally:
        result.hardware = session.profiles[0].name
        result.wall_s = time.monotonic() - started
        if own_session:
            session.close()
    _state_the_rules(result, _why_upstream_unchecked(problem, config, left_out) if not upstream_checked else None)
    return result


def _why_upstream_unchecked(problem: Problem, config: EvalConfig, left_out: tuple[Case, ...]) -> str:
    if any(problem.case_kind(c.name) == "upstream" for c in left_out):
        return f"its upstream case is left out in {config.mode} mode: minutes on the CPU"
    if "upstream" not in CASE_SELECTIONS[config.cases]:
        return f"--cases {config.cases} has no upstream case"
    return f"{problem.name} has no upstream case at world size {config.world_size}"


def _state_the_rules(result: EvalResult, upstream_unchecked: str | None) -> None:
    """Begin the message with exactly which rule passed or failed, and record it (``details["rules"]``).

    The two levels nest: pkb's verdict is ``ok`` only where upstream's rule passed too (on the upstream
    cases, when the run checks them). ``upstream_unchecked``: why the run checked no upstream case."""
    if result.status in (Status.SKIPPED, Status.HARNESS_ERROR, Status.INFRA_ERROR):
        return
    upstream = "not checked" if upstream_unchecked else "passed" if result.upstream_ok else "failed"
    only_upstream = result.details.get("rule") == "upstream"  # its own checks passed; upstream's rule did not
    result.details["rules"] = {"pkb": "passed" if result.ok else "failed", "upstream": upstream}
    if result.ok:
        said = ("ok by pkb's rule and upstream's" if upstream == "passed"
                else f"ok by pkb's rule; upstream's rule not checked ({upstream_unchecked})")
    elif only_upstream:
        said = (f"fails {UPSTREAM_RULE}, so pkb's verdict too (pkb's ok requires it), though pkb's own "
                "per-problem tolerance passed these outputs")
    elif upstream == "passed":
        said = "fails pkb's rule; upstream's rule passed on the upstream cases"
    elif upstream == "failed":
        said = "fails pkb's rule and upstream's"
    else:
        said = f"fails pkb's rule; upstream's rule not checked ({upstream_unchecked})"
    result.message = f"{said}: {result.message}"


def _trials_text(problem: Problem, cases: tuple[Case, ...], config: EvalConfig) -> str:
    """e.g. ``1 upstream case x 5 trials, 4 cases x 3 trials``."""
    upstream = sum(problem.case_kind(c.name) == "upstream" for c in cases)
    parts = []
    if upstream:
        trials = max(config.num_trials, config.upstream_trials)
        parts.append(f"{upstream} upstream case{'s' * (upstream > 1)} x {trials} trials")
    if len(cases) > upstream:
        others = len(cases) - upstream
        parts.append(f"{others} case{'s' * (others > 1)} x {config.num_trials} trials")
    return ", ".join(parts)


def _sandbox_of(group: RankGroup, session: Session) -> dict:
    """What the candidate's processes ran under; for ``required``, HarnessError unless the full set."""
    if session.sandbox == "off":
        return SandboxStatus.off().to_dict()
    status = group.sandbox_status or {"level": session.sandbox, "full": False, "enforced": [],
                                      "missing": {"all": "the ranks did not say what they enforced"}}
    if session.sandbox == "required" and not status.get("full"):
        raise HarnessError(f"--sandbox required, but the candidate's sandbox lacked: {status.get('missing')}")
    return status


def _check_trials(session: Session, reference: RankGroup, group: RankGroup, problem: Problem, candidate: Candidate,
                  cases: tuple[Case, ...], config: EvalConfig, result: EvalResult) -> list[dict]:
    """Every trial of the upstream cases, then every trial of the others; the replies to the first
    case's first trial. Raises the strict verdict's first failure.

    The upstream cases also decide the paper's verdict, ``result.upstream_ok``, by upstream's rule
    (``_check_upstream``), so a stricter failure there or later leaves it as upstream would have it."""
    upstream = tuple(c for c in cases if problem.case_kind(c.name) == "upstream")
    others = tuple(c for c in cases if c not in upstream)
    first = _check_upstream(session, reference, group, problem, candidate, upstream, config, result) if upstream else None
    for trial in range(config.num_trials):
        for case in others:
            got = _check_case(session, reference, group, problem, case, trial, config)
            if first is None:
                first = got
    return first


UPSTREAM_RULE = "upstream's rule (allclose, atol=rtol=1e-2)"


def _check_upstream(session: Session, reference: RankGroup, group: RankGroup, problem: Problem, candidate: Candidate,
                    cases: tuple[Case, ...], config: EvalConfig, result: EvalResult) -> list[dict] | None:
    """The upstream cases, ``config.upstream_trials`` trials deep (at least the run's), each output
    judged twice: by pkb's strict comparison and by upstream's rule (``compare.upstream_compare``), which
    sets ``result.upstream_ok``. The levels nest: a trial that fails upstream's rule fails pkb's verdict
    too, even where pkb's per-problem tolerance would have let it pass; the first failure of either
    rule is raised once upstream's verdict is decided.

    Upstream runs each trial in new processes. Here the trials share the candidate's processes, so a
    trial that fails upstream's rule after the processes' first call is run again in new ones (same
    inputs); that run decides the paper's verdict, as it would upstream. After a strict failure that
    left the processes unusable (a crash, a timeout, an error), the remaining trials run in new ones too.
    """
    trials = max(config.num_trials, config.upstream_trials)
    paper = result.details["upstream"] = {"rule": "upstream's outputs_match_rank_outputs (allclose, atol=rtol=1e-2)",
                                          "trials": trials, "trials_in_new_processes": 0}
    first, strict_failure, live, calls = None, None, group, 0
    for trial in range(trials):
        for case in cases:
            failure, rerun = None, live is None  # no live processes (a strict failure stopped them): new ones
            if live is not None:
                fresh = calls == 0  # the processes' first call: as new as upstream's
                try:
                    expected, got = _run_case(session, reference, live, problem, case, trial, config)
                except Verdict as verdict:
                    strict_failure, live = strict_failure or verdict, None  # its processes may be dead or stuck
                    failure = verdict
                else:
                    calls += 1
                    first = first or got
                    strict_failure = strict_failure or _strict_verdict(expected, got, problem, case, trial, config)
                    failure = _upstream_failure(expected, got, case, trial, config)
                rerun = failure is not None and not fresh
            if rerun:
                paper["trials_in_new_processes"] += 1
                failure = _upstream_trial_in_new_processes(session, reference, problem, candidate, case, trial, config)
            if failure is not None:  # upstream's verdict is decided: the candidate fails it, and so pkb's
                result.upstream_ok = False
                paper["failed"] = {"case": case.name, "trial": trial, "reason": f"{failure.status.value}: {failure.message}"}
                raise strict_failure or failure
    result.upstream_ok = True
    if strict_failure:
        raise strict_failure
    return first


def _upstream_failure(expected: list[dict], got: list[dict], case: Case, trial, config: EvalConfig) -> Verdict | None:
    """A ``mismatch`` if the outputs fail upstream's rule (every rank's, in order), or None."""
    for rank in range(config.world_size):
        mismatch = upstream_compare(expected[rank]["outputs"], got[rank].get("outputs"))
        if mismatch is not None:
            return Verdict(Status.MISMATCH, f"rank {rank}, case {case.name}, trial {trial}: {mismatch.describe()}",
                           rank=rank, case=case.name, trial=trial, mismatch=mismatch.to_dict(), rule="upstream")
    return None


def _upstream_trial_in_new_processes(session: Session, reference: RankGroup, problem: Problem, candidate: Candidate,
                                     case: Case, trial, config: EvalConfig) -> Verdict | None:
    """One upstream trial in a new candidate group, as upstream runs every trial; its failure, or None."""
    group = session.candidate_group()
    try:
        _load(group, problem, candidate, config)
        expected, got = _run_case(session, reference, group, problem, case, trial, config)
        return _upstream_failure(expected, got, case, trial, config)
    except Verdict as verdict:
        return verdict
    finally:
        group.kill()


def _apply_policy(result: EvalResult, config: EvalConfig) -> None:
    """Under ``forbid-collectives``, a solution that moved data through the stock stack is ``forbidden``."""
    moved = [label for label in result.collectives_used if label not in SYNC_ONLY]
    if config.policy == "forbid-collectives" and moved:
        raise Verdict(Status.FORBIDDEN, f"the solution called the stock stack on the hot path: {', '.join(moved)} "
                                        "(--policy forbid-collectives)", collectives_used=result.collectives_used)


def _check_statically(problem: Problem, candidate: Candidate, config: EvalConfig) -> None:
    error = candidate.syntax_error()
    if error:
        raise Verdict(Status.COMPILE_ERROR, f"syntax error: {error.splitlines()[0]}", error=error)
    missing = candidate.missing_in(config.mode)
    if missing:
        raise Verdict(Status.SKIPPED, missing)
    if config.precision not in problem.precisions:
        raise Verdict(Status.SKIPPED, f"{problem.name} runs in {', '.join(problem.precisions)}, not {config.precision}: "
                                      f"{problem.precision_note}")
    if config.world_size not in problem.world_sizes:
        raise Verdict(Status.SKIPPED, f"{problem.name} runs at world sizes {list(problem.world_sizes)}, "
                                      f"not {config.world_size}")
    if not checked_cases(problem, config):
        left_out = left_out_cases(problem, config)
        if left_out:
            raise Verdict(Status.SKIPPED, f"{problem.name}'s {config.cases} cases at world size {config.world_size} "
                                          f"({', '.join(c.name for c in left_out)}) take minutes where the reference "
                                          f"runs on the CPU: check them with --mode cuda or --mode shared-gpu")
        raise Verdict(Status.SKIPPED, f"{problem.name} has no {config.cases} case for world size {config.world_size}")


def checked_cases(problem: Problem, config: EvalConfig) -> tuple[Case, ...]:
    """The cases the correctness trials run, as ``config.cases`` selects them (without the cases that
    are too slow where the reference runs on the CPU: ``left_out_cases``)."""
    return tuple(case for case in _selected_cases(problem, config) if not _left_out(case, config))


def left_out_cases(problem: Problem, config: EvalConfig) -> tuple[Case, ...]:
    return tuple(case for case in _selected_cases(problem, config) if _left_out(case, config))


def _left_out(case: Case, config: EvalConfig) -> bool:
    """Too slow to check where the reference runs on the CPU: cpu mode (the others run it on the GPU:
    pkb.runtime.worker.Worker.call)."""
    return case.slow_on_cpu and config.mode is Mode.CPU


def _selected_cases(problem: Problem, config: EvalConfig) -> tuple[Case, ...]:
    return tuple(case for kind in CASE_SELECTIONS[config.cases]
                 for case in problem.cases(kind, config.world_size, config.precision))


def _load(group: RankGroup, problem: Problem, candidate: Candidate, config: EvalConfig) -> None:
    job = {"op": "load", "problem": problem.module, "candidate": None if candidate.is_reference else str(candidate.path),
           "source": None if candidate.is_reference else candidate.source}
    replies = _candidate_request(group, [job] * config.world_size, config.load_timeout_s, "loading the candidate")
    failed = [rank for rank, reply in enumerate(replies) if reply.get("status") != "ok"]
    if failed:
        rank = _first_real_failure(replies, failed[0])
        reply = replies[rank]
        _skip_if_gpu_needed(reply, config.mode, rank)
        status = Status(reply["status"]) if reply.get("status") in Status._value2member_map_ else Status.RUNTIME_ERROR
        first_line = (reply.get("error") or "").strip().splitlines()[-1:] or [""]
        raise Verdict(status, f"rank {rank}: {first_line[0]}", rank=rank, error=reply.get("error", ""),
                      traceback=reply.get("traceback", ""))


def _check_case(session: Session, reference: RankGroup, group: RankGroup, problem: Problem, case: Case,
                trial, config: EvalConfig) -> list[dict]:
    """Run ``case`` on both groups with this trial's seeds and compare every rank; the candidate's replies."""
    expected, got = _run_case(session, reference, group, problem, case, trial, config)
    failure = _strict_verdict(expected, got, problem, case, trial, config)
    if failure:
        raise failure
    return got


def _run_case(session: Session, reference: RankGroup, group: RankGroup, problem: Problem, case: Case,
              trial, config: EvalConfig) -> tuple[list[dict], list[dict]]:
    """Both groups' replies to ``case`` with this trial's seeds; a Verdict if the candidate failed to answer."""
    W = config.world_size
    shared = session.seed(problem.name, case.name, trial, "shared")
    sample_seed = session.seed(problem.name, case.name, trial, "sample")
    jobs = [{"op": "run", "case": case.name, "precision": config.precision,
             "seeds": (session.seed(problem.name, case.name, trial, rank), shared),
             "sample_seed": sample_seed} for rank in range(W)]
    what = f"case {case.name}, trial {trial}"
    # The first call in new processes may build extensions and compile kernels (as many solutions do
    # lazily): while what it started compiles, it gets up to the time a load gets, so that the verdict does
    # not hang on how fast this machine, and whatever runs beside it, compiles. A hang compiles nothing.
    compile_limit = None if group.num_runs else config.load_timeout_s
    reference.submit(jobs)
    with _candidate_failures(what, case=case.name, trial=trial):
        group.submit(jobs)
    expected = reference.collect(config.timeout_s)
    _raise_reference_errors(expected, problem, f"case {case.name}")
    with _candidate_failures(what, case=case.name, trial=trial):
        got = group.collect(config.timeout_s, compile_limit)
    for rank in range(W):
        if got[rank].get("error"):
            _raise_candidate_error(got, rank, {"case": case.name, "trial": trial}, config.mode)
    return expected, got


def _strict_verdict(expected: list[dict], got: list[dict], problem: Problem, case: Case, trial,
                    config: EvalConfig) -> Verdict | None:
    """pkb's comparison of every rank's outputs, then of its inputs after the call; the first failure."""
    W = config.world_size
    for rank in range(W):
        tolerance_for = functools.partial(problem.tolerance_for, case, W)
        mismatch = compare(expected[rank]["outputs"], got[rank].get("outputs"), tolerance_for, "out")
        if mismatch is None:
            mismatch = compare(expected[rank]["inputs_after"], got[rank].get("inputs_after"), tolerance_for, "input")
            if mismatch is not None:
                mismatch = _input_mismatch(mismatch, problem)
        if mismatch is not None:
            return Verdict(Status.MISMATCH, f"rank {rank}, case {case.name}, trial {trial}: {mismatch.describe()}",
                           rank=rank, case=case.name, trial=trial, mismatch=mismatch.to_dict())
    return None


def _check_repeatable(first: list[dict], again: list[dict], problem: Problem, case: Case, config: EvalConfig) -> None:
    """The same inputs twice must give the same answer: bit for bit where the problem is deterministic,
    within its tolerance otherwise. Catches reads of uninitialised or stale memory that passed once."""
    for rank in range(config.world_size):
        exact = lambda dtype: Tolerance.exact()  # noqa: E731
        tolerance_for = exact if problem.deterministic else functools.partial(problem.tolerance_for, case,
                                                                             config.world_size)
        mismatch = compare(first[rank]["outputs"], again[rank]["outputs"], tolerance_for, "out")
        if mismatch is not None:
            raise Verdict(Status.MISMATCH, f"rank {rank}, case {case.name}: a second run on the same inputs gave another "
                                           f"answer: {mismatch.describe()}", rank=rank, case=case.name, trial="repeat",
                          mismatch=mismatch.to_dict())


def _input_mismatch(mismatch: Mismatch, problem: Problem) -> Mismatch:
    names = problem.argument_names
    index = int(mismatch.path.split("[")[1].split("]")[0]) if "[" in mismatch.path else 0
    name = names[index] if index < len(names) else mismatch.path
    path = f"input `{name}` after the call" + mismatch.path[mismatch.path.find("]") + 1:]
    return Mismatch(**{**mismatch.to_dict(), "path": path,
                       "reason": mismatch.reason + " (it must end as the reference leaves it)"})


def _first_real_failure(replies: list[dict], default: int) -> int:
    """The rank to report: one that failed itself, not one cut short while it waited for (or was still
    busy beside) the rank that failed; tampering before anything else."""
    real = [r for r, reply in enumerate(replies) if reply.get("error") and not reply.get("stuck")]
    tampering = [r for r in real if replies[r].get("status") == Status.TAMPERED.value]
    return (tampering or real or [default])[0]


def _raise_candidate_error(replies: list[dict], rank: int, where: dict, mode: Mode) -> None:
    rank = _first_real_failure(replies, rank)
    reply = replies[rank]
    _skip_if_gpu_needed(reply, mode, rank)
    status = Status.TAMPERED if reply.get("status") == Status.TAMPERED.value else Status.RUNTIME_ERROR
    raise Verdict(status, f"rank {rank}, case {where['case']}, trial {where['trial']}: {reply['error']}",
                  rank=rank, **where, error=reply["error"], traceback=reply.get("traceback", ""))


def _skip_if_gpu_needed(reply: dict, mode: Mode, rank: int) -> None:
    """In a mode without a GPU, a candidate that failed because it needs one is ``skipped``, not failed."""
    if mode.uses_gpu or reply.get("status") == Status.TAMPERED.value:
        return
    evidence = gpu_needed_by(f"{reply.get('error', '')}\n{reply.get('traceback', '')}")
    if evidence:
        raise Verdict(Status.SKIPPED, f"the candidate needs a GPU (rank {rank}: {evidence}); mode {mode} has none "
                                      "(run it with --mode cuda or shared-gpu)", rank=rank, error=reply.get("error", ""))


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
def _candidate_failures(what: str, **where):
    """Turn a candidate group's timeout or death into the verdict it earns (``where``: the case and trial)."""
    try:
        yield
    except StartFailure as exc:  # before any candidate code ran
        raise HarnessError(f"{what}: {exc}\n{exc.log_tail}") from None
    except RankTimeout as exc:
        raise Verdict(Status.TIMEOUT, f"{what}: {exc}", rank=exc.rank, log_tail=exc.log_tail, **where) from None
    except RankCrashed as exc:
        raise Verdict(Status.CRASH, f"{what}: {exc}", rank=exc.rank, log_tail=exc.log_tail, **where) from None
    except GroupFailure as exc:
        raise Verdict(Status.CRASH, f"{what}: {exc}", **where) from None


# -- timing -------------------------------------------------------------------------------------------


def perf_cases(problem: Problem, config: EvalConfig) -> tuple[Case, ...]:
    """Benchmarks on real GPUs; the small test cases where times are not GPU performance anyway."""
    if config.mode is Mode.CUDA and problem.cases("benchmarks", config.world_size):
        return problem.cases("benchmarks", config.world_size, config.precision)
    return problem.cases("tests", config.world_size, config.precision)


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


def _time_group(group: RankGroup, session: Session, problem: Problem, case: Case, config: EvalConfig) -> GroupTiming:
    """Drive the timing phases (pkb.evaluate.timing.TimedLoop), each timed with the parent's clock.

    Inputs come from the same secret seeds for reference and candidate (different from every
    correctness trial's); before every repeat but the first, the copies get new values in place.
    """
    W, timeout = config.world_size, config.timeout_s + 60
    seeds = [[(session.seed(problem.name, case.name, "time", rank, k), session.seed(problem.name, case.name, "time", k))
              for k in range(Session.MAX_TIMING_COPIES)] for rank in range(W)]
    prepared = _checked(group.request([{"op": "time_prepare", "case": case.name, "precision": config.precision,
                                        "seeds": seeds[rank],
                                        "protocol": config.timing.__dict__} for rank in range(W)], timeout))
    num_iters = prepared[0]["num_iters"]
    if any(reply["num_iters"] != num_iters for reply in prepared):
        raise GroupFailure(f"ranks disagree on the number of timed calls: {[r['num_iters'] for r in prepared]}")
    repeat_s, refresh_s, rank_s, event_s = [], [], [], []
    for round_index in range(config.timing.num_repeats):
        if round_index:
            began = time.monotonic()
            _checked(group.request([{"op": "time_refresh", "round": round_index}] * W, timeout))
            refresh_s.append(time.monotonic() - began)
        began = time.monotonic()
        replies = _checked(group.request([{"op": "time_repeat"}] * W, timeout))
        repeat_s.append((time.monotonic() - began) / num_iters)
        rank_s.append(max(reply["wall_s"] for reply in replies))
        events = [reply["event_s"] for reply in replies]
        event_s.append(max(events) if None not in events else None)
    began = time.monotonic()
    finished = _checked(group.request([{"op": "time_finish"}] * W, timeout))
    finish_s = time.monotonic() - began
    sample_seed = session.seed(problem.name, case.name, "sample")
    outputs = _checked(group.request([{"op": "time_outputs", "sample_seed": sample_seed}] * W, timeout))
    return GroupTiming(repeat_s=repeat_s, refresh_s=refresh_s, finish_s=finish_s, num_iters=num_iters,
                       rank_clock_s=statistics.median(rank_s),
                       event_s=statistics.median(event_s) if None not in event_s else None,
                       outputs=[reply["outputs"] for reply in outputs],
                       threads_left_running=max(reply["threads_left_running"] for reply in finished),
                       collectives_used=_used(outputs))


def _used(replies: list[dict]) -> list[str]:
    """The union over ranks of the stock calls each reply says its rank's solution made."""
    return sorted({label for reply in replies for label in reply.get("collectives_used", [])})


def _checked(replies: list[dict]) -> list[dict]:
    """The replies, or a RankError carrying all of them if a rank reported an error."""
    failed = [rank for rank, reply in enumerate(replies) if reply.get("error") and not reply.get("stuck")]
    if failed:
        raise RankError(failed[0], replies)
    return replies


class RankError(GroupFailure):
    def __init__(self, rank: int, replies: list[dict]):
        super().__init__(f"rank {rank}: {replies[rank]['error']}", rank)
        self.replies = replies


def time_reference(session: Session, problem: Problem, case: Case, config: EvalConfig) -> GroupTiming:
    """The reference's timing on ``case`` (``per_call_s()``: seconds per call, from the parent's clock)."""
    reference = session.reference_group(problem, config.load_timeout_s)
    try:
        return _time_group(reference, session, problem, case, config)
    except RankError as exc:
        raise HarnessError(f"the reference of {problem.name} failed while timed: {exc}\n"
                           f"{exc.replies[exc.rank].get('traceback', '')}") from None


def _time_case(session: Session, reference: RankGroup, group: RankGroup, problem: Problem, case: Case,
               config: EvalConfig) -> CaseTiming:
    # One group at a time, so reference and candidate never share the devices while timed. A rank clock
    # that disagrees with the parent's is timed again, both groups, before it counts: a fake clock
    # disagrees every time, a passing burst of other work on the machine does not (seen in cpu mode at
    # W = 4 on 2 cores: 4 of 7 runs of an honest all-reduce once, none twice in a row).
    for attempt in (1, 2):
        expected = time_reference(session, problem, case, config)
        with _candidate_failures(f"timing case {case.name}"):
            try:
                got = _time_group(group, session, problem, case, config)
            except RankError as exc:
                _raise_candidate_error(exc.replies, exc.rank, {"case": case.name, "trial": "timing"}, config.mode)
        reference_s = expected.per_call_s()
        candidate_s = got.per_call_s(expected.refresh_allowance())
        try:
            _check_rank_clock(got, candidate_s, case, expected)
            break
        except Verdict:
            if attempt == 2:
                raise
    _check_timed_outputs(expected, got, problem, case, config)
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


def _check_timed_outputs(expected: GroupTiming, got: GroupTiming, problem: Problem, case: Case, config: EvalConfig) -> None:
    """The outputs of the timed calls must be right too: no replayed or unfinished results while timed."""
    for rank in range(config.world_size):
        tolerance_for = functools.partial(problem.tolerance_for, case, config.world_size)
        mismatch = compare(expected.outputs[rank], got.outputs[rank], tolerance_for, "timed_out")
        if mismatch is not None:
            copy_index = mismatch.path.split("[")[1].split("]")[0] if "[" in mismatch.path else "?"
            raise Verdict(Status.MISMATCH, f"rank {rank}, case {case.name}, while timed (input copy {copy_index}): "
                                           f"{mismatch.describe()}", rank=rank, case=case.name, trial="timing",
                          mismatch=mismatch.to_dict())


def _summarise_timings(result: EvalResult) -> None:
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
