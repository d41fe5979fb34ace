"""The rank processes of one evaluation, and the one place where the evaluation talks to them (pkb.runtime).

``Ranks`` holds what one evaluation runs on: the session's trusted reference group (which also computes the exact
answers and the reference's timings), the candidate's group (a new one, loaded again, where a trial needs fresh
processes or the last one died: ``renew``), and the seeds, drawn from the session's secret salt. Each operation
returns what the ranks sent (plain data: pkb.runtime.channel) or raises what the candidate's processes earned
(``Verdict``) or pkb's own failure (``HarnessError``); the rest of pkb.evaluate judges, and never reaches the runtime.

    ranks = Ranks(session, problem, candidate, config).start()   # the reference loaded, the candidate loaded
    replies = ranks.run(case, trial=0)                            # pkb's secret values: .expected, .got per rank
    exact = ranks.exact(case, trial=0)                            # the reference again in its exact_dtype
    ranks.close()
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
from dataclasses import dataclass

from pkb.evaluate.candidate import Candidate, gpu_needed_by
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.session import Session
from pkb.evaluate.verdicts import HarnessError, Verdict, raise_reference_errors, used
from pkb.options import Status
from pkb.problem import Case, Problem
from pkb.runtime.group import GroupFailure, RankCrashed, RankGroup, RankTimeout, StartFailure
from pkb.runtime.guards import moved_inside_a_node
from pkb.runtime.messages import (Reply, RunJob, load_job, run_job, time_outputs_job, time_prepare_job,
                                  time_refresh_job, time_step_job)
from pkb.runtime.modes import Mode
from pkb.runtime.sandbox import SandboxStatus


@dataclass
class Replies:
    """The reference's and the candidate's replies to one case and trial, one per rank (``outputs``,
    ``inputs_after``, ``collectives_used``)."""

    expected: list[Reply]
    got: list[Reply]


@dataclass
class GroupTiming:
    """One group's timing of one case, from the parent's own clock unless said otherwise."""

    repeat_s: list[float]  # seconds per call in each repeat
    refresh_s: list[float]  # seconds each untimed refresh of the input values took
    finish_s: float  # seconds the final synchronize (and joining leftover threads) took
    num_iters: int  # calls per repeat
    rank_clock_s: float  # median of the slowest rank's own wall clock, per call (a cross-check)
    event_s: float | None  # median of the slowest rank's CUDA-event time, per call
    outputs: list  # per rank: the last output computed on each input copy
    threads_left_running: int
    collectives_used: list[str]  # stock calls the group's code made (candidate groups only)

    @property
    def median_s(self) -> float:
        return statistics.median(self.repeat_s)

    @property
    def spread(self) -> float:
        return spread(self.repeat_s)

    def per_call_s(self, refresh_allowance_s: float | None = None) -> float:
        """The median repeat, or, if larger, all the time the group took divided by its timed calls.

        Everything from the first repeat to the end of ``finish`` counts, refreshes included beyond
        ``refresh_allowance_s`` each (what the same refresh took the reference): work a rank defers
        past a repeat's reply (threads, unsynchronised streams) lands in a later phase and still counts.
        """
        allowance = self.refresh_allowance() if refresh_allowance_s is None else refresh_allowance_s
        deferred = sum(max(0.0, r - allowance) for r in self.refresh_s) + self.finish_s
        total = (sum(self.repeat_s) * self.num_iters + deferred) / (self.num_iters * len(self.repeat_s))
        return max(self.median_s, total)

    def refresh_allowance(self) -> float:
        """Time an honest refresh may take: 1.5x this group's median refresh plus 5 ms (for the reference)."""
        return 1.5 * statistics.median(self.refresh_s) + 0.005 if self.refresh_s else 0.0

    @property
    def timer_disagreement(self) -> bool:
        return self.event_s is not None and abs(self.rank_clock_s - self.event_s) > 0.1 * self.rank_clock_s


def spread(values: list[float]) -> float:
    """(max - min) / median: how far repeated measurements of one thing fall apart."""
    return (max(values) - min(values)) / statistics.median(values)


