"""Many evaluations in one go (``pkb run``): which candidates, in what order, stored as they finish.

A run pairs problems with candidates: each problem's reference against itself (a self-check of the
suite and the harness) and every solution file found for it, either in a directory the user names
or in pkb's shipped solutions. Every result names its solution set (pkb.store.db): the folder's name
(or the name given with ``--set``), ``pkb shipped`` or ``reference``. Results go to the database one by
one; a rerun with the same settings skips what is already there, so an interrupted run resumes and
loses nothing.
"""

from __future__ import annotations

import difflib
import re
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.evaluator import EvalConfig, checked_cases
from pkb.evaluate.result import EvalResult
from pkb.executor import Executor, LocalExecutor, Task
from pkb.problem import DEFAULT_PRECISION, Problem
from pkb.protocol import UPSTREAM_TRIALS
from pkb.registry import all_problems
from pkb.store.db import REFERENCE_SET, SHIPPED_SET, SHIPPED_SOLUTIONS, ResultStore, run_key
_UPSTREAM_NAME = re.compile(r"^(\d+)_")


@dataclass(frozen=True)
class Job:
    problem: Problem
    candidate: Candidate
    solution_set: str = ""  # the set the result is stored under
    cases: str | None = None  # the cases its correctness trials run; None: the run's (``EvalConfig.cases``)
    trials: int | None = None  # how many; None: the run's (``EvalConfig.num_trials``)
    world_size: int | None = None  # None: the run's (``EvalConfig.world_size``)

    def config(self, run: EvalConfig) -> EvalConfig:
        if self.trials:  # a lighter self-check: the upstream cases as deep as the others
            run = replace(run, num_trials=self.trials, upstream_trials=self.trials)
        return replace(run, cases=self.cases or run.cases, world_size=self.world_size or run.world_size)


# Upstream's earlier revision, in which model solutions were published before it renumbered and renamed
# its problems: one problem was inserted (old 33), one dropped (old 47, fsdp_adamw_sharded), one added
# (today's 46, gemv_decode), so old 34-46 are today's 33-45 and old 48-88 today's 47-87, under the same
# names; four were renamed in place. A renamed problem's old name can be another problem's name today
# (old 12 gemm_allgather is today's 12 allgather_gemm, while today's 14 is gemm_allgather), so a file's
# number and name are read together against this table: (old number, old name) -> today's slug, or None
# where the problem no longer exists upstream.
EARLIER_REVISION: dict[tuple[int, str], str | None] = {
    (11, "gemm_allgather_at"): "allgather_gemm_at",
    (12, "gemm_allgather"): "allgather_gemm",
    (14, "gemm_allscatter"): "gemm_allgather",
    (18, "rms_norm"): "tp_rms_norm",
    (47, "fsdp_adamw_sharded"): None,
}
DROPPED = {old_name for (_, old_name), slug in EARLIER_REVISION.items() if slug is None}  # numbered or not


@dataclass(frozen=True)
class FileMatch:
    """Which problem a solution file is for, and how that was decided (for the user to see)."""

    problem: Problem | None
    how: str


