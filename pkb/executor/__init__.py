"""Where evaluations run: on this machine (the default), or across a Ray cluster (``--executor ray``).

An executor takes evaluations (``Evaluation``) and hands back each one's result as it finishes, in whatever order
they finish. The callers (``pkb run``, ``pkb generate``, ``pkb agent``) store every result in their own
SQLite database as it arrives, so the store, the resume logic and the rows are the same whichever
executor ran the evaluation. Every executor runs pkb's own evaluator (``pkb.evaluate.evaluator.evaluate``) in a
pkb process that decides the verdict, with the candidate in rank processes below it: the executor only
chooses the machine.

- ``LocalExecutor`` (pkb.executor.local): here, one evaluation at a time or several side by side
  (``--parallel``; timed ones always alone), rank groups kept warm per (mode, world size, sandbox level).
- ``pkb.executor.ray_cluster.RayExecutor``: one warm evaluator per slot of a Ray cluster (a slot holds
  what one evaluation needs on one node); a lost node or a killed worker is retried, and after the
  last attempt recorded as ``infra_error``, never as a verdict on the candidate.
"""

from __future__ import annotations

from pkb.options import EXECUTORS
from pkb.executor.base import Evaluation, Executor, InFlight, session_key
from pkb.executor.local import LocalExecutor, default_parallel

__all__ = ["EXECUTORS", "Evaluation", "Executor", "InFlight", "LocalExecutor", "default_parallel", "make_executor",
           "session_key"]



def make_executor(name: str = "local", address: str | None = None, parallel: int | None = None) -> Executor:
    """The executor ``--executor NAME`` asks for (``address`` concerns Ray only; ``parallel`` None: as many
    evaluations at once as this machine or the cluster holds)."""
    if name == "local":
        return LocalExecutor(parallel)
    if name == "ray":
        from pkb.executor.ray_cluster import RayExecutor

        return RayExecutor(address=address, parallel=parallel)
    raise ValueError(f"unknown executor {name!r}; use one of {EXECUTORS}")