class Ranks:
    """The reference's and one candidate's rank processes for one evaluation (``candidate`` None: the reference's
    alone, for measuring it). The session's reference group is shared by its evaluations; the candidate's groups
    are this evaluation's and end with it (``close``)."""

    def __init__(self, session: Session, problem: Problem, candidate: Candidate | None, config: EvalConfig):
        self.session = session
        self.problem = problem
        self.candidate = candidate
        self.config = config
        self.group: RankGroup | None = None  # the candidate's current group
        self.num_groups = 0  # candidate groups started so far (a trial in new processes starts one)
        self.used: list[str] = []  # the stock calls the candidate's ranks said they made, in their last reply

    @property
    def reference(self) -> RankGroup:
        """The session's reference group, with this problem loaded."""
        return self.session.reference_group(self.problem, self.config.compile_limit_s)

    # -- the candidate's processes -------------------------------------------------------------------------

    def start(self) -> "Ranks":
        """The reference's group loaded and the candidate's started and loaded; a Verdict if it fails to load."""
        self.reference
        self.renew()
        return self

    def renew(self) -> None:
        """End the candidate's processes (if any) and load it in new ones: what a trial run as upstream runs it
        needs, and what follows a failure that may have left the old ones stuck."""
        self.close()
        self.group = self.session.candidate_group()
        self.num_groups += 1
        self._load()

    @property
    def fresh(self) -> bool:
        """Whether the candidate's current processes have run nothing yet (as new as upstream's every trial)."""
        return self.group is not None and not self.group.closed and self.group.num_runs == 0

    @property
    def alive(self) -> bool:
        return self.group is not None and not self.group.closed

    def close(self) -> None:
        """End the candidate's processes (never reused: no need to let them wind down)."""
        if self.group is not None:
            self.group.kill()

    @property
    def limits_hit(self) -> list[str]:
        """pkb's own limits that refused something the candidate's ranks asked for (named in the verdict)."""
        return list(self.group.limits_hit) if self.group is not None else []

    def sandbox_offered(self) -> dict:
        """What this machine offers the candidate's processes, before a group says what it enforced."""
        return self.session.sandbox_offered.to_dict()

    @staticmethod
    def moved_inside_a_node(labels: list[str]) -> list[str]:
        """The stock calls among the candidate's ``collectives_used`` that moved data inside a node: what
        ``--policy forbid-collectives`` forbids (across nodes torch.distributed is the network, and allowed)."""
        return moved_inside_a_node(labels)

    def sandbox(self) -> dict:
        """What the candidate's processes ran under; for ``required``, HarnessError unless the full set."""
        if self.session.sandbox == "off":
            return SandboxStatus.off().to_dict()
        status = (self.group.sandbox_status if self.group is not None else None) or {
            "level": self.session.sandbox, "full": False, "enforced": [],
            "missing": {"all": "the ranks did not say what they enforced"}}
        if self.session.sandbox == "required" and not status.get("full"):
            raise HarnessError(f"--sandbox required, but the candidate's sandbox lacked: {status.get('missing')}")
        return status

    def _load(self) -> None:
        candidate = self.candidate
        job = load_job(self.problem.module, None if candidate.is_reference else str(candidate.path),
                       None if candidate.is_reference else candidate.source)
        with candidate_failures("loading the candidate"):
            self.group.submit([job] * self.config.world_size)
            replies = self.group.collect(self.config.timeout, self.config.compile_limit_s)
        failed = [rank for rank, reply in enumerate(replies) if reply.get("status") != "ok"]
        if failed:
            rank = first_real_failure(replies, failed[0])
            reply = replies[rank]
            skip_if_not_the_candidates(reply, self.config.mode, rank)
            status = Status(reply["status"]) if reply.get("status") in Status._value2member_map_ else Status.RUNTIME_ERROR
            first_line = (reply.get("error") or "").strip().splitlines()[-1:] or [""]
            raise Verdict(status, f"rank {rank}: {first_line[0]}", rank=rank, error=reply.get("error", ""),
                          traceback=reply.get("traceback", ""))

    # -- correctness ------------------------------------------------------------------------------------------

    def run(self, case: Case, trial) -> Replies:
        """Both groups' replies to ``case`` on pkb's secret values of ``trial`` (the reference's kept for the
        session: the seeds follow from the case, the trial and the session's salt)."""
        return self._run(case, self._jobs(case, trial), ("pkb", trial), f"case {case.name}, trial {trial}", trial)

    def run_upstream(self, case: Case, trial: int) -> Replies:
        """Both groups' replies to an upstream case on upstream's own values of ``trial`` (the paper's verdict)."""
        jobs = self._jobs(case, ("upstream", trial), trial=trial)
        return self._run(case, jobs, ("upstream", trial), f"upstream's inputs of case {case.name}, trial {trial}", trial)

    def exact(self, case: Case, trial) -> list[Reply]:
        """The exact answer to ``case`` on pkb's values of ``trial``: the reference on the inputs raised to the
        problem's ``exact_dtype``, per rank (kept for the session like the reference's own answers)."""
        key = self._key(case, ("exact", trial))
        replies = self.session.reference_outputs.get(key)
        if replies is None:
            jobs = self._jobs(case, trial, exact=True)
            replies = self.reference.request(jobs, self.config.compile_limit_s)
            raise_reference_errors(replies, self.problem, f"the exact answer ({self.problem.exact_dtype}) to case "
                                                          f"{case.name}: a reference that cannot run in its "
                                                          "exact_dtype must say so (Problem.exact_dtype)")
            self.session.reference_outputs.put(key, replies)
        return replies

    def _jobs(self, case: Case, seeded_by, **upstream_or_exact) -> list[RunJob]:
        """Each rank's ``run`` job of ``case`` with the seeds of ``seeded_by`` (a trial): pkb's values (``trial=t``:
        upstream's values instead; ``exact=True``: the exact answer), and the places of a large output's sample."""
        seed, name = self.session.seed, self.problem.name
        shared, sample = seed(name, case.name, seeded_by, "shared"), seed(name, case.name, seeded_by, "sample")
        return [run_job(case.name, self.config.dtype, self.config.nodes,
                        (seed(name, case.name, seeded_by, rank), shared), sample, **upstream_or_exact)
                for rank in range(self.config.world_size)]

    def _key(self, case: Case, which) -> tuple:
        return (self.problem.module, self.problem.version, case.name, self.config.dtype, self.config.nodes, which)

    def _run(self, case: Case, jobs: list[RunJob], which, what: str, trial) -> Replies:
        """Both groups' replies to ``jobs``; a Verdict if the candidate failed to answer."""
        if not self.alive:
            self.renew()
        # The first call in new processes may build extensions and compile kernels (as many solutions do
        # lazily): while what it started compiles, it gets up to the time a load gets, so that the verdict does
        # not hang on how fast this machine, and whatever runs beside it, compiles. A hang compiles nothing.
        compile_limit = None if self.group.num_runs else self.config.compile_limit_s
        key = self._key(case, which)
        expected = self.session.reference_outputs.get(key)
        if expected is None:
            self.reference.submit(jobs)
        with candidate_failures(what, case=case.name, trial=trial):
            self.group.submit(jobs)
        if expected is None:
            expected = self.reference.collect(self.config.timeout)
            raise_reference_errors(expected, self.problem, what)
            self.session.reference_outputs.put(key, expected)
        with candidate_failures(what, case=case.name, trial=trial):
            got = self.group.collect(self.config.timeout, compile_limit)
        for rank in range(self.config.world_size):
            if got[rank].get("error"):
                raise_candidate_error(got, rank, {"case": case.name, "trial": trial}, self.config.mode)
        self.used = used(got)
        return Replies(expected, got)

    # -- timing ----------------------------------------------------------------------------------------------

    def time(self, case: Case) -> tuple[GroupTiming, GroupTiming]:
        """The reference's timing of ``case``, then the candidate's (one group at a time: they never share the
        devices while timed)."""
        expected = self.time_reference(case)
        with candidate_failures(f"timing case {case.name}"):
            try:
                got = self._time_group(self.group, case)
            except RankError as exc:
                raise_candidate_error(exc.replies, exc.rank, {"case": case.name, "trial": "timing"}, self.config.mode)
        self.used = got.collectives_used
        return expected, got

    def time_reference(self, case: Case) -> GroupTiming:
        """The reference's timing of ``case`` (``per_call_s()``: seconds per call, from the parent's clock)."""
        try:
            return self._time_group(self.reference, case)
        except RankError as exc:
            raise HarnessError(f"the reference of {self.problem.name} failed while timed: {exc}\n"
                               f"{exc.replies[exc.rank].get('traceback', '')}") from None

    def _time_group(self, group: RankGroup, case: Case) -> GroupTiming:
        """Drive the timing phases (pkb.runtime.timed_loop.TimedLoop), each timed with the parent's clock.

        Inputs come from the same secret seeds for reference and candidate (different from every correctness
        trial's); before every repeat but the first, the copies get new values in place.
        """
        config, name, seed = self.config, self.problem.name, self.session.seed
        W, timeout = config.world_size, config.timeout + 60
        seeds = [[(seed(name, case.name, "time", rank, k), seed(name, case.name, "time", k))
                  for k in range(Session.MAX_TIMING_COPIES)] for rank in range(W)]
        prepared = checked(group.request([time_prepare_job(case.name, config.dtype, config.nodes, seeds[rank],
                                                           config.timing.__dict__) for rank in range(W)], timeout))
        num_iters = prepared[0]["num_iters"]
        if any(reply["num_iters"] != num_iters for reply in prepared):
            raise GroupFailure(f"ranks disagree on the number of timed calls: {[r['num_iters'] for r in prepared]}")
        repeat_s, refresh_s, rank_s, event_s = [], [], [], []
        for round_index in range(config.timing.num_repeats):
            if round_index:
                began = time.monotonic()
                checked(group.request([time_refresh_job(round_index)] * W, timeout))
                refresh_s.append(time.monotonic() - began)
            began = time.monotonic()
            replies = checked(group.request([time_step_job("time_repeat")] * W, timeout))
            repeat_s.append((time.monotonic() - began) / num_iters)
            rank_s.append(max(reply["wall_s"] for reply in replies))
            events = [reply["event_s"] for reply in replies]
            event_s.append(max(events) if None not in events else None)
        began = time.monotonic()
        finished = checked(group.request([time_step_job("time_finish")] * W, timeout))
        finish_s = time.monotonic() - began
        sample_seed = seed(name, case.name, "sample")
        outputs = checked(group.request([time_outputs_job(sample_seed)] * W, timeout))
        return GroupTiming(repeat_s=repeat_s, refresh_s=refresh_s, finish_s=finish_s, num_iters=num_iters,
                           rank_clock_s=statistics.median(rank_s),
                           event_s=statistics.median(event_s) if None not in event_s else None,
                           outputs=[reply["outputs"] for reply in outputs],
                           threads_left_running=max(reply["threads_left_running"] for reply in finished),
                           collectives_used=used(outputs))


