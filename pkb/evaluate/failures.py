"""What a failure of the candidate's rank processes earns: the parent decides every status from what it observes.

A rank's reply is the candidate's word (pkb.runtime.messages): it says what its code did and what went wrong, and the
parent weighs that, never takes it as a verdict:

- ``timeout``: a step did not finish in time, by the parent's clock; the verdict shows each hung rank's Python stack
  (its own frames first).
- ``crash``: a rank died (the parent saw its end), or sent a reply pkb does not accept (malformed, or larger than
  the reference's allows).
- ``compile_error``, ``import_error``, ``signature_error``, ``runtime_error``, ``tampered``, ``forbidden``: what the
  rank said went wrong. Each is the candidate's failure, so its word costs it nothing to take; anything else a rank
  says (``skipped``, ``harness_error``, ``infra_error``, an unknown status) is a ``runtime_error``.
- ``skipped`` only from facts the parent holds (``skipped_by``): the mode, and what the parent reads in the
  candidate's source before running it (a declared requirement; code that needs a GPU, in a mode without one; code
  that uses NVSHMEM, where the run lacks it: read through the parser, never comments), or a shared GPU the driver
  reports full (shared-gpu mode). Each of these is a skip the *candidate* causes (``Details.skipped_by``:
  ``candidate``): whatever its code needs or did, the run cannot tell whether it passes, so it has not passed. A skip
  the *run* causes (the problem does not run at this world size, dtype or node count, or its cases are left out in
  this mode: pkb.evaluate.evaluator, ``run``) is the same for every candidate of the problem.
- ``harness_error`` only for pkb's own failures: the reference failed, or the candidate's processes did not start
  (before any candidate code ran).

No status a candidate can cause is better for it than failing: a ``skipped`` it caused (its declaration, its code,
a shared GPU full while it ran) counts as not passed in every report's pass@k, fast_p and tables
(pkb.report.metrics) and scores 0 as an RL reward (pkb.rl.common); only a skip the run causes leaves the
denominator (docs/threat-model.md, "The trust boundary").
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.verdicts import HarnessError, Verdict
from pkb.options import Mode, Status
from pkb.runtime.gpu_memory import NvmlReader
from pkb.runtime.group import GroupFailure, RankCrashed, RankTimeout, StartFailure
from pkb.runtime.messages import RankFailure

# What a rank may say went wrong, as the parent takes it (any other word: a runtime error).
SAID = {"runtime_error": Status.RUNTIME_ERROR, "import_error": Status.IMPORT_ERROR,
        "compile_error": Status.COMPILE_ERROR, "signature_error": Status.SIGNATURE_ERROR,
        "tampered": Status.TAMPERED, "forbidden": Status.FORBIDDEN}
# Failures of the candidate's code that a missing GPU (or NVSHMEM) can explain, where its source shows it needs one.
MISSING_WHAT_IT_NEEDS = (Status.RUNTIME_ERROR, Status.IMPORT_ERROR, Status.COMPILE_ERROR)
FULL_GPU_SHARE = 0.9  # a shared GPU the driver reports this full: the ranks ran out of the memory they share
# Who caused a ``skipped`` (``Details.skipped_by``): the run (every candidate of the problem alike: left out of
# pass@k's n) or the candidate (what its code needs or did: counted as not passed).
SKIPPED_BY_RUN, SKIPPED_BY_CANDIDATE = "run", "candidate"
SKIP_CAUSES = (SKIPPED_BY_RUN, SKIPPED_BY_CANDIDATE)


@dataclass(frozen=True)
class Facts:
    """What the parent holds about the run and the candidate, from which alone it decides ``skipped``."""

    mode: Mode
    candidate: Candidate
    nodes: int = 1

    def skipped_by(self, status: Status, rank: int) -> str | None:
        """Why a failure with ``status`` is ``skipped`` (a skip the candidate causes: counted as not passed) rather than
        the failure it is, from the parent's own facts; None where it is that failure."""
        if status not in MISSING_WHAT_IT_NEEDS and status is not Status.CRASH:
            return None
        gpu_code = self.candidate.gpu_code
        if not self.mode.uses_gpu and gpu_code and status is not Status.CRASH:
            return (f"the candidate needs a GPU (its source {gpu_code}) and mode {self.mode} has none: counted as not "
                    "passed (run it with --mode cuda or shared-gpu)")
        if self.candidate.uses_nvshmem and status is not Status.CRASH and (self.mode is not Mode.CUDA or self.nodes > 1):
            where = self.candidate.nvshmem_code
            source = f" (its source {where})" if where else ""
            return (f"the candidate uses NVSHMEM{source}, which this run cannot give "
                    f"({self.mode} mode on {self.nodes} node(s): NVSHMEM needs a GPU per rank, and real nodes): "
                    "counted as not passed (run it with --mode cuda on one node, or on real nodes)")
        if self.mode is Mode.SHARED_GPU:
            full = _full_gpus()
            if full:
                return (f"rank {rank} failed while the GPU the ranks share was full ({full}): in shared-gpu mode the W "
                        "ranks share one GPU's memory where a GPU of the target machine holds one rank, so this run "
                        "cannot tell whether it passes: counted as not passed (run it with --mode cuda, or at a "
                        "smaller world size)")
        return None


