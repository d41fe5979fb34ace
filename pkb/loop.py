"""The one loop through which pkb runs many evaluations (``EvaluationLoop``), and what it runs (``Job``).

``pkb run`` (``run_jobs``), ``pkb generate`` and ``pkb agent``, ``pkb serve`` and the corpus and soak
benchmarks submit jobs here. Each result is stored as it finishes, so a run that is cut resumes where it
stopped (``evaluation_key``: equal keys are the same job), and an earlier verdict is reused as the caller
asks. Which files a run judges, and for which problem, is pkb.solution_files's.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.result import EvalResult
from pkb.executor import Executor, LocalExecutor, Task
from pkb.problem import DEFAULT_PRECISION, Problem
from pkb.protocol import UPSTREAM_TRIALS
from pkb.store.db import ResultStore, run_key


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
        return replace(run, cases=self.cases or run.cases, world_size=self.world_size or run.world_size).on(self.problem)


def evaluation_key(problem: Problem, candidate: Candidate, config: EvalConfig) -> str:
    """The store's key for evaluating ``candidate`` on ``problem`` with ``config`` (equal keys: same job).

    A setting at its default adds nothing, so databases written before it existed still resume. The
    sandbox level is part of the key: a result of ``--sandbox off`` (unconfined) is never reused by a
    sandboxed run, nor one of ``auto`` by a run that asks for ``required`` (the hashed text ends
    ``|report|sandbox=off``, ``|report|sandbox=required``; ``|report`` with ``auto``, as before). So
    are the precision (``|precision=fp32``), the upstream cases' trials where they differ from the paper's, and
    the number of nodes where more than one (``|nodes=2``).
    """
    config = config.on(problem)
    timing = ("perf+graph" if config.cuda_graph else "perf") if config.perf else ""
    cases = "" if config.cases == "all" else f"|cases={config.cases}"
    sandbox = "" if config.sandbox == "auto" else f"|sandbox={config.sandbox}"
    precision = "" if config.precision == DEFAULT_PRECISION else f"|precision={config.precision}"
    paper = "" if config.upstream_trials == UPSTREAM_TRIALS else f"|upstream_trials={config.upstream_trials}"
    nodes = "" if config.nodes == 1 else f"|nodes={config.nodes}"
    return run_key(problem.name, problem.version, candidate.sha256, config.mode.value, config.world_size,
                   config.num_trials, f"{timing}|{config.policy}{cases}{sandbox}{precision}{paper}{nodes}")


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
