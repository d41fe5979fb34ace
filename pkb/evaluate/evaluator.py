"""Evaluate one candidate against one problem: two verdicts, and with ``perf`` the timings.

Read ``evaluate`` top to bottom: static checks, load, the paper's verdict (upstream's values and rule: paper.py),
pkb's verdict (secret values, every rank, every value judged by its rule: accuracy.py; replicas that agree:
agreement.py), timing (timing.py). Nothing the candidate's processes say is taken as a verdict: they send data
(outputs, inputs after the call, errors, times) through pkb.evaluate.ranks, and the comparison, the judgement and
every status are decided here, in the parent (failures.py says which status a failure earns, from what the parent
observes itself).

The two verdicts are independent: ``result.status`` is pkb's (``ok`` when every check of its cases passed) and
``result.upstream_ok`` the paper's; each message says which rule passed or failed, and why in numbers where they
differ (docs/paper-protocol.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import traceback

from pkb.evaluate.accuracy import Judge, Where, same_answer
from pkb.evaluate.agreement import disagreement
from pkb.evaluate.candidate import Candidate
from pkb.evaluate.cases import checked_cases, left_out_cases
from pkb.evaluate.compare import Mismatch
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.failures import SKIPPED_BY_CANDIDATE, SKIPPED_BY_RUN
from pkb.evaluate.paper import UPSTREAM_RULE, PaperVerdict, judge_paper
from pkb.evaluate.ranks import Ranks, Replies
from pkb.evaluate.result import Details, EvalResult
from pkb.evaluate.session import Session
from pkb.evaluate.timing import perf_cases, summarise_timings, time_cases
from pkb.evaluate.tripwire import scan
from pkb.evaluate.verdicts import Verdict
from pkb.options import CASE_SELECTIONS, Status
from pkb.problem import PRECISIONS, Case, Problem


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
                      details=Details(solution_path=str(candidate.path) if candidate.path else None),
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
    judge = Judge(PRECISIONS[config.dtype], recipe=problem.exact_dtype is None)
    result.details.sandbox = ranks.sandbox_offered()  # until a group says what it enforced
    result.details.tripwire = [str(label) for label in scan(candidate.source)] if not candidate.is_reference else []
    cases, left_out = checked_cases(problem, config), left_out_cases(problem, config)
    upstream = tuple(case for case in cases if case.kind == "upstream")
    try:
        _check_statically(problem, candidate, config)
        result.cases = [c.name for c in cases]
        if left_out:
            result.details.cases_left_out = {c.name: f"minutes on the CPU in {config.mode} mode; checked in cuda "
                                                        "and shared-gpu modes" for c in left_out}
        phases = result.details.phase_s  # where the wall time went: load (import, builds), check, time
        with _phase(phases, "start"):
            ranks.reference
        try:
            if upstream:
                result.upstream_ok = False  # until every upstream trial has passed upstream's rule
            with _phase(phases, "load"):
                ranks.start()
            result.details.sandbox = ranks.sandbox()
            with _phase(phases, "check"):
                if upstream:
                    paper = judge_paper(ranks, upstream)
                    _record_paper(result, paper)
                    if paper.timeout is not None:  # a hang is found once: pkb's verdict takes it too
                        raise paper.timeout
                first = _check_trials(ranks, cases, judge)
                _check_repeatable(first, ranks.run(cases[0], 0), ranks, cases[0])
            result.collectives_used = ranks.used
            if config.perf:
                timed = perf_cases(problem, config)
                with _phase(phases, "time"):
                    result.timings = time_cases(ranks, timed)
                    for case in timed:  # fresh inputs after timing, in the same processes: no cache survives
                        _check_case(ranks, case, "after-timing", judge)
                result.collectives_used = sorted(set(result.collectives_used) | set(ranks.used))  # new processes
                summarise_timings(result)
            _judged(judge.pooled, "an output of all the ranks and trials")
            _apply_policy(result, ranks)
            result.message = (f"{judge.text()} on {config.world_size} ranks: {_trials_text(cases, config)}"
                              + (f" ({', '.join(c.name for c in left_out)} left out: too slow on the CPU)" if left_out else ""))
        finally:
            ranks.close()
    except Verdict as verdict:
        result.status, result.message = verdict.status, verdict.message
        result.details = dataclasses.replace(result.details, **verdict.details)
        if verdict.status is Status.SKIPPED:
            result.upstream_ok = None
            result.details.skipped_by = result.details.skipped_by or SKIPPED_BY_CANDIDATE  # unless the run caused it
        result.details.pkb_limits = [*result.details.pkb_limits, *ranks.limits_hit]  # bounds of pkb's the verdict names
    except Exception as exc:  # pkb's own failure (HarnessError or a bug): said so, never the candidate's verdict
        result.status = Status.HARNESS_ERROR
        result.upstream_ok = None
        result.message = f"pkb failed, not the candidate: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        result.details.error = traceback.format_exc(limit=-12)
        session.close()  # its rank processes may be in any state: the next evaluation starts new ones
    finally:
        result.hardware = session.profiles[0].name
        result.wall_s = time.monotonic() - started
        if own_session:
            session.close()
    result.details.accuracy = judge.summary()
    _state_the_rules(result, _why_upstream_unchecked(problem, config, left_out) if not upstream else None)
    return result


def _record_paper(result: EvalResult, paper: PaperVerdict) -> None:
    result.upstream_ok = paper.ok
    result.details.upstream = paper.to_dict()


def _why_upstream_unchecked(problem: Problem, config: EvalConfig, left_out: tuple[Case, ...]) -> str:
    if any(c.kind == "upstream" for c in left_out):
        return f"its upstream case is left out in {config.mode} mode: minutes on the CPU"
    if "upstream" not in CASE_SELECTIONS[config.cases]:
        return f"--cases {config.cases} has no upstream case"
    return f"{problem.name} has no upstream case at world size {config.world_size}"


def _state_the_rules(result: EvalResult, upstream_unchecked: str | None) -> None:
    """Begin the message with both verdicts, and why where they differ; record them (``details.rules``).

    pkb's (``status``) and the paper's (``upstream_ok``) are independent: each may pass where the other fails.
    ``upstream_unchecked``: why the run checked no upstream case."""
    if result.status in (Status.SKIPPED, Status.HARNESS_ERROR, Status.INFRA_ERROR):
        return
    paper = result.details.upstream or {}
    upstream = "not checked" if upstream_unchecked else "passed" if result.upstream_ok else "failed"
    result.details.rules = {"pkb": "passed" if result.ok else "failed", "upstream": upstream}
    if upstream == "passed":
        trials = paper.get("trials")
        theirs = f"ok by the paper's (upstream's inputs and rule: {UPSTREAM_RULE}, {trials} trial{'s' * (trials != 1)})"
    elif upstream == "failed" and paper.get("failed"):
        failed = paper["failed"]
        same = failed["status"] == result.status.value and failed["reason"] in result.message
        theirs = "fails the paper's too (the same failure)" if same else f"fails the paper's ({failed['reason']})"
    elif upstream == "failed":
        theirs = "fails the paper's too (the candidate did not load)"
    else:
        theirs = f"the paper's not checked ({upstream_unchecked})"
    ours = "ok by pkb's rule" if result.ok else "fails pkb's rule"
    result.message = f"{ours}; {theirs}. pkb's: {result.message}"


def _trials_text(cases: tuple[Case, ...], config: EvalConfig) -> str:
    """e.g. ``5 cases x 3 trials on pkb's secret inputs; 1 upstream case x 5 trials on upstream's``."""
    upstream = sum(c.kind == "upstream" for c in cases)
    text = f"{len(cases)} case{'s' * (len(cases) > 1)} x {config.trials} trial{'s' * (config.trials != 1)}"
    if upstream:
        text += (f" on pkb's secret inputs; {upstream} upstream case{'s' * (upstream > 1)} x {config.upstream_trials} "
                 f"trial{'s' * (config.upstream_trials != 1)} on upstream's")
    return text


# -- pkb's verdict ----------------------------------------------------------------------------------------------


def _check_trials(ranks: Ranks, cases: tuple[Case, ...], judge: Judge) -> Replies:
    """Every trial of every case on pkb's secret values; the replies to the first case's first trial. Raises
    the first failure."""
    first = None
    for trial in range(ranks.config.trials):
        for case in cases:
            replies = _check_case(ranks, case, trial, judge)
            first = first or replies
    return first


def _check_case(ranks: Ranks, case: Case, trial, judge: Judge) -> Replies:
    """Run ``case`` on both groups with this trial's seeds and judge every rank, then the replicas; the replies."""
    replies = ranks.run(case, trial)
    _judged(lambda: _strict_verdict(ranks, replies, case, trial, judge), f"case {case.name}, trial {trial}")
    return replies


