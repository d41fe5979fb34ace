"""The verdict types: ``Verdict`` ends an evaluation with a status (pkb.options.Status); ``HarnessError`` ends it as
pkb's own failure (no verdict on the candidate). The correctness steps (pkb.evaluate.evaluator), timing
(pkb.evaluate.timing) and the rank processes' side (pkb.evaluate.ranks, which turns a group that timed out, died or
never started into one of the two) raise them.
"""

from __future__ import annotations

from pkb.options import Status
from pkb.problem import Problem


class HarnessError(RuntimeError):
    """pkb itself failed (a reference raised, rank processes would not start): not the candidate's fault."""


class Verdict(Exception):
    def __init__(self, status: Status, message: str, **details):
        super().__init__(message)
        self.status = status
        self.message = message
        self.details = details


def raise_reference_errors(replies: list[dict], problem: Problem, what: str) -> None:
    for rank, reply in enumerate(replies):
        if reply.get("error") or reply.get("status") not in (None, "ok"):
            raise HarnessError(f"the reference of {problem.name} failed on rank {rank} ({what}): "
                               f"{reply.get('error')}\n{reply.get('traceback', '')}")


def used(replies: list[dict]) -> list[str]:
    """The union over ranks of the stock calls each reply says its rank's solution made."""
    return sorted({label for reply in replies for label in reply.get("collectives_used", [])})
