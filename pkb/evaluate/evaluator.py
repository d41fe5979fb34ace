"""Evaluate one candidate against one problem: two verdicts, and with ``perf`` the timings.

Read ``evaluate`` top to bottom: static checks, load, the paper's verdict (upstream's values and rule), pkb's verdict
(secret values, every rank, judged against the exact answer), timing. Nothing the candidate's processes say is taken
as a verdict: they send data (outputs, inputs after the call, errors, times) through pkb.evaluate.ranks, and the
comparison and the judgement happen here, in the parent.

The two verdicts are independent: ``result.status`` is pkb's (``ok`` when every check of its cases passed) and
``result.upstream_ok`` the paper's; each message says which rule passed or failed, and why in numbers where they
differ (docs/paper-protocol.md).
"""

from __future__ import annotations

import contextlib
import functools
import time
import traceback

from pkb.evaluate.accuracy import UNAVAILABLE, Accuracy, ExactAnswer
from pkb.evaluate.candidate import Candidate
from pkb.evaluate.compare import Mismatch, compare, upstream_compare
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.ranks import Ranks, Replies
from pkb.evaluate.result import EvalResult
from pkb.evaluate.session import Session
from pkb.evaluate.timing import perf_cases, summarise_timings, time_case
from pkb.evaluate.tripwire import scan
from pkb.evaluate.verdicts import Verdict
from pkb.options import CASE_SELECTIONS, Mode, Status
from pkb.problem import PRECISIONS, Case, Problem, Tolerance
from pkb.protocol import UPSTREAM_ATOL, UPSTREAM_RTOL

UPSTREAM_RULE = f"allclose atol={UPSTREAM_ATOL:g} rtol={UPSTREAM_RTOL:g} against the reference's outputs"


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
                      world_size=config.world_size, precision=config.dtype, num_trials=config.trials,
                      nodes=config.nodes or problem.nodes[0],
                      details={"solution_path": str(candidate.path) if candidate.path else None},
                      times_are_gpu_performance=config.mode.times_are_gpu_performance)


def evaluate(problem: Problem, candidate: Candidate, config: EvalConfig, session: Session | None = None) -> EvalResult:
    """Both verdicts for ``candidate`` on ``problem``; never raises for anything the candidate does. A
    ``session`` given must be of the run's topology (``config.on(problem).nodes`` nodes)."""
    config = config.on(problem)
    own_session = session is None
    session = session or Session(config.mode, config.world_size, config.sandbox, nodes=config.nodes)
    if session.nodes != config.nodes:
        raise ValueError(f"a session of {session.nodes} node(s) cannot run {problem.name} on {config.nodes}")
    started = time.monotonic()
    result = new_result(problem, candidate, config, Status.OK)
    ranks = Ranks(session, problem, candidate, config)
    result.details["sandbox"] = ranks.sandbox_offered()  # until a group says what it enforced
    result.details["tripwire"] = [str(label) for label in scan(candidate.source)] if not candidate.is_reference else []
    cases, left_out = checked_cases(problem, config), left_out_cases(problem, config)
    upstream = tuple(case for case in cases if case.kind == "upstream")
    accuracy: list[Accuracy] = []
    try:
        if upstream:
            result.upstream_ok = False  # until every upstream trial has passed upstream's rule
        _check_statically(problem, candidate, config)
        result.cases = [c.name for c in cases]
        if left_out:
            result.details["cases_left_out"] = {c.name: f"minutes on the CPU in {config.mode} mode; checked in cuda "
                                                        "and shared-gpu modes" for c in left_out}
        phases = result.details["phase_s"] = {}  # where the wall time went: load (import, builds), check, time
        with _phase(phases, "start"):
            ranks.reference
        try:
            with _phase(phases, "load"):
                ranks.start()
            result.details["sandbox"] = ranks.sandbox()
            with _phase(phases, "check"):
                if upstream:
                    _judge_paper(ranks, upstream, result)
                first = _check_trials(ranks, cases, accuracy)
                _check_repeatable(first, _check_case(ranks, cases[0], 0, accuracy), ranks, cases[0])
            result.collectives_used = ranks.used  # each reply carries everything recorded so far
            if config.perf:
                timed = perf_cases(problem, config)
                with _phase(phases, "time"):
                    result.timings = [time_case(ranks, case) for case in timed]
                    for case in timed:  # fresh inputs after timing, in the same processes: no cache survives
                        _check_case(ranks, case, "after-timing", accuracy)
                result.collectives_used = ranks.used
                summarise_timings(result)
            _apply_policy(result, ranks)
            result.message = (f"{_accuracy_text(accuracy)} on {config.world_size} ranks: "
                              f"{_trials_text(cases, config)}"
                              + (f" ({', '.join(c.name for c in left_out)} left out: too slow on the CPU)" if left_out else ""))
        finally:
            ranks.close()
    except Verdict as verdict:
        result.status, result.message = verdict.status, verdict.message
        result.details.update(verdict.details)
        if verdict.status is Status.SKIPPED:
            result.upstream_ok = None
        if ranks.limits_hit:  # refused by a bound of pkb's, which the verdict names
            result.details["pkb_limits"] = ranks.limits_hit
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
    if accuracy:
        result.details["accuracy"] = _accuracy_summary(accuracy)
    _state_the_rules(result, _why_upstream_unchecked(problem, config, left_out) if not upstream else None)
    return result