def _judged(check, where: str) -> None:
    """Run ``check`` (a judgement of replies, which raises the Verdict it finds; a Mismatch it returns becomes one).
    Anything else it raises while handling what a rank sent is the candidate's failure (an output pkb could not
    judge), never pkb's."""
    try:
        mismatch = check()
    except Verdict:
        raise
    except Exception as exc:  # noqa: BLE001 - the candidate's data made the judgement fail: its failure
        raise Verdict(Status.MISMATCH, f"{where}: an output pkb could not judge ({type(exc).__name__}: "
                                       f"{str(exc)[:200]})", error=traceback.format_exc(limit=-6)) from None
    if mismatch is not None:
        raise Verdict(Status.MISMATCH, mismatch.describe(), mismatch=mismatch.to_dict())


def _strict_verdict(ranks: Ranks, replies: Replies, case: Case, trial, judge: Judge) -> None:
    """pkb's judgement of every rank's outputs, then of its inputs after the call (accuracy.py decides each value's
    rule), then whether the candidate's replicas agree where the reference's do; raises the first failure."""
    problem, config = ranks.problem, ranks.config
    tolerance_for = functools.partial(problem.tolerance_for, case, config.world_size)
    exact = _exact_answers(ranks, case, trial)
    for rank in range(config.world_size):
        where = Where(rank, case.name, trial)
        fetch = None if exact is None else functools.partial(lambda r: exact()[r], rank)
        expected, got = replies.expected[rank], replies.got[rank]
        mismatch = judge.reply(where, "outputs", expected.outputs, got.outputs, tolerance_for, fetch, "out")
        if mismatch is None:
            mismatch = judge.reply(where, "inputs_after", expected.inputs_after, got.inputs_after, tolerance_for, fetch,
                                   "input")
            mismatch = mismatch and _input_mismatch(mismatch, problem)
        if mismatch is not None:
            _fail(_placed(mismatch, where), rank=rank, case=case.name, trial=trial)
    if problem.replicas_may_differ:
        return
    for part, prefix in (("outputs", "out"), ("inputs_after", "input")):
        exact_part = None if exact is None else functools.partial(_exact_part, exact, part)
        found = disagreement([getattr(r, part) for r in replies.expected], [getattr(r, part) for r in replies.got], prefix,
                             exact_part)
        if found is not None:
            found = found if part == "outputs" else _input_mismatch(found, problem)
            _fail(_placed(found, f"case {case.name}, trial {trial}"), case=case.name, trial=trial)