# -- what a failure of the candidate's ranks earns --------------------------------------------------------------


def first_real_failure(replies: list[dict], default: int) -> int:
    """The rank to report: one that failed itself, not one cut short while it waited for (or was still
    busy beside) the rank that failed; tampering before anything else."""
    real = [r for r, reply in enumerate(replies) if reply.get("error") and not reply.get("stuck")]
    tampering = [r for r in real if replies[r].get("status") == Status.TAMPERED.value]
    return (tampering or real or [default])[0]


def raise_candidate_error(replies: list[dict], rank: int, where: dict, mode: Mode) -> None:
    rank = first_real_failure(replies, rank)
    reply = replies[rank]
    skip_if_not_the_candidates(reply, mode, rank)
    # tampered, or refused by the peer-memory fence (forbidden across nodes; skipped where the mode lacks NVSHMEM)
    status = Status(reply["status"]) if reply.get("status") in (Status.TAMPERED.value, Status.FORBIDDEN.value,
                                                                Status.SKIPPED.value) else Status.RUNTIME_ERROR
    raise Verdict(status, f"rank {rank}, case {where['case']}, trial {where['trial']}: {reply['error']}",
                  rank=rank, **where, error=reply["error"], traceback=reply.get("traceback", ""))


# "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which ..."; the
# driver's "CUDA driver error: out of memory"; cudaErrorMemoryAllocation
_OUT_OF_MEMORY = re.compile(r"out of memory|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY", re.IGNORECASE)
_ASKED = re.compile(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)")
_CAPACITY = re.compile(r"total capacity of ([\d.]+) (B|KiB|MiB|GiB|TiB)")
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def _bytes_in(pattern: re.Pattern, text: str) -> float | None:
    found = pattern.search(text)
    return float(found.group(1)) * _UNITS[found.group(2)] if found else None