def match_file(path: Path, problems: dict[str, Problem]) -> FileMatch:
    """The problem a solution file is for: ``<slug>[_<anything>].py`` or ``<n>_<name>[_<backend>].py``.

    Number and name together first, against upstream's earlier revision (``EARLIER_REVISION``); then by
    name (case-insensitive, the longest name that the file's starts with: today's slugs, and the old
    names no problem has today); a bare number (``12.py``, ``12_cuda.py``) by number. A name that matches
    nothing is reported, never guessed from its number.
    """
    stem = path.stem
    number_match = _UPSTREAM_NAME.match(stem)
    number = int(number_match.group(1)) if number_match else None
    name = (stem[number_match.end():] if number_match else stem).lower()

    def names(candidate: str) -> bool:
        return name == candidate or name.startswith(candidate + "_")

    for (old_number, old_name), slug in sorted(EARLIER_REVISION.items(), key=lambda item: -len(item[0][1])):
        if number == old_number and names(old_name):
            if slug is None:
                return FileMatch(None, f"{old_number} {old_name} was dropped from the upstream benchmark")
            problem = problems[slug]
            return FileMatch(problem, f"by number and name in upstream's earlier revision ({old_number} {old_name}; "
                                      f"now {problem.upstream_id} {slug})")
    old_only = {old_name: slug for (_, old_name), slug in EARLIER_REVISION.items() if old_name not in problems}
    for known in sorted([*problems, *old_only], key=len, reverse=True):  # longest first: gemm_allgather_at first
        if not names(known):
            continue
        if known in DROPPED:
            return FileMatch(None, f"{known} was dropped from the upstream benchmark")
        if known in old_only:
            problem = problems[old_only[known]]
            return FileMatch(problem, f"by its name in upstream's earlier revision ({known}; now "
                                      f"{problem.upstream_id} {problem.name})")
        problem = problems[known]
        if number is not None and number != problem.upstream_id:
            return FileMatch(problem, f"by name (its number {number} is from an earlier upstream revision; "
                                      f"now {problem.upstream_id})")
        was = [old_number for (old_number, old_name), slug in EARLIER_REVISION.items() if old_name == known and slug != known]
        if number is None and was:  # today's name of one problem, the old name of another: the number decides
            return FileMatch(problem, f"by name ({known} was problem {was[0]}'s name in upstream's earlier revision: "
                                      f"name a file written for that {was[0]}_{known}...)")
        return FileMatch(problem, "by name")
    if number is not None and name in ("", "cuda", "triton", "torch", "nccl"):
        problem = next((p for p in problems.values() if p.upstream_id == number), None)
        return FileMatch(problem, "by number" if problem else f"no problem has number {number}")
    close = difflib.get_close_matches(name, list(problems), n=3)
    return FileMatch(None, "its name matches no problem" + (f" (close: {', '.join(close)})" if close else ""))


def problem_for_file(path: Path, problems: dict[str, Problem]) -> Problem | None:
    return match_file(path, problems).problem


def solution_files(directory: Path, notes: list[str] | None = None) -> dict[str, list[Path]]:
    """Solution files under ``directory`` by problem slug; files that name no problem are listed under
    ``__unknown__``. ``notes`` (if given) receives one line per file whose mapping a user should see."""
    problems = all_problems()
    found: dict[str, list[Path]] = {}
    unknown = []
    for path in sorted(directory.glob("*.py")):
        if path.name.startswith("_"):
            continue
        match = match_file(path, problems)
        if match.problem is None:
            unknown.append(path.name)
            if notes is not None:
                notes.append(f"{path.name}: not evaluated: {match.how}")
        else:
            found.setdefault(match.problem.name, []).append(path)
            if notes is not None and match.how != "by name":
                notes.append(f"{path.name} -> {match.problem.upstream_id} {match.problem.name} ({match.how})")
    if unknown:
        found["__unknown__"] = [directory / name for name in unknown]
    return found


def set_name(solutions_dir: Path | None) -> str:
    """The solution set of a ``--solutions`` folder: its name (``runs/gpt5-oneshot`` -> ``gpt5-oneshot``);
    ``pkb shipped`` for pkb's own solutions (no folder given)."""
    if solutions_dir is None:
        return SHIPPED_SET
    return solutions_dir.resolve().name or str(solutions_dir)


def plan(problems: Iterable[Problem], solutions_dir: Path | None, include_reference: bool,
         solution_set: str | None = None) -> list[Job]:
    """The jobs of a run; ``solution_set`` names the files' set (default: ``set_name(solutions_dir)``)."""
    files = solution_files(solutions_dir or SHIPPED_SOLUTIONS)
    solution_set = solution_set or set_name(solutions_dir)
    jobs = []
    for problem in problems:
        if include_reference:
            jobs.append(Job(problem, Candidate.reference_of(problem), REFERENCE_SET))
        for path in files.get(problem.name, []):
            jobs.append(Job(problem, Candidate.from_file(path), solution_set))
    return jobs