def _exact_part(exact, part: str) -> list | None:
    """Every rank's exact answer to ``part`` of its reply, or None where a rank has none."""
    answers = exact()
    if any(answer.unavailable is not None for answer in answers):
        return None
    return [getattr(answer, part) for answer in answers]


def _fail(mismatch: Mismatch, **where) -> None:
    raise Verdict(Status.MISMATCH, mismatch.describe(), **where, mismatch=mismatch.to_dict())


def _placed(mismatch: Mismatch, where) -> Mismatch:
    """``mismatch`` with where it was found in its path (unless it says so already)."""
    if str(where) in mismatch.path or "case " in mismatch.path:
        return mismatch
    return Mismatch(**{**mismatch.to_dict(), "path": f"{where}: {mismatch.path}"})


def _exact_answers(ranks: Ranks, case: Case, trial):
    """A fetch of every rank's exact answer to ``case`` and ``trial`` (run at the first value that is not the
    reference's bit for bit, then kept); None where the problem has none (a recipe: judged against the reference's
    output)."""
    if ranks.problem.exact_dtype is None:
        return None
    return functools.cache(lambda: ranks.exact(case, trial))


def _check_repeatable(first: Replies, again: Replies, ranks: Ranks, case: Case) -> None:
    """The same inputs twice must give the same answer: bit for bit where the problem is deterministic,
    within its tolerance otherwise. Catches reads of uninitialised or stale memory that passed once."""
    problem = ranks.problem
    tolerance_for = functools.partial(problem.tolerance_for, case, ranks.config.world_size)
    for rank in range(ranks.config.world_size):
        def check(rank=rank):
            return same_answer(first.got[rank].outputs, again.got[rank].outputs, tolerance_for, problem.deterministic)
        try:
            mismatch = check()
        except Exception as exc:  # noqa: BLE001 - the candidate's data made the comparison fail: its failure
            mismatch = Mismatch("out", f"an output pkb could not compare ({type(exc).__name__})")
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
                                        "(--policy forbid-collectives)")


