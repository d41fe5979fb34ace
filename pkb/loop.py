"""The one loop through which pkb runs many evaluations (``EvaluationLoop``), and what it hands back
(``StoredResult``).

``pkb run`` (``run_evaluations``), ``pkb generate`` and ``pkb agent``, ``pkb serve`` and the corpus and soak
benchmarks submit evaluations (pkb.executor.Evaluation) here. Each result is stored as it finishes, so a run
that is cut resumes where it stopped (``evaluation_key``: equal keys are the same evaluation), and an earlier
verdict is reused as the caller asks. Which files a run judges, and for which problem, is pkb.solution_files's.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Iterator

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.result import EvalResult
from pkb.executor import Evaluation, Executor, LocalExecutor
from pkb.problem import DEFAULT_PRECISION, Problem
from pkb.protocol import UPSTREAM_TRIALS
from pkb.store.db import ResultStore, run_key


def evaluation_key(problem: Problem, candidate: Candidate, config: EvalConfig) -> str:
    """The store's key for evaluating ``candidate`` on ``problem`` with ``config`` (equal keys: the same evaluation).

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
    precision = "" if config.dtype == DEFAULT_PRECISION else f"|precision={config.dtype}"
    paper = "" if config.upstream_trials == UPSTREAM_TRIALS else f"|upstream_trials={config.upstream_trials}"
    nodes = "" if config.nodes == 1 else f"|nodes={config.nodes}"
    return run_key(problem.name, problem.version, candidate.sha256, config.mode.value, config.world_size,
                   config.trials, f"{timing}|{config.policy}{cases}{sandbox}{precision}{paper}{nodes}")


REUSE = ("restore", "as_stored", "never")


@dataclass(frozen=True)
class StoredResult:
    """An evaluation's result as the loop hands it back: stored (row ``result_id`` under ``key``) before it is."""

    evaluation: Evaluation  # its ``config`` resolved; its ``tag`` the caller's
    result: EvalResult
    result_id: int | None
    key: str
    resumed: bool  # an earlier verdict reused, not judged again