def _why_upstream_unchecked(problem: Problem, config: EvalConfig, left_out: tuple[Case, ...]) -> str:
    if any(c.kind == "upstream" for c in left_out):
        return f"its upstream case is left out in {config.mode} mode: minutes on the CPU"
    if "upstream" not in CASE_SELECTIONS[config.cases]:
        return f"--cases {config.cases} has no upstream case"
    return f"{problem.name} has no upstream case at world size {config.world_size}"


def _state_the_rules(result: EvalResult, upstream_unchecked: str | None) -> None:
    """Begin the message with both verdicts, and why where they differ; record them (``details["rules"]``).

    pkb's (``status``) and the paper's (``upstream_ok``) are independent: each may pass where the other fails.
    ``upstream_unchecked``: why the run checked no upstream case."""
    if result.status in (Status.SKIPPED, Status.HARNESS_ERROR, Status.INFRA_ERROR):
        return
    paper = result.details.get("upstream", {})
    upstream = "not checked" if upstream_unchecked else "passed" if result.upstream_ok else "failed"
    result.details["rules"] = {"pkb": "passed" if result.ok else "failed", "upstream": upstream}
    if upstream == "passed":
        theirs = f"ok by the paper's (upstream's inputs and rule: {UPSTREAM_RULE}, {paper.get('trials')} trials)"
    elif upstream == "failed" and paper.get("failed"):
        failed = paper["failed"]
        theirs = f"fails the paper's (upstream's inputs, trial {failed['trial']}: {failed['reason']})"
    elif upstream == "failed":
        theirs = "fails the paper's too (the candidate did not load)"
    else:
        theirs = f"the paper's not checked ({upstream_unchecked})"
    ours = "ok by pkb's rule" if result.ok else "fails pkb's rule"
    result.message = f"{ours}; {theirs}. pkb's: {result.message}"


def _trials_text(cases: tuple[Case, ...], config: EvalConfig) -> str:
    """e.g. ``5 cases x 3 trials (1 upstream case also x 5 trials on upstream's inputs)``."""
    upstream = sum(c.kind == "upstream" for c in cases)
    text = f"{len(cases)} case{'s' * (len(cases) > 1)} x {config.trials} trials"
    if upstream:
        text += (f" on pkb's secret inputs; {upstream} upstream case{'s' * (upstream > 1)} x {config.upstream_trials} "
                 "trials on upstream's")
    return text


def _accuracy_text(accuracy: list[Accuracy]) -> str:
    """How accurate the outputs were, in a few words: e.g. ``RMS error at most 1.02x the reference's``."""
    if not accuracy:
        return "all outputs the reference's bit for bit (or exact where the problem wants them exact)"
    worst = max(accuracy, key=lambda a: a.rms_ratio)
    return (f"all outputs within pkb's accuracy rule against the exact answer (RMS error at most "
            f"{worst.rms_ratio:.2f}x the reference's, at {worst.path})")