def light_self_checks(jobs: list[Job], config: EvalConfig, cases: bool = True, trials: int | None = None) -> list[Job]:
    """``jobs`` with the references' self-checks made lighter for a first look: on their upstream cases
    (``cases``; a problem whose upstream cases this mode leaves out, too slow where the reference runs
    on the CPU, on its tests cases instead) and with ``trials`` trials (None: the run's)."""
    def lighter(job: Job) -> Job:
        if job.solution_set != REFERENCE_SET:
            return job
        upstream = checked_cases(job.problem, replace(config, cases="upstream"))
        return replace(job, cases=("upstream" if upstream else "tests") if cases else None, trials=trials)

    return [lighter(job) for job in jobs]


def evaluation_key(problem: Problem, candidate: Candidate, config: EvalConfig) -> str:
    """The store's key for evaluating ``candidate`` on ``problem`` with ``config`` (equal keys: same job).

    A setting at its default adds nothing, so databases written before it existed still resume. The
    sandbox level is part of the key: a result of ``--sandbox off`` (unconfined) is never reused by a
    sandboxed run, nor one of ``auto`` by a run that asks for ``required`` (the hashed text ends
    ``|report|sandbox=off``, ``|report|sandbox=required``; ``|report`` with ``auto``, as before). So
    are the precision (``|precision=fp32``) and the upstream cases' trials where they differ from the paper's.
    """
    timing = ("perf+graph" if config.cuda_graph else "perf") if config.perf else ""
    cases = "" if config.cases == "all" else f"|cases={config.cases}"
    sandbox = "" if config.sandbox == "auto" else f"|sandbox={config.sandbox}"
    precision = "" if config.precision == DEFAULT_PRECISION else f"|precision={config.precision}"
    paper = "" if config.upstream_trials == UPSTREAM_TRIALS else f"|upstream_trials={config.upstream_trials}"
    return run_key(problem.name, problem.version, candidate.sha256, config.mode.value, config.world_size,
                   config.num_trials, f"{timing}|{config.policy}{cases}{sandbox}{precision}{paper}")


REUSE = ("restore", "as_stored", "never")


@dataclass(frozen=True)
class Done:
    """A job's verdict as the loop hands it back: stored (row ``result_id`` under ``key``) before it is."""

    job: Job
    result: EvalResult
    result_id: int | None
    key: str
    resumed: bool  # an earlier verdict reused, not judged again
    tag: Any = None


