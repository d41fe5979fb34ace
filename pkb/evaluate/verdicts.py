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


def raise_reference_errors(replies: list, problem: Problem, what: str) -> None:
    """HarnessError where a reply of the trusted reference's ranks (typed, pkb.runtime.messages) is a failure: pkb's
    own, never the candidate's."""
    for rank, reply in enumerate(replies):
        if hasattr(reply, "said"):  # a RankFailure
            raise HarnessError(f"the reference of {problem.name} failed on rank {rank} ({what}): "
                               f"{reply.error}\n{reply.traceback}")


def used(replies: list) -> list[str]:
    """The union over ranks of the stock calls each reply says its rank's code made (a candidate's word: labels)."""
    return sorted({label for reply in replies for label in getattr(reply, "collectives_used", ())})
