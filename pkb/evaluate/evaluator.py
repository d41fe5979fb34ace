"""Evaluate one candidate against one problem: the verdict, and with ``perf`` the timings.

Read ``evaluate`` top to bottom: static checks, load, correctness over trials and cases, timing,
verdict. Each step either returns or raises ``Verdict``; nothing the candidate's processes say is
taken as a verdict: they send data (outputs, inputs after the call, errors, times), and the
comparison and the judgement happen here, in the parent.
"""

from __future__ import annotations

import contextlib
import functools
import time
import traceback

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.compare import Mismatch, compare, upstream_compare
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.result import EvalResult
from pkb.evaluate.session import Session
from pkb.evaluate.timing import perf_cases, summarise_timings, time_case
from pkb.evaluate.tripwire import scan
from pkb.evaluate.verdicts import (HarnessError, Verdict, candidate_failures, candidate_request, first_real_failure,
                                   raise_candidate_error, raise_reference_errors, skip_if_gpu_needed, used)
from pkb.options import CASE_SELECTIONS, Status
from pkb.problem import Case, Problem, Tolerance
from pkb.runtime.group import RankGroup
from pkb.runtime.guards import SYNC_ONLY
from pkb.runtime.modes import Mode
from pkb.runtime.sandbox import SandboxStatus


@contextlib.contextmanager
def _phase(phases: dict[str, float], name: str):
    """Adds the seconds the block takes to ``phases[name]`` (also when it ends with a verdict)."""
    began = time.monotonic()
    try:
        yield
    finally:
        phases[name] = round(phases.get(name, 0.0) + time.monotonic() - began, 4)


def new_result(problem: Problem, candidate: Candidate, config: EvalConfig, status: Status) -> EvalResult:
    """A result row for ``candidate`` on ``problem`` under ``config``, before anything is decided."""
    return EvalResult(problem=problem.name, problem_version=problem.version, solution=candidate.name,
                      solution_sha256=candidate.sha256, status=status, mode=config.mode.value,
                      world_size=config.world_size, precision=config.precision, num_trials=config.num_trials,
                      nodes=config.nodes or problem.nodes[0],
                      details={"solution_path": str(candidate.path) if candidate.path else None},
                      times_are_gpu_performance=config.mode.times_are_gpu_performance)


def evaluate(problem: Problem, candidate: Candidate, config: EvalConfig, session: Session | None = None) -> EvalResult:
    """One verdict for ``candidate`` on ``problem``; never raises for anything the candidate does. A
    ``session`` given must be of the run's topology (``config.on(problem).nodes`` nodes)."""
    config = config.on(problem)
    own_session = session is None
    session = session or Session(config.mode, config.world_size, config.sandbox, nodes=config.nodes)
    if session.nodes != config.nodes:
        raise ValueError(f"a session of {session.nodes} node(s) cannot run {problem.name} on {config.nodes}")
    started = time.monotonic()
    result = new_result(problem, candidate, config, Status.OK)
    result.details["sandbox"] = session.sandbox_offered.to_dict()  # until a group says what it enforced
    result.details["tripwire"] = [str(label) for label in scan(candidate.source)] if not candidate.is_reference else []
    cases = checked_cases(problem, config)
    left_out = left_out_cases(problem, config)
    upstream_checked = any(c.kind == "upstream" for c in cases)
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
            result.collectives_used = used(last)  # each reply carries everything recorded so far
            if config.perf:
                timed = perf_cases(problem, config)
                with _phase(phases, "time"):
                    result.timings = [time_case(session, reference, group, problem, case, config) for case in timed]
                    for case in timed:  # fresh inputs after timing, in the same processes: no cache survives
                        last = _check_case(session, reference, group, problem, case, "after-timing", config)
                result.collectives_used = used(last)
                summarise_timings(result)
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
    if any(c.kind == "upstream" for c in left_out):
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
    upstream = sum(c.kind == "upstream" for c in cases)
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
    upstream = tuple(c for c in cases if c.kind == "upstream")
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
    missing = candidate.missing_in(config.mode, config.nodes)
    if missing:
        raise Verdict(Status.SKIPPED, missing)
    if config.precision not in problem.precisions:
        raise Verdict(Status.SKIPPED, f"{problem.name} runs in {', '.join(problem.precisions)}, not {config.precision}: "
                                      f"{problem.precision_note}")
    if config.world_size not in problem.world_sizes:
        raise Verdict(Status.SKIPPED, f"{problem.name} runs at world sizes {list(problem.world_sizes)}, "
                                      f"not {config.world_size}")
    if not problem.runs_on(config.world_size, config.nodes):
        raise Verdict(Status.SKIPPED, f"{problem.name} runs on {' or '.join(map(str, problem.nodes))} node(s) that "
                                      f"divide the world size, not {config.nodes} at W = {config.world_size}")
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
                 for case in problem.cases(kind, config.world_size, config.precision, config.nodes))


def _load(group: RankGroup, problem: Problem, candidate: Candidate, config: EvalConfig) -> None:
    job = {"op": "load", "problem": problem.module, "candidate": None if candidate.is_reference else str(candidate.path),
           "source": None if candidate.is_reference else candidate.source}
    replies = candidate_request(group, [job] * config.world_size, config.load_timeout_s, "loading the candidate")
    failed = [rank for rank, reply in enumerate(replies) if reply.get("status") != "ok"]
    if failed:
        rank = first_real_failure(replies, failed[0])
        reply = replies[rank]
        skip_if_gpu_needed(reply, config.mode, rank)
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
    jobs = [{"op": "run", "case": case.name, "precision": config.precision, "nodes": config.nodes,
             "seeds": (session.seed(problem.name, case.name, trial, rank), shared),
             "sample_seed": sample_seed} for rank in range(W)]
    what = f"case {case.name}, trial {trial}"
    # The first call in new processes may build extensions and compile kernels (as many solutions do
    # lazily): while what it started compiles, it gets up to the time a load gets, so that the verdict does
    # not hang on how fast this machine, and whatever runs beside it, compiles. A hang compiles nothing.
    compile_limit = None if group.num_runs else config.load_timeout_s
    # the seeds follow from these and the session's salt: the reference's answer to them is kept
    key = (problem.module, problem.version, case.name, config.precision, config.nodes, trial)
    expected = session.reference_outputs.get(key)
    if expected is None:
        reference.submit(jobs)
    with candidate_failures(what, case=case.name, trial=trial):
        group.submit(jobs)
    if expected is None:
        expected = reference.collect(config.timeout_s)
        raise_reference_errors(expected, problem, f"case {case.name}")
        session.reference_outputs.put(key, expected)
    with candidate_failures(what, case=case.name, trial=trial):
        got = group.collect(config.timeout_s, compile_limit)
    for rank in range(W):
        if got[rank].get("error"):
            raise_candidate_error(got, rank, {"case": case.name, "trial": trial}, config.mode)
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


