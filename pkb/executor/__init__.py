"""Where evaluations run: on this machine (the default), or across a Ray cluster (``--executor ray``).

An executor takes evaluation tasks and hands back each one's result as it finishes, in whatever order
they finish. The callers (``pkb run``, ``pkb generate``, ``pkb agent``) store every result in their own
SQLite database as it arrives, so the store, the resume logic and the rows are the same whichever
executor ran the evaluation. Every executor runs pkb's own evaluator (``pkb.evaluate.evaluate``) in a
pkb process that decides the verdict, with the candidate in rank processes below it: the executor only
chooses the machine.

- ``LocalExecutor``: here, one evaluation at a time, rank groups kept warm per (mode, world size,
  sandbox level).
- ``pkb.executor.ray_cluster.RayExecutor``: one warm evaluator per slot of a Ray cluster (a slot holds
  what one evaluation needs on one node); a lost node or a killed worker is retried, and after the
  last attempt recorded as ``infra_error``, never as a verdict on the candidate.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator

from pkb.evaluate.evaluator import Session, evaluate
from pkb.evaluate.result import EvalResult
from pkb.executor.base import Executor, Task, session_key

__all__ = ["EXECUTORS", "Executor", "LocalExecutor", "Task", "make_executor"]

EXECUTORS = ("local", "ray")


class LocalExecutor(Executor):
    """Evaluations on this machine, one at a time, in the order submitted; the rank groups of each
    (mode, world size, sandbox level) stay warm for the executor's life (``session_key``)."""

    name = "local"

    def __init__(self):
        self._sessions: dict[tuple, Session] = {}
        self._queue: deque[Task] = deque()

    def submit(self, task: Task) -> None:
        self._queue.append(task)

    @property
    def pending(self) -> int:
        return len(self._queue)

    def finished(self, wait: bool = True) -> Iterator[tuple[Task, EvalResult]]:
        while self._queue:
            task = self._queue.popleft()
            key = session_key(task.config)
            if key not in self._sessions:
                self._sessions[key] = Session(*key)
            yield task, evaluate(task.problem, task.candidate, task.config, self._sessions[key])

    def close(self) -> None:
        for session in self._sessions.values():
            session.close()
        self._sessions.clear()


def make_executor(name: str = "local", address: str | None = None, parallel: int | None = None) -> Executor:
    """The executor ``--executor NAME`` asks for (``address`` and ``parallel`` concern Ray only)."""
    if name == "local":
        return LocalExecutor()
    if name == "ray":
        from pkb.executor.ray_cluster import RayExecutor

        return RayExecutor(address=address, parallel=parallel)
    raise ValueError(f"unknown executor {name!r}; use one of {EXECUTORS}")