def _full_gpus() -> str:
    """The GPUs the driver reports at least FULL_GPU_SHARE used, in words (empty where none is, or without a driver)."""
    reader = NvmlReader.open()
    if reader is None:
        return ""
    try:
        total, free = reader.total_bytes(), reader.free_bytes()
    except RuntimeError:
        return ""
    full = [f"GPU {device}: {(total[device] - free[device]) / (1 << 30):.1f} of {total[device] / (1 << 30):.1f} GiB used"
            for device in total if total[device] and (total[device] - free[device]) >= FULL_GPU_SHARE * total[device]]
    return "; ".join(full)


def raise_failure(replies: list, facts: Facts, where: dict) -> None:
    """Raise the Verdict that the first real failure among ``replies`` (typed replies, pkb.runtime.messages) earns;
    return where none failed. ``where``: the case and trial, for the message and the details."""
    failed = [rank for rank, reply in enumerate(replies) if isinstance(reply, RankFailure)]
    if not failed:
        return
    rank = _first_real(replies, failed)
    failure: RankFailure = replies[rank]
    if failure.said == "malformed":
        status = Status.CRASH
    else:
        status = SAID.get(failure.said, Status.RUNTIME_ERROR)
    place = ", ".join(f"{key} {value}" for key, value in where.items() if value is not None)
    message = f"rank {rank}" + (f", {place}" if place else "") + f": {_last_line(failure.error)}"
    skipped = facts.skipped_by(status, rank)
    if skipped:
        raise Verdict(Status.SKIPPED, skipped, rank=rank, error=failure.error, skipped_by=SKIPPED_BY_CANDIDATE,
                      pkb_limits=["memory"] if facts.mode is Mode.SHARED_GPU and "shared-gpu mode" in skipped else [])
    raise Verdict(status, message, rank=rank, **where, error=failure.error, traceback=failure.traceback)


def _first_real(replies: list, failed: list[int]) -> int:
    """The rank to report: one that failed itself, not one cut short while it waited for (or was still busy beside)
    the rank that failed; tampering before anything else."""
    real = [rank for rank in failed if not replies[rank].stuck]
    tampering = [rank for rank in real if replies[rank].said == "tampered"]
    return (tampering or real or failed)[0]


def _last_line(error: str) -> str:
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no error given"


@contextlib.contextmanager
def candidate_failures(what: str, facts: Facts | None = None, **where):
    """Turn a candidate group's timeout or death into the verdict it earns (``where``: the case and trial)."""
    try:
        yield
    except StartFailure as exc:  # before any candidate code ran
        raise HarnessError(f"{what}: {exc}\n{exc.log_tail}") from None
    except RankTimeout as exc:
        raise Verdict(Status.TIMEOUT, f"{what}: {exc}" + _stacks_text(exc.stacks), rank=exc.rank,
                      log_tail=exc.log_tail, stacks=exc.stacks, **where) from None
    except RankCrashed as exc:
        skipped = facts.skipped_by(Status.CRASH, exc.rank or 0) if facts is not None else None
        if skipped:
            raise Verdict(Status.SKIPPED, skipped, rank=exc.rank, pkb_limits=["memory"],
                          skipped_by=SKIPPED_BY_CANDIDATE) from None
        raise Verdict(Status.CRASH, f"{what}: {exc}", rank=exc.rank, log_tail=exc.log_tail, **where) from None
    except GroupFailure as exc:
        raise Verdict(Status.CRASH, f"{what}: {exc}", **where) from None


_PKB_ROOT = str(Path(__file__).resolve().parents[1]) + os.sep
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (.*)$')


def _stacks_text(stacks: dict[int, str]) -> str:
    """Each hung rank's stack where it hung, the candidate's own frames first (pkb's and torch's after, counted)."""
    parts = []
    for rank, stack in sorted(stacks.items()):
        frames = [match for match in map(_FRAME.match, stack.splitlines()) if match]
        if not frames:
            continue
        own = [f"{Path(m.group(1)).name}:{m.group(2)} in {m.group(3).strip()}" for m in frames
               if not m.group(1).startswith((_PKB_ROOT, "<")) and "/site-packages/" not in m.group(1)
               and "/lib/python" not in m.group(1)]
        others = len(frames) - len(own)
        shown = own[:8] or [f"{Path(m.group(1)).name}:{m.group(2)} in {m.group(3).strip()}" for m in frames[:4]]
        parts.append(f"rank {rank} was at " + " <- ".join(shown)
                     + (f" ({others} frame{'s' * (others != 1)} of pkb, torch and Python below)" if own and others else ""))
    return ("; " + "; ".join(parts)) if parts else ""