class EvaluationLoop:
    """The one loop through which pkb runs many evaluations: ``pkb run`` (``run_evaluations``), ``pkb generate``
    and ``pkb agent`` (pkb.generate.sampler), ``pkb serve`` (pkb.serve.service) and the corpus and soak
    benchmarks all submit evaluations here. It hands each to an executor (pkb.executor: this machine by
    default, correctness evaluations side by side up to its capacity, a timed one alone), stores every verdict
    in ``store`` as it finishes (the caller's only writer of results) and yields it back (``finished``).

    ``reuse`` says what an evaluation whose file was judged before with the same settings (its
    ``evaluation_key``) gets, and whether evaluations with the same key in flight at once are judged once:

    - ``restore`` (``pkb run``): the stored verdict, stored again under this evaluation's set and name when
      those differ (``details.verdict_of`` names the row it repeats); twins in flight are judged once.
    - ``as_stored`` (generation): the stored row as it is; twins judged once.

    Under either, a verdict stored in another experiment is stored again under this evaluation's, so that an
    experiment's report holds every result it reused, and never another experiment's row.
    - ``never`` (the service: every request is a fresh evaluation with its own secret seeds): always judged.

    A stored ``harness_error`` or ``infra_error`` is no verdict: that evaluation runs again. ``keep_paths=False``
    leaves the candidate's path out of the stored details (a served request's scratch copy).
    """

    def __init__(self, store: ResultStore, config: EvalConfig | None = None, executor: Executor | None = None,
                 reuse: str = "restore", keep_paths: bool = True):
        if reuse not in REUSE:
            raise ValueError(f"reuse must be one of {REUSE}, not {reuse!r}")
        self.store, self.config, self.reuse, self.keep_paths = store, config, reuse, keep_paths
        self.executor = executor or LocalExecutor()
        self._owns_executor = executor is None
        self._ready: deque[StoredResult] = deque()  # reused verdicts, handed back by the next ``finished``
        self._twins: dict[str, list[Evaluation]] = {}  # key in flight -> later evaluations with that key

    @property
    def pending(self) -> int:
        """Evaluations submitted whose result has not been handed back yet."""
        return self.executor.pending + len(self._ready) + sum(len(twins) for twins in self._twins.values())

    def submit(self, evaluation: Evaluation) -> None:
        """Queue ``evaluation``, run with its own ``config`` (a request's, a lighter self-check's) or else the
        loop's; its ``tag`` comes back with its ``StoredResult``."""
        evaluation = replace(evaluation, config=evaluation.config or self.config)
        key = evaluation_key(evaluation.problem, evaluation.candidate, evaluation.config)
        if self.reuse != "never":
            if key in self._twins:
                self._twins[key].append(evaluation)
                return
            previous_id = self.store.latest_id(key)
            previous = self.store.result_by_id(previous_id) if previous_id is not None else None
            if previous is not None and previous.status.is_verdict:
                self._ready.append(self._reused(evaluation, key, previous, previous_id))
                return
            self._twins[key] = []
        self.executor.submit(evaluation)

    def finished(self, wait: bool = True) -> Iterator[StoredResult]:
        """Results as they are stored: until every submitted evaluation's is back (``wait``), or those ready now."""
        while self._ready:
            yield self._ready.popleft()
        for evaluation, result in self.executor.finished(wait=wait):
            key = evaluation_key(evaluation.problem, evaluation.candidate, evaluation.config)
            result.solution_set, result.experiment = evaluation.solution_set, evaluation.experiment
            if not self.keep_paths:
                result.details.solution_path = None
            result_id = self.store.add(result, key)
            yield StoredResult(evaluation, result, result_id, key, False)
            waiting = self._twins.pop(key, [])
            if waiting and not result.status.is_verdict:  # no verdict to repeat: the next twin gets its own attempt
                self._twins[key] = waiting[1:]
                self.executor.submit(waiting[0])
            else:
                for twin in waiting:
                    self._ready.append(self._reused(twin, key, result, result_id))
            while self._ready:
                yield self._ready.popleft()

    def close(self) -> None:
        if self._owns_executor:
            self.executor.close()

    def __enter__(self) -> "EvaluationLoop":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _reused(self, evaluation: Evaluation, key: str, previous: EvalResult, previous_id: int | None) -> StoredResult:
        own_name = (evaluation.solution_set, evaluation.candidate.name, evaluation.experiment)
        renamed = (previous.solution_set, previous.solution, previous.experiment) != own_name
        if (self.reuse == "restore" and renamed) or previous.experiment != evaluation.experiment:
            own_id = self.store.latest_id(key, *own_name)
            own = self.store.result_by_id(own_id) if own_id is not None else None
            if own is not None and own.status.is_verdict:  # stored under this set and name before: resumed as it is
                return StoredResult(evaluation, own, own_id, key, True)
            restored = _restored(previous, evaluation, previous_id)
            return StoredResult(evaluation, restored, self.store.add(restored, key), key, True)
        return StoredResult(evaluation, previous, previous_id, key, True)


def run_evaluations(evaluations: list[Evaluation], config: EvalConfig, store: ResultStore,
                    on_result: Callable[[Evaluation, EvalResult, bool], None] = lambda *stored: None,
                    executor: Executor | None = None) -> list[EvalResult]:
    """Evaluate each of ``evaluations`` not already in ``store`` on ``executor`` (default: this machine), with its
    own config or else ``config``, through an ``EvaluationLoop`` that restores earlier verdicts;
    ``on_result(evaluation, result, resumed)`` as each is stored. Results come back in the order given."""
    results: dict[int, EvalResult] = {}
    with EvaluationLoop(store, config, executor) as loop:
        for index, evaluation in enumerate(evaluations):
            loop.submit(replace(evaluation, tag=index))
        for stored in loop.finished():
            results[stored.evaluation.tag] = stored.result
            on_result(stored.evaluation, stored.result, stored.resumed)
    return [results[index] for index in sorted(results)]


def _restored(previous: EvalResult, evaluation: Evaluation, previous_id: int | None) -> EvalResult:
    """``previous``'s verdict under ``evaluation``'s set and name (the same file, judged with the same settings)."""
    details = replace(previous.details, verdict_of=previous_id,
                      solution_path=str(evaluation.candidate.path) if evaluation.candidate.path else None)
    return replace(previous, solution=evaluation.candidate.name, solution_set=evaluation.solution_set,
                   experiment=evaluation.experiment, details=details, created_at=time.time())
