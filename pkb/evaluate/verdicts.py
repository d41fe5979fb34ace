"""Verdicts and how the candidate's processes' failures map to them, apart from the steps that check
correctness (pkb.evaluate.evaluator) and timing (pkb.evaluate.timing), which both raise them.

``Verdict`` ends an evaluation with a status; ``HarnessError`` ends it as pkb's own failure (no verdict on
the candidate). A rank's reply with an error, a group that timed out, died or never started become one
of the two here.
"""

from __future__ import annotations

import contextlib

from pkb.evaluate.candidate import gpu_needed_by
from pkb.options import Status
from pkb.problem import Problem
from pkb.runtime.group import GroupFailure, RankCrashed, RankGroup, RankTimeout, StartFailure
from pkb.runtime.modes import Mode


class HarnessError(RuntimeError):
    """pkb itself failed (a reference raised, rank processes would not start): not the candidate's fault."""


class Verdict(Exception):
    def __init__(self, status: Status, message: str, **details):
        super().__init__(message)
        self.status = status
        self.message = message
        self.details = details


def first_real_failure(replies: list[dict], default: int) -> int:
    """The rank to report: one that failed itself, not one cut short while it waited for (or was still
    busy beside) the rank that failed; tampering before anything else."""
    real = [r for r, reply in enumerate(replies) if reply.get("error") and not reply.get("stuck")]
    tampering = [r for r in real if replies[r].get("status") == Status.TAMPERED.value]
    return (tampering or real or [default])[0]


def raise_candidate_error(replies: list[dict], rank: int, where: dict, mode: Mode) -> None:
    rank = first_real_failure(replies, rank)
    reply = replies[rank]
    skip_if_gpu_needed(reply, mode, rank)
    # tampered, or refused by the peer-memory fence (forbidden across nodes; skipped where the mode lacks NVSHMEM)
    status = Status(reply["status"]) if reply.get("status") in (Status.TAMPERED.value, Status.FORBIDDEN.value,
                                                                Status.SKIPPED.value) else Status.RUNTIME_ERROR
    raise Verdict(status, f"rank {rank}, case {where['case']}, trial {where['trial']}: {reply['error']}",
                  rank=rank, **where, error=reply["error"], traceback=reply.get("traceback", ""))


def skip_if_gpu_needed(reply: dict, mode: Mode, rank: int) -> None:
    """In a mode without a GPU, a candidate that failed because it needs one is ``skipped``, not failed."""
    if mode.uses_gpu or reply.get("status") == Status.TAMPERED.value:
        return
    evidence = gpu_needed_by(f"{reply.get('error', '')}\n{reply.get('traceback', '')}")
    if evidence:
        raise Verdict(Status.SKIPPED, f"the candidate needs a GPU (rank {rank}: {evidence}); mode {mode} has none "
                                      "(run it with --mode cuda or shared-gpu)", rank=rank, error=reply.get("error", ""))


def raise_reference_errors(replies: list[dict], problem: Problem, what: str) -> None:
    for rank, reply in enumerate(replies):
        if reply.get("error") or reply.get("status") not in (None, "ok"):
            raise HarnessError(f"the reference of {problem.name} failed on rank {rank} ({what}): "
                               f"{reply.get('error')}\n{reply.get('traceback', '')}")


def candidate_request(group: RankGroup, jobs: list[dict], timeout: float, what: str) -> list[dict]:
    with candidate_failures(what):
        group.submit(jobs)
        return group.collect(timeout)


@contextlib.contextmanager
def candidate_failures(what: str, **where):
    """Turn a candidate group's timeout or death into the verdict it earns (``where``: the case and trial)."""
    try:
        yield
    except StartFailure as exc:  # before any candidate code ran
        raise HarnessError(f"{what}: {exc}\n{exc.log_tail}") from None
    except RankTimeout as exc:
        raise Verdict(Status.TIMEOUT, f"{what}: {exc}", rank=exc.rank, log_tail=exc.log_tail, **where) from None
    except RankCrashed as exc:
        raise Verdict(Status.CRASH, f"{what}: {exc}", rank=exc.rank, log_tail=exc.log_tail, **where) from None
    except GroupFailure as exc:
        raise Verdict(Status.CRASH, f"{what}: {exc}", **where) from None


def used(replies: list[dict]) -> list[str]:
    """The union over ranks of the stock calls each reply says its rank's solution made."""
    return sorted({label for reply in replies for label in reply.get("collectives_used", [])})


def checked(replies: list[dict]) -> list[dict]:
    """The replies, or a RankError carrying all of them if a rank reported an error."""
    failed = [rank for rank, reply in enumerate(replies) if reply.get("error") and not reply.get("stuck")]
    if failed:
        raise RankError(failed[0], replies)
    return replies


class RankError(GroupFailure):
    def __init__(self, rank: int, replies: list[dict]):
        super().__init__(f"rank {rank}: {replies[rank]['error']}", rank)
        self.replies = replies