class EvaluationLoop:
    """The one loop through which pkb runs many evaluations: ``pkb run`` (``run_jobs``), ``pkb generate``
    and ``pkb agent`` (pkb.generate.sampler), ``pkb serve`` (pkb.serve.service) and the corpus and soak
    benchmarks all submit jobs here. It hands each to an executor (pkb.executor: this machine by default,
    correctness evaluations side by side up to its capacity, a timed one alone), stores every verdict in
    ``store`` as it finishes (the caller's only writer of results) and yields it back (``finished``).

    ``reuse`` says what a job whose file was judged before with the same settings (its
    ``evaluation_key``) gets, and whether jobs with the same key in flight at once are judged once:

    - ``restore`` (``pkb run``): the stored verdict, stored again under this job's set and name when those
      differ (``details["verdict_of"]`` names the row it repeats); twins in flight are judged once.
    - ``as_stored`` (generation): the stored row as it is; twins judged once.
    - ``never`` (the service: every request is a fresh evaluation with its own secret seeds): always judged.

    A stored ``harness_error`` or ``infra_error`` is no verdict: that job runs again. ``keep_paths=False``
    leaves the candidate's path out of the stored details (a served request's scratch copy).
    """

    def __init__(self, store: ResultStore, config: EvalConfig | None = None, executor: Executor | None = None,
                 reuse: str = "restore", keep_paths: bool = True):
        if reuse not in REUSE:
            raise ValueError(f"reuse must be one of {REUSE}, not {reuse!r}")
        self.store, self.config, self.reuse, self.keep_paths = store, config, reuse, keep_paths
        self.executor = executor or LocalExecutor()
        self._owns_executor = executor is None
        self._ready: deque[Done] = deque()  # reused verdicts, handed back by the next ``finished``
        self._twins: dict[str, list[tuple[Job, Any]]] = {}  # key in flight -> later jobs with that key

    @property
    def pending(self) -> int:
        """Jobs submitted whose verdict has not been handed back yet."""
        return self.executor.pending + len(self._ready) + sum(len(twins) for twins in self._twins.values())

    def submit(self, job: Job, tag: Any = None, config: EvalConfig | None = None) -> None:
        """Queue ``job``, run with ``config`` (a request's own: the service's) or ``job.config`` of the loop's;
        ``tag`` comes back with its ``Done``."""
        config = config or job.config(self.config)
        key = evaluation_key(job.problem, job.candidate, config)
        if self.reuse != "never":
            if key in self._twins:
                self._twins[key].append((job, tag))
                return
            previous_id = self.store.latest_id(key)
            previous = self.store.result_by_id(previous_id) if previous_id is not None else None
            if previous is not None and previous.status.is_verdict:
                self._ready.append(self._reused(job, tag, key, previous, previous_id))
                return
            self._twins[key] = []
        self.executor.submit(Task(job.problem, job.candidate, config, tag=(job, tag, key)))

    def finished(self, wait: bool = True) -> Iterator[Done]:
        """Verdicts as they are stored: until every submitted job's is back (``wait``), or those ready now."""
        while self._ready:
            yield self._ready.popleft()
        for task, result in self.executor.finished(wait=wait):
            job, tag, key = task.tag
            result.solution_set = job.solution_set
            if not self.keep_paths:
                result.details.pop("solution_path", None)
            result_id = self.store.add(result, key)
            yield Done(job, result, result_id, key, False, tag)
            waiting = self._twins.pop(key, [])
            if waiting and not result.status.is_verdict:  # no verdict to repeat: the next twin gets its own attempt
                (twin, twin_tag), self._twins[key] = waiting[0], waiting[1:]
                self.executor.submit(Task(twin.problem, twin.candidate, task.config, tag=(twin, twin_tag, key)))
            else:
                for twin, twin_tag in waiting:
                    self._ready.append(self._reused(twin, twin_tag, key, result, result_id))
            while self._ready:
                yield self._ready.popleft()

    def close(self) -> None:
        if self._owns_executor:
            self.executor.close()

    def __enter__(self) -> "EvaluationLoop":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _reused(self, job: Job, tag: Any, key: str, previous: EvalResult, previous_id: int | None) -> Done:
        if self.reuse == "restore" and (previous.solution_set, previous.solution) != (job.solution_set, job.candidate.name):
            own_id = self.store.latest_id(key, job.solution_set, job.candidate.name)
            own = self.store.result_by_id(own_id) if own_id is not None else None
            if own is not None and own.status.is_verdict:  # stored under this set and name before: resumed as it is
                return Done(job, own, own_id, key, True, tag)
            restored = _restored(previous, job, previous_id)
            return Done(job, restored, self.store.add(restored, key), key, True, tag)
        return Done(job, previous, previous_id, key, True, tag)


def run_jobs(jobs: list[Job], config: EvalConfig, store: ResultStore,
             on_result: Callable[[Job, EvalResult, bool], None] = lambda job, result, resumed: None,
             executor: Executor | None = None) -> list[EvalResult]:
    """Evaluate every job not already in ``store`` on ``executor`` (default: this machine) with ``config``
    (a job may name its own cases: ``Job.config``) through an ``EvaluationLoop`` that restores earlier
    verdicts; ``on_result(job, result, resumed)`` as each is stored. Results come back in job order."""
    results: dict[int, EvalResult] = {}
    with EvaluationLoop(store, config, executor) as loop:
        for index, job in enumerate(jobs):
            loop.submit(job, tag=index)
        for done in loop.finished():
            results[done.tag] = done.result
            on_result(done.job, done.result, done.resumed)
    return [results[index] for index in sorted(results)]


def _restored(previous: EvalResult, job: Job, previous_id: int | None) -> EvalResult:
    """``previous``'s verdict under ``job``'s set and name (the same file, judged with the same settings)."""
    details = {**previous.details, "verdict_of": previous_id,
               "solution_path": str(job.candidate.path) if job.candidate.path else None}
    return replace(previous, solution=job.candidate.name, solution_set=job.solution_set, details=details,
                   created_at=time.time())
