"""The rank processes of one evaluation, and the one place where the evaluation talks to them (pkb.runtime).

``Ranks`` holds what one evaluation runs on: the session's trusted reference group (which also computes the exact
answers and the reference's timings), the candidate's group (a new one, loaded again, where a trial needs fresh
processes or the last one died: ``renew``), and the seeds, drawn from the session's secret salt. Each operation
returns what the ranks sent, typed (pkb.runtime.messages), or raises what the candidate's processes earned
(``Verdict``, pkb.evaluate.failures) or pkb's own failure (``HarnessError``); the rest of pkb.evaluate judges, and never
reaches the runtime.

    ranks = Ranks(session, problem, candidate, config).start()   # the reference loaded, the candidate loaded
    replies = ranks.run(case, trial=0)                            # pkb's secret values: .expected, .got per rank
    exact = ranks.exact(case, trial=0)                            # the exact answer and its sensitivity, per rank
    ranks.close()
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from pkb.evaluate.accuracy import PERTURBATIONS, Exact
from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.failures import SKIPPED_BY_CANDIDATE, Facts, candidate_failures, raise_failure
from pkb.evaluate.session import Session
from pkb.evaluate.verdicts import HarnessError, Verdict, raise_reference_errors, used
from pkb.options import Status
from pkb.problem import Case, Problem
from pkb.runtime.channel import MAX_MESSAGE_BYTES, tensor_bytes
from pkb.runtime.group import RankGroup
from pkb.runtime.guards import moved_inside_a_node
from pkb.runtime.messages import (Ack, CheckReply, ExactReply, FinishReply, OutputsReply, PrepareReply, RepeatReply,
                                  RunJob, RunReply, load_job, run_job, time_check_job, time_copies_job, time_exact_job,
                                  time_prepare_job, time_refresh_job, time_repeat_job, time_step_job)
from pkb.runtime.sandbox import SandboxStatus

# A candidate's reply may take this many times the reference's bytes (and a little more): an honest one matches the
# reference's structure; a reply far larger is an attempt on the parent's memory, the candidate's failure.
REPLY_FACTOR, REPLY_SLACK = 4, 16 << 20


@dataclass
class Replies:
    """The reference's and the candidate's replies to one case and trial, one per rank."""

    expected: list[RunReply]
    got: list[RunReply]


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
        self.used: list[str] = []  # the stock calls the candidate's ranks said they made, in any group so far (``_said``)
        self.facts = Facts(config.mode, candidate, config.nodes or problem.nodes[0]) if candidate is not None else None

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
            self._said([])  # what its ranks noted stays this evaluation's when the next group starts
            self.group.kill()

    def _said(self, replies: list) -> None:
        """Add to ``used`` the stock calls ``replies`` list and every one the group's ranks noted mid-job (each
        label went to the parent before its call ran: pkb.runtime.guards.StockCallRecorder)."""
        self.used = sorted(set(self.used) | set(used(replies)) | set(self.group.stock_calls))

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
        """What the candidate's processes ran under (their keeper's report, before any candidate code ran); for
        ``required``, HarnessError unless the full set."""
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
        with candidate_failures("loading the candidate", self.facts):
            self.group.submit([job] * self.config.world_size)
            replies = self.group.collect(self.config.timeout, Ack, self.config.compile_limit_s, REPLY_SLACK)
        raise_failure(replies, self.facts, {})
        self._said(replies)

    # -- correctness ------------------------------------------------------------------------------------------

    def run(self, case: Case, trial) -> Replies:
        """Both groups' replies to ``case`` on pkb's secret values of ``trial`` (the reference's kept for the
        session: the seeds follow from the case, the trial and the session's salt)."""
        return self._run(case, self._jobs(case, trial), ("pkb", trial), f"case {case.name}, trial {trial}", trial)

    def run_upstream(self, case: Case, trial: int) -> Replies:
        """Both groups' replies to an upstream case on upstream's own values of ``trial`` (the paper's verdict)."""
        jobs = self._jobs(case, ("upstream", trial), trial=trial)
        return self._run(case, jobs, ("upstream", trial), f"upstream's inputs, trial {trial}", trial)

    def exact(self, case: Case, trial) -> list[Exact]:
        """The exact answer to ``case`` on pkb's values of ``trial`` and its sensitivity, per rank: the reference in
        fp64 arithmetic, and again on PERTURBATIONS perturbed copies of its inputs (pkb.runtime.exact); kept for the
        session like the reference's own answers."""
        key = self._key(case, ("exact", trial))
        found = self.session.reference_outputs.get(key)
        if found is None:
            seed = self.session.seed(self.problem.name, case.name, trial, "perturbation")
            jobs = self._jobs(case, trial, exact=True, perturbations=PERTURBATIONS, perturbation_seed=seed)
            what = (f"the exact answer (fp64) to case {case.name}: a reference that cannot run in fp64 must say so "
                    "(Problem.exact_dtype)")
            replies = self._beside_the_candidate(
                lambda: self.reference.request(jobs, self.config.compile_limit_s, ExactReply), jobs, ExactReply, what)
            found = [Exact(reply.outputs, reply.inputs_after, reply.sensitivity, reply.unavailable) for reply in replies]
            self.session.reference_outputs.put(key, found)
        return found

    def _beside_the_candidate(self, replies_of: Callable[[], list], jobs: list, kind: type, what: str) -> list:
        """The reference's replies (``replies_of``: its answer to ``jobs``, sent while the candidate's processes are
        alive). The candidate's processes share the machine with it (in GPU modes the devices and their memory, which
        they may fill): where the reference fails beside them, it runs ``jobs`` again alone, in new processes. A
        failure alone too is pkb's (HarnessError); a pass alone makes the first failure the candidate's doing."""
        try:
            replies = replies_of()
            raise_reference_errors(replies, self.problem, what)
            return replies
        except Exception as beside:  # noqa: BLE001 - decided below: pkb's own failure or the candidate's doing
            if not self.alive:
                raise
            self.close()
            self.session.renew_reference()
            replies = self.reference.request(jobs, max(self.config.timeout, self.config.compile_limit_s), kind)
            raise_reference_errors(replies, self.problem, f"{what}, run alone")
            first = str(beside).strip().splitlines()[0][:300] if str(beside).strip() else type(beside).__name__
            skipped = self.facts.skipped_by(Status.RUNTIME_ERROR, 0)
            if skipped:
                raise Verdict(Status.SKIPPED, skipped, skipped_by=SKIPPED_BY_CANDIDATE, error=str(beside)) from None
            raise Verdict(Status.RUNTIME_ERROR, f"{what}: the reference failed while the candidate's processes ran beside "
                                                f"it ({first}) and passed alone, in new processes: the candidate's "
                                                "processes took what it needed (memory, the devices)",
                          error=str(beside)) from None

    def _jobs(self, case: Case, seeded_by, **upstream_or_exact) -> list[RunJob]:
        """Each rank's ``run`` job of ``case`` with the seeds of ``seeded_by`` (a trial): pkb's values (``trial=t``:
        upstream's values instead; ``exact=True``: the exact answer)."""
        seed, name = self.session.seed, self.problem.name
        shared = seed(name, case.name, seeded_by, "shared")
        return [run_job(case.name, self.config.dtype, self.config.nodes, (seed(name, case.name, seeded_by, rank), shared),
                        **upstream_or_exact) for rank in range(self.config.world_size)]

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
        reference = self.reference if expected is None else None  # held: between submit and collect it is awaiting
        if expected is None:
            reference.submit(jobs)
        with candidate_failures(what, self.facts, case=case.name, trial=trial):
            self.group.submit(jobs)
        if expected is None:
            expected = self._beside_the_candidate(lambda: reference.collect(self.config.timeout, RunReply),
                                                  jobs, RunReply, what)
            self.session.reference_outputs.put(key, expected)
        limit = min(MAX_MESSAGE_BYTES, REPLY_FACTOR * max(tensor_bytes([r.outputs, r.inputs_after]) for r in expected)
                    + REPLY_SLACK)
        with candidate_failures(what, self.facts, case=case.name, trial=trial):
            got = self.group.collect(self.config.timeout, RunReply, compile_limit, limit)
        raise_failure(got, self.facts, {"case": case.name, "trial": trial})
        self._said(got)
        return Replies(expected, got)

    # -- timing: one phase at a time (the protocol and its rules: pkb.evaluate.timing) ------------------------------

    def prepare(self, reference: bool, case: Case, max_copies: int) -> tuple[list[PrepareReply], float]:
        """Warm-up and estimates of one group (``reference``: the reference's, else the candidate's), with seeds for up
        to ``max_copies`` input copies (the same for both groups, none of any correctness trial's)."""
        config = self.config
        jobs = [time_prepare_job(case.name, config.dtype, config.nodes,
                                 [self._slot_seeds(case, rank, k) for k in range(max_copies)], config.timing.__dict__)
                for rank in range(config.world_size)]
        return self._phase(reference, jobs, PrepareReply, f"timing case {case.name}: warm-up")

    def _slot_seeds(self, case: Case, rank: int, slot: int) -> tuple[int, int]:
        """The seeds of input slot ``slot`` of ``case`` on ``rank`` (its own, and the one every rank shares)."""
        seed, name = self.session.seed, self.problem.name
        return seed(name, case.name, "time", rank, slot), seed(name, case.name, "time", slot)

    def copies(self, reference: bool, num_copies: int) -> tuple[list[Ack], float]:
        return self._phase(reference, time_copies_job(num_copies), Ack, "timing: building the input copies")

    def refresh(self, reference: bool, round_index: int, entropy: int) -> tuple[list[Ack], float]:
        return self._phase(reference, time_refresh_job(round_index, entropy), Ack,
                           f"timing: refreshing inputs ({round_index})")

    def repeat(self, reference: bool, num_calls: int, entropy: int) -> tuple[list[RepeatReply], float]:
        return self._phase(reference, time_repeat_job(num_calls, entropy), RepeatReply, "timing: a timed repeat")

    def check(self, reference: bool, seed: int, num_projections: int, full: list[int] = ()
              ) -> tuple[list[CheckReply], float]:
        return self._phase(reference, time_check_job(seed, num_projections, full), CheckReply,
                           "timing: checking a repeat")

    def timed_exact(self, case: Case, slot: int, round_index: int, entropy: int, repeat_entropy: int,
                    perturbation_seed: int) -> list[Exact]:
        """The exact answer (the reference in fp64 arithmetic) to the timed call on slot ``slot`` (call ``slot`` of
        its repeat, whose entropy is ``repeat_entropy``) in refresh round ``round_index`` (``entropy``: that round's
        refresh entropy), and its sensitivity, per rank: the same inputs the timed call ran on, rebuilt from the same
        numbers (pkb.runtime.timed_loop)."""
        config = self.config
        jobs = [time_exact_job(case.name, config.dtype, config.nodes, self._slot_seeds(case, rank, slot), round_index,
                               entropy, repeat_entropy, slot, PERTURBATIONS, perturbation_seed)
                for rank in range(config.world_size)]
        replies = self._beside_the_candidate(
            lambda: self.reference.request(jobs, self.config.compile_limit_s, ExactReply), jobs, ExactReply,
            f"the exact answer (fp64) to a timed call of case {case.name}")
        return [Exact(reply.outputs, reply.inputs_after, reply.sensitivity, reply.unavailable) for reply in replies]

    def finish(self, reference: bool) -> tuple[list[FinishReply], float]:
        return self._phase(reference, time_step_job("time_finish"), FinishReply, "timing: the end")

    def outputs(self, reference: bool) -> tuple[list[OutputsReply], float]:
        return self._phase(reference, time_step_job("time_outputs"), OutputsReply, "timing: the timed outputs")

    def _phase(self, reference: bool, job, kind: type, what: str) -> tuple[list, float]:
        """Every rank's typed reply to ``job`` (one job for all ranks, or one per rank) and the seconds the parent's
        clock saw pass from sending it to the last reply. A failing candidate group raises the Verdict it earns; a
        failing reference, HarnessError (pkb's own failure)."""
        jobs = job if isinstance(job, list) else [job] * self.config.world_size
        timeout = self.config.timeout + 60
        began = time.monotonic()
        if reference:
            replies = self.reference.request(jobs, timeout, kind)
            raise_reference_errors(replies, self.problem, what)
            return replies, time.monotonic() - began
        if not self.alive:
            self.renew()
        with candidate_failures(what, self.facts, trial="timing"):
            replies = self.group.request(jobs, timeout, kind)
        elapsed = time.monotonic() - began
        raise_failure(replies, self.facts, {"trial": "timing"})
        self._said(replies if kind in (OutputsReply, FinishReply) else [])
        return replies, elapsed