def _check_statically(problem: Problem, candidate: Candidate, config: EvalConfig) -> None:
    error = candidate.syntax_error()
    if error:
        raise Verdict(Status.COMPILE_ERROR, f"syntax error: {error.splitlines()[0]}", error=error)
    missing = candidate.missing_in(config.mode, config.nodes)
    if missing:
        raise Verdict(Status.SKIPPED, missing, skipped_by=SKIPPED_BY_CANDIDATE)
    if config.dtype not in problem.precisions:
        raise Verdict(Status.SKIPPED, f"{problem.name} runs in {', '.join(problem.precisions)}, not {config.dtype}: "
                                      f"{problem.precision_note}", skipped_by=SKIPPED_BY_RUN)
    if config.world_size not in problem.world_sizes:
        raise Verdict(Status.SKIPPED, f"{problem.name} runs at world sizes {list(problem.world_sizes)}, "
                                      f"not {config.world_size}", skipped_by=SKIPPED_BY_RUN)
    if not problem.runs_on(config.world_size, config.nodes):
        raise Verdict(Status.SKIPPED, f"{problem.name} runs on {' or '.join(map(str, problem.nodes))} node(s) that "
                                      f"divide the world size, not {config.nodes} at W = {config.world_size}",
                      skipped_by=SKIPPED_BY_RUN)
    if not checked_cases(problem, config):
        left_out = left_out_cases(problem, config)
        if left_out:
            raise Verdict(Status.SKIPPED, f"{problem.name}'s {config.cases} cases at world size {config.world_size} "
                                          f"({', '.join(c.name for c in left_out)}) take minutes where the reference "
                                          f"runs on the CPU: check them with --mode cuda or --mode shared-gpu",
                          skipped_by=SKIPPED_BY_RUN)
        raise Verdict(Status.SKIPPED, f"{problem.name} has no {config.cases} case for world size {config.world_size}",
                      skipped_by=SKIPPED_BY_RUN)


def _input_mismatch(mismatch: Mismatch, problem: Problem) -> Mismatch:
    names = problem.argument_names
    path = mismatch.path
    head, _, rest = path.partition("input[")
    if not rest:
        return mismatch
    index_text, _, tail = rest.partition("]")
    index = int(index_text) if index_text.isdigit() else -1
    name = names[index] if 0 <= index < len(names) else index_text
    return Mismatch(**{**mismatch.to_dict(), "path": f"{head}input `{name}` after the call{tail}",
                       "reason": mismatch.reason + " (it must end as the reference leaves it)"})

