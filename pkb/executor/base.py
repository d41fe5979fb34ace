"""What every executor is (pkb.executor): evaluations in, ``(evaluation, result)`` out as each finishes; and
``Evaluation``, the one name pkb gives one evaluation everywhere (the loop, the executors, the service)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.result import EvalResult
from pkb.options import DEFAULT_EXPERIMENT, Status
from pkb.problem import Problem


@dataclass(frozen=True)
class Evaluation:
    """One evaluation: ``candidate`` judged on ``problem`` with ``config``, its result stored under ``solution_set``
    in ``experiment``.

    Callers build them (pkb.solution_files.plan, generation, the service); the evaluation loop (pkb.loop) gives
    one without a ``config`` the run's and hands it to an executor, which yields it back with its result. ``tag``
    is the caller's own handle, handed back with it.
    """

    problem: Problem
    candidate: Candidate
    solution_set: str = ""
    config: EvalConfig | None = None  # None: the run's (``EvaluationLoop.config``), given when it is submitted
    tag: Any = None
    experiment: str = DEFAULT_EXPERIMENT  # pkb.options: the user's --experiment, or the one pkb names

    def __post_init__(self):
        if self.config is not None:  # its nodes resolved: what its session needs
            object.__setattr__(self, "config", self.config.on(self.problem))


@dataclass(frozen=True)
class InFlight:
    """An evaluation an executor is running, and since when (``time.monotonic()`` of this process)."""

    evaluation: Evaluation
    started: float


# What a failure for want of a shared resource says: memory (host or device), processes, files, the
# driver; and pkb's own limits (pkb.runtime.group.LIMIT_WORDS).
_RESOURCE_WORDS = re.compile(
    r"out of memory|OutOfMemoryError|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation|CUBLAS_STATUS_ALLOC_FAILED"
    r"|Cannot allocate memory|\bMemoryError\b|std::bad_alloc|Resource temporarily unavailable|Too many open files"
    r"|No space left on device|cudaErrorDevicesUnavailable|busy or unavailable|CUDA error: initialization error"
    r"|unhandled system error|pkb's limit:", re.IGNORECASE)


def resource_failure(result: EvalResult) -> str | None:
    """Why ``result``, reached beside other evaluations, may be the machine's doing rather than the
    candidate's, or None. Such a result is judged again alone before it counts (docs/architecture.md, "Invariance"): a
    time-out or a dead rank (the kernel's OOM killer picks candidates first) on a shared machine, pkb failing,
    and any error that speaks of memory, processes, files or the driver."""
    if result.status is Status.HARNESS_ERROR:
        return f"pkb failed beside other evaluations ({result.message.splitlines()[0][:200]})"
    if result.status is Status.SKIPPED and "memory" in result.details.pkb_limits:
        return "it ran out of GPU memory beside other evaluations, which share the GPU"
    if result.status is Status.TIMEOUT:
        return "it timed out beside other evaluations, which share the machine's cores and GPUs"
    if result.status is Status.CRASH:
        return "a rank died beside other evaluations (the kernel's OOM killer picks candidate processes first)"
    if result.status in (Status.RUNTIME_ERROR, Status.COMPILE_ERROR, Status.IMPORT_ERROR):
        text = "\n".join(str(part or "") for part in (result.message, result.details.error, result.details.traceback,
                                                       result.details.log_tail))
        for line in text.splitlines():
            if _RESOURCE_WORDS.search(line):
                return f"it failed for want of a shared resource beside other evaluations: {line.strip()[:200]}"
    return None


def session_key(config: EvalConfig) -> tuple:
    """What a warm ``Session`` is built for (mode, world size, sandbox level, nodes): evaluations share one
    only when they agree on all of it (rank processes confined at one sandbox level never serve another;
    ranks on virtual nodes never serve a run of another topology). ``config``: resolved (``config.on``)."""
    return (config.mode, config.world_size, config.sandbox, config.nodes)


class Executor:
    """Runs evaluations (each with its ``config``) and yields ``(evaluation, result)`` as each finishes
    (``finished``)."""

    name = ""

    def submit(self, evaluation: Evaluation) -> None:
        raise NotImplementedError

    def finished(self, wait: bool = True) -> Iterator[tuple[Evaluation, EvalResult]]:
        """Results of submitted evaluations as they finish: until none is left (``wait``) or until none more
        has finished yet (``wait=False``; a local executor runs what was submitted either way)."""
        raise NotImplementedError

    @property
    def pending(self) -> int:
        raise NotImplementedError

    def capacity(self, config: EvalConfig) -> int:
        """Evaluations of ``config`` this executor runs at once."""
        return 1

    def in_flight(self) -> list[InFlight]:
        """The evaluations running now (for progress displays; empty where the executor cannot tell)."""
        return []

    def gpus_per_node(self) -> int | None:
        """The most GPUs one machine of this executor has (what ``--mode auto`` decides by); None: this
        machine's, as ``pkb.runtime.modes`` detects them."""
        return None

    def describe(self) -> str:
        return self.name

    def evaluate(self, problem: Problem, candidate: Candidate, config: EvalConfig) -> EvalResult:
        """One evaluation, waited for (for callers that need each verdict before the next step)."""
        if self.pending:
            raise RuntimeError("evaluate() waits for one evaluation; others are still pending")
        self.submit(Evaluation(problem, candidate, config=config))
        results = [result for _, result in self.finished(wait=True)]
        return results[0]

    def close(self) -> None:
        pass

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