def _accuracy_summary(accuracy: list[Accuracy]) -> dict:
    """``details["accuracy"]``: how many tensors were judged against the exact answer, and the least accurate."""
    worst = max(accuracy, key=lambda a: a.rms_ratio)
    return {"tensors_judged": len(accuracy), "worst": worst.to_dict(),
            "largest_bias": max((abs(a.bias) for a in accuracy), default=0.0)}


# -- the paper's verdict ----------------------------------------------------------------------------------------


def _judge_paper(ranks: Ranks, cases: tuple[Case, ...], result: EvalResult) -> None:
    """The paper's verdict, ``result.upstream_ok``: upstream's values of the upstream cases (its constants, its seeds,
    its draws: ``Problem.upstream_values``), ``config.upstream_trials`` trials (upstream's 5), every rank's outputs
    against the reference's by upstream's rule (``compare.upstream_compare``); the first trial that fails decides,
    as upstream stops at it. Never raises for the candidate: a crash, a timeout or an error fails this verdict
    alone, and pkb's goes on in new processes.

    Upstream runs each trial in new processes. Here the trials share the candidate's processes, so a trial that
    fails after the processes' first call is run again in new ones (the same inputs), and that run decides, as it
    would upstream."""
    paper = result.details["upstream"] = {"rule": f"upstream's outputs_match_rank_outputs: {UPSTREAM_RULE}",
                                          "inputs": "upstream's (its constants and seeds)",
                                          "trials": ranks.config.upstream_trials, "trials_in_new_processes": 0}
    for trial in range(ranks.config.upstream_trials):
        for case in cases:
            fresh = ranks.fresh
            failure = _paper_trial(ranks, case, trial)
            if failure is not None and not fresh:
                paper["trials_in_new_processes"] += 1
                failure = _paper_trial(ranks, case, trial, renew=True)
            if failure is not None:
                result.upstream_ok = False
                paper["failed"] = {"case": case.name, "trial": trial, "status": failure.status.value,
                                   "reason": failure.message}
                return
    result.upstream_ok = True


def _paper_trial(ranks: Ranks, case: Case, trial: int, renew: bool = False) -> Verdict | None:
    """Why one trial of an upstream case fails upstream's rule (a mismatch, or what the candidate's processes
    earned), or None. ``renew``: in new processes."""
    try:
        if renew:
            ranks.renew()
        replies = ranks.run_upstream(case, trial)
    except Verdict as verdict:
        ranks.close()  # its processes may be dead or stuck: the next step starts new ones
        return verdict
    for rank in range(ranks.config.world_size):
        mismatch = upstream_compare(replies.expected[rank]["outputs"], replies.got[rank].get("outputs"))
        if mismatch is not None:
            return Verdict(Status.MISMATCH, f"rank {rank}, case {case.name}: {mismatch.describe()}", rank=rank,
                           mismatch=mismatch.to_dict())
    return None


# -- pkb's verdict ----------------------------------------------------------------------------------------------


def _check_trials(ranks: Ranks, cases: tuple[Case, ...], accuracy: list[Accuracy]) -> Replies:
    """Every trial of every case on pkb's secret values; the replies to the first case's first trial. Raises
    the first failure."""
    first = None
    for trial in range(ranks.config.trials):
        for case in cases:
            replies = _check_case(ranks, case, trial, accuracy)
            first = first or replies
    return first


def _check_case(ranks: Ranks, case: Case, trial, accuracy: list[Accuracy]) -> Replies:
    """Run ``case`` on both groups with this trial's seeds and judge every rank; the replies."""
    replies = ranks.run(case, trial)
    failure = _strict_verdict(ranks, replies, case, trial, accuracy)
    if failure:
        raise failure
    return replies


def _strict_verdict(ranks: Ranks, replies: Replies, case: Case, trial, accuracy: list[Accuracy]) -> Verdict | None:
    """pkb's judgement of every rank's outputs, then of its inputs after the call: against the exact answer where
    the problem has one (pkb.evaluate.accuracy), by the tolerance against the reference's otherwise (and on the
    benchmark shapes, which an exact answer in fp64 would double or quadruple); the first failure."""
    problem, config = ranks.problem, ranks.config
    tolerance_for = functools.partial(problem.tolerance_for, case, config.world_size)
    exact = _exact_answers(ranks, case, trial, accuracy)
    for rank in range(config.world_size):
        expected, got = replies.expected[rank], replies.got[rank]
        mismatch = compare(expected["outputs"], got.get("outputs"), tolerance_for, "out",
                           exact and exact[rank].child("outputs"))
        if mismatch is None:
            mismatch = compare(expected["inputs_after"], got.get("inputs_after"), tolerance_for, "input",
                               exact and exact[rank].child("inputs_after"))
            if mismatch is not None:
                mismatch = _input_mismatch(mismatch, problem)
        if mismatch is not None:
            return Verdict(Status.MISMATCH, f"rank {rank}, case {case.name}, trial {trial}: {mismatch.describe()}",
                           rank=rank, case=case.name, trial=trial, mismatch=mismatch.to_dict())
    return None


