"""The rank groups behind evaluations of one (mode, world size, sandbox level), kept warm across them."""

from __future__ import annotations

import functools
import hashlib
import secrets
from collections import OrderedDict

from pkb.evaluate.verdicts import raise_reference_errors
from pkb.problem import Problem
from pkb.runtime.builds import BuildBroker
from pkb.runtime.channel import tensor_bytes
from pkb.runtime.group import RankGroup
from pkb.runtime.messages import Ack, load_job
from pkb.runtime.modes import Mode
from pkb.runtime.sandbox import check_sandbox


class ReferenceOutputs:
    """The reference's replies to the trials of one session, kept for the next evaluation of the same
    problem, case and trial: candidates of one problem (a model's k samples, a folder and the references)
    are judged against the reference's answer without running it again. A trial's inputs follow from the
    session's seeds, so a reply is the same whoever it is compared with. Once the replies' tensors pass
    ``max_bytes`` the largest go first, the least recently used of equal size first; none is kept that alone is
    larger. Not the least recently used alone: candidates evaluated one after another that each ask for more than
    fits (an upstream case's exact answers are 128 MiB a trial for a 1024 x 1024 all-reduce at W = 4) would then
    find nothing kept, the small answers included, as the least recently used is always the next one asked for."""

    MAX_BYTES = 512 << 20

    def __init__(self, max_bytes: int = MAX_BYTES):
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.hits = self.misses = 0
        self._replies: OrderedDict[tuple, tuple[list, int]] = OrderedDict()

    def get(self, key: tuple) -> list | None:
        found = self._replies.get(key)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        self._replies.move_to_end(key)
        return found[0]

    def put(self, key: tuple, replies: list) -> None:
        size = tensor_bytes([getattr(reply, "__dict__", reply) for reply in replies])  # typed replies, or exact answers
        if size > self.max_bytes or key in self._replies:
            return
        self._replies[key] = (replies, size)
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:  # the largest, the least recently used of them (max keeps the first)
            largest = max(self._replies, key=lambda kept: self._replies[kept][1])
            self.num_bytes -= self._replies.pop(largest)[1]


class Session:
    """Rank groups for one (mode, world size), reused across evaluations.

    The reference group is trusted and lives as long as the session. Every candidate gets a fresh
    group, in a sandbox of its own unless ``sandbox`` is ``off`` (``required``: SandboxUnavailable
    here unless this machine gives the full set); the next one is spawned while the current one works,
    so start-up is mostly hidden. The run salt behind every seed never leaves this process, and the
    reference's replies to its trials are kept for the next candidate of the same problem
    (``ReferenceOutputs``).
    """

    MAX_TIMING_COPIES = 64

    def __init__(self, mode: Mode, world_size: int, sandbox: str = "auto", broker: BuildBroker | None = None,
                 cpu_threads: int | None = None, nodes: int = 1):
        self.mode = mode
        self.world_size = world_size
        self.nodes = nodes  # the nodes its ranks are split into (pkb.topology; virtual on this machine)
        self.sandbox = sandbox
        self.cpu_threads = cpu_threads  # each rank's CPU threads when sessions run side by side (None: torch's default)
        self.sandbox_offered = check_sandbox(sandbox, mode)
        # ``broker``: one shared with other sessions of this sandbox level (a source is then built once
        # for all of them, however many evaluate it at once); default: a broker of its own
        self._broker = None if sandbox == "off" else broker or new_broker(sandbox)
        self._salt = secrets.token_bytes(32)
        self._reference: RankGroup | None = None
        self._reference_problem: str | None = None
        self._spare: RankGroup | None = None
        self._current: RankGroup | None = None  # the candidate group handed out last
        self.reference_outputs = ReferenceOutputs()

    def seed(self, *parts) -> int:
        digest = hashlib.blake2b("|".join(map(str, parts)).encode(), key=self._salt, digest_size=8).digest()
        return int.from_bytes(digest, "little") & (2**63 - 1)

    def start(self, timeout: float = 120.0) -> "Session":
        """Start the reference group now and wait until its ranks are up (before any problem is loaded)."""
        self._live_reference().wait_ready(timeout)
        return self

    def _live_reference(self) -> RankGroup:
        """The reference group, started anew where it has not started, has ended, or was sent a job whose replies were
        never read (an evaluation that ended between sending and reading: its next reply would be the stale one)."""
        if self._reference is not None and self._reference.awaiting:
            self._reference.kill()
        if self._reference is None or self._reference.closed:
            self._reference = RankGroup(self.mode, self.world_size, "reference", cpu_threads=self.cpu_threads,
                                        nodes=self.nodes).spawn()
            self._reference_problem = None
        return self._reference

    def renew_reference(self) -> None:
        """End the reference group (it may be stuck mid-collective after a failure); the next use starts a new one."""
        if self._reference is not None:
            self._reference.kill()
        self._reference = None

    def root_pids(self) -> list[int]:
        """The processes at the top of every rank group this session holds now (all their processes are
        below them): what its evaluations take of the machine."""
        groups = (self._reference, self._spare, self._current)
        return [pid for group in groups if group is not None and not group.closed for pid in group.root_pids()]

    def reference_group(self, problem: Problem, timeout: float) -> RankGroup:
        """The reference group with ``problem`` loaded."""
        group = self._live_reference()
        if self._reference_problem != problem.module:
            replies = group.request([load_job(problem.module)] * self.world_size, timeout, Ack)
            raise_reference_errors(replies, problem, "load")
            self._reference_problem = problem.module
        return group

    @functools.cached_property
    def profiles(self) -> tuple:
        """(datasheet profile, calibrated profile or None) for this machine and mode."""
        from pkb.hardware.detect import choose_profile, detect

        machine = detect()
        if self.mode is Mode.CPU:
            from pkb.hardware.profiles import get_profile

            return get_profile("cpu"), None
        datasheet = choose_profile(machine, calibrated=False)
        calibrated = choose_profile(machine, calibrated=True)
        return datasheet, (calibrated if calibrated is not datasheet and calibrated.calibrated else None)

    def candidate_group(self) -> RankGroup:
        group = self._spare if self._spare is not None and not self._spare.closed else None
        group = group or self._new_candidate_group()
        self._spare = self._new_candidate_group()
        self._current = group
        return group

    def _new_candidate_group(self) -> RankGroup:
        return RankGroup(self.mode, self.world_size, "candidate", self.sandbox, self._broker,
                         cpu_threads=self.cpu_threads, nodes=self.nodes).spawn()

    def close(self) -> None:
        """End every group now (their processes hold nothing to wind down: a verdict's data is all in the parent)."""
        for group in (self._reference, self._spare, self._current):
            if group is not None:
                group.kill()
        self._reference = self._spare = self._current = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def new_broker(sandbox: str, max_parallel: int = BuildBroker.MAX_PARALLEL) -> BuildBroker:
    """A build broker whose builds run in the sandbox of ``sandbox`` (a level other than ``off``)."""
    return BuildBroker(sandbox, max_parallel=max_parallel)