def skip_if_not_the_candidates(reply: dict, mode: Mode, rank: int) -> None:
    """A failure that says more of this mode than of the candidate is ``skipped``, not failed: in a mode without
    a GPU, code that needs one; in shared-gpu mode, an allocation the shared GPU could not give although one GPU
    would hold it (the W ranks share one GPU's memory there, while each rank of the target machine has a GPU of
    its own). An allocation larger than the whole GPU is the candidate's, in any mode."""
    if reply.get("status") == Status.TAMPERED.value:
        return
    text = f"{reply.get('error', '')}\n{reply.get('traceback', '')}"
    if not mode.uses_gpu:
        evidence = gpu_needed_by(text)
        if evidence:
            raise Verdict(Status.SKIPPED, f"the candidate needs a GPU (rank {rank}: {evidence}); mode {mode} has none "
                                          "(run it with --mode cuda or shared-gpu)", rank=rank, error=reply.get("error", ""))
    elif mode is Mode.SHARED_GPU and _OUT_OF_MEMORY.search(text):
        asked, capacity = _bytes_in(_ASKED, text), _bytes_in(_CAPACITY, text)
        if asked is not None and capacity is not None and asked > capacity:
            return  # more than a GPU of its own would hold: the candidate's failure
        figures = (f"it asked for {asked / (1 << 30):.2f} GiB of a {capacity / (1 << 30):.2f} GiB GPU"
                   if asked is not None and capacity is not None else "the error gives no sizes")
        raise Verdict(Status.SKIPPED, f"rank {rank} ran out of GPU memory in shared-gpu mode ({figures}), where the "
                                      "ranks share one GPU's memory and a GPU of the target machine holds one rank: "
                                      "pkb's limit, not a verdict on the candidate (run it with --mode cuda, or at a "
                                      "smaller world size)", rank=rank, error=reply.get("error", ""), pkb_limit="memory")


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