def _exact_answers(ranks: Ranks, case: Case, trial, accuracy: list[Accuracy]) -> list[ExactAnswer] | None:
    """Each rank's exact answer to ``case`` and ``trial``, run only when a value is not the reference's bit for bit;
    None where the problem has none (``Problem.exact_dtype``) or for a benchmark shape."""
    if ranks.problem.exact_dtype is None or case.kind == "benchmarks":
        return None
    fetch = functools.cache(lambda: ranks.exact(case, trial))
    run_dtype = PRECISIONS[ranks.config.dtype]

    def answer(rank: int):
        reply = fetch()[rank]
        return UNAVAILABLE if reply.get("exact_unavailable") else reply

    return [ExactAnswer(functools.partial(answer, rank), run_dtype, accuracy, f"rank {rank}, case {case.name}, "
                        f"trial {trial}") for rank in range(ranks.config.world_size)]


def _check_repeatable(first: Replies, again: Replies, ranks: Ranks, case: Case) -> None:
    """The same inputs twice must give the same answer: bit for bit where the problem is deterministic,
    within its tolerance otherwise. Catches reads of uninitialised or stale memory that passed once."""
    problem = ranks.problem
    exact = lambda dtype: Tolerance.exact()  # noqa: E731
    tolerance_for = exact if problem.deterministic else functools.partial(problem.tolerance_for, case,
                                                                         ranks.config.world_size)
    for rank in range(ranks.config.world_size):
        mismatch = compare(first.got[rank]["outputs"], again.got[rank]["outputs"], tolerance_for, "out")
        if mismatch is not None:
            raise Verdict(Status.MISMATCH, f"rank {rank}, case {case.name}: a second run on the same inputs gave another "
                                           f"answer: {mismatch.describe()}", rank=rank, case=case.name, trial="repeat",
                          mismatch=mismatch.to_dict())


def _apply_policy(result: EvalResult, ranks: Ranks) -> None:
    """Under ``forbid-collectives``, a solution that moved data through the stock stack inside a node is
    ``forbidden`` (across nodes torch.distributed is the network: allowed)."""
    moved = ranks.moved_inside_a_node(result.collectives_used)
    if ranks.config.policy == "forbid-collectives" and moved:
        raise Verdict(Status.FORBIDDEN, f"the solution called the stock stack on the hot path: {', '.join(moved)} "
                                        "(--policy forbid-collectives)", collectives_used=result.collectives_used)


def _check_statically(problem: Problem, candidate: Candidate, config: EvalConfig) -> None:
    error = candidate.syntax_error()
    if error:
        raise Verdict(Status.COMPILE_ERROR, f"syntax error: {error.splitlines()[0]}", error=error)
    missing = candidate.missing_in(config.mode, config.nodes)
    if missing:
        raise Verdict(Status.SKIPPED, missing)
    if config.dtype not in problem.precisions:
        raise Verdict(Status.SKIPPED, f"{problem.name} runs in {', '.join(problem.precisions)}, not {config.dtype}: "
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
                 for case in problem.cases(kind, config.world_size, config.dtype, config.nodes))


def _input_mismatch(mismatch: Mismatch, problem: Problem) -> Mismatch:
    names = problem.argument_names
    index = int(mismatch.path.split("[")[1].split("]")[0]) if "[" in mismatch.path else 0
    name = names[index] if index < len(names) else mismatch.path
    path = f"input `{name}` after the call" + mismatch.path[mismatch.path.find("]") + 1:]
    return Mismatch(**{**mismatch.to_dict(), "path": path,
                       "reason": mismatch.reason + " (it must end as the reference leaves it)"})


