"""A group of W rank processes that run many jobs without relaunching.

The parent hosts the group's TCPStore on a port the OS picks (never a fixed one), so no rendezvous
port can already be in use. Each rank talks to the parent over a private pipe; its stdout and
stderr go to a log file whose tail is kept for error messages. A job that outlives its deadline, or
a rank that dies, ends the group: the caller gets ``RankTimeout`` or ``RankCrashed`` and starts a
new group for the next job.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
import time
import socket
import threading
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch.distributed as dist

from pkb.runtime.channel import ChannelError, recv_reply, send_job
from pkb.runtime.messages import BuiltAnswer, exit_job
from pkb.runtime.modes import Mode, worker_environment
from pkb.runtime.proctree import asleep, children_by_parent, helpers_cpu_seconds
from pkb.runtime.sandbox import for_nodes, remove_tree
from pkb.runtime.zygote import Zygote
from pkb.topology import ENV as TOPOLOGY_ENV, Topology

# After one rank reports an error, how long at most the others get to report theirs before the group is
# torn down (they are usually stuck in a collective that the failed rank will never join). The wait ends
# sooner once every process of the group has been seen asleep twice, GRACE_CHECK_S apart, with no reply
# between: then none is computing towards an error of its own.
ERROR_GRACE_S = 1.0
GRACE_CHECK_S = 0.05
LIMIT_WORDS = "pkb's limit:"  # begins every refusal that is a bound of pkb's (its build broker's), not a verdict
STARTUP_TIMEOUT_S = 120.0


class GroupFailure(RuntimeError):
    """The group can take no more jobs; ``rank`` names the first rank that failed."""

    def __init__(self, message: str, rank: int | None = None, log_tail: str = ""):
        super().__init__(message)
        self.rank = rank
        self.log_tail = log_tail


class RankTimeout(GroupFailure):
    pass


class StartFailure(GroupFailure):
    """The group's processes did not start (before any candidate code ran): pkb's failure, not a verdict."""


class RankCrashed(GroupFailure):
    pass


@dataclass
class _Rank:
    rank: int
    pid: int | None  # None in a sandbox: its jail ends it
    conn: Connection
    log_path: Path
    send_lock: threading.Lock = field(default_factory=threading.Lock)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _log_tail(path: Path, limit: int = 4000) -> str:
    """The last ``limit`` bytes of a rank's log (read from its end: a candidate may have written GiBs)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - limit))
            data = handle.read(limit)
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")


_teardowns: list[threading.Thread] = []


def _wait_for(control: socket.socket, word: bytes, timeout: float) -> None:
    """Read the jail's control socket until ``word`` (other answers passed over), its end closing, or ``timeout``."""
    try:
        control.settimeout(timeout)
        while control.recv(16) not in (word, b""):
            pass
    except OSError:
        pass


def _finish_jail(pid: int, control: socket.socket, scratch: str | None) -> None:
    """Wait for the jail's word that no process of its group is left (or kill it after a timeout), then
    remove the group's scratch directory."""
    try:
        _wait_for(control, b"done", RankGroup.JAIL_END_TIMEOUT_S)  # a late "flushed" is not the end
    finally:
        control.close()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if scratch:
        remove_tree(scratch)


@atexit.register
def finish_teardowns() -> None:
    """Wait until every ended group's processes are gone and its scratch directory removed."""
    while _teardowns:
        _teardowns.pop().join()


def _exception_line(error: str) -> str:
    """The line of a traceback that names the exception (its last non-blank one), cut to 200 characters."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no error given"


class RankGroup:
    """W worker processes in one process group; ``role`` is 'reference' or 'candidate'.

    ``spawn()`` starts the processes and returns at once; ``wait_ready()`` waits for every rank's
    process group. ``request(jobs, timeout)`` sends rank r ``jobs[r]`` and returns the W replies.

    With ``plan_for`` (a scratch directory -> ``pkb.runtime.sandbox.SandboxPlan``), the ranks run in a
    sandbox under a jail of their own (pkb.runtime.jail) and their rendezvous store lives inside it;
    ``broker`` (pkb.runtime.builds.BuildBroker) answers their requests for CUDA extensions.
    """

    def __init__(self, mode: Mode, world_size: int, role: str, plan_for=None, broker=None,
                 cpu_threads: int | None = None, nodes: int = 1):
        self.mode = mode
        self.world_size = world_size
        self.role = role
        self.topology = Topology(world_size, nodes)  # the ranks' nodes (virtual: pkb runs them on one machine)
        self.cpu_threads = cpu_threads  # each rank's share of the cores (pkb.runtime.modes.worker_environment)
        self.plan_for = plan_for
        self.broker = broker
        self.ranks: list[_Rank] = []
        self.store: dist.TCPStore | None = None
        self.jail: tuple[int, socket.socket] | None = None  # the jail's pid and control socket
        self._rank_depth = 2  # in a sandbox: how far below the jail the ranks are
        self.scratch: str | None = None
        self.sandbox_status: dict | None = None  # what the ranks' sandbox enforces (from their start-up)
        self.ready = False
        self.closed = False
        self._pending_op = None
        self.num_runs = 0  # "run" jobs sent (its first call may build and compile: pkb.evaluate.evaluator._run_case)
        self._num_builds = 0  # build requests its ranks made (max_build_requests at most)
        self.limits_hit: list[str] = []  # pkb's own limits that refused something its ranks asked for
        self._log_dir = Path(tempfile.mkdtemp(prefix=f"pkb-{role}-"))  # removed when the group ends
        # ... or, for a group nobody ended (its owner dropped it, or left without closing it), when it is
        # collected or at exit
        self._remove_logs = weakref.finalize(self, shutil.rmtree, str(self._log_dir), True)
        self._tails: dict[int, str] = {}  # each rank's last output, kept when the logs are removed
        self._jail_lock = threading.Lock()  # one exchange at a time on the jail's control socket

    @property
    def started(self) -> bool:
        """Whether ``spawn`` has run (a group starts once; ``__enter__`` starts it unless it has)."""
        return bool(self.ranks) or self.jail is not None

    def spawn(self) -> "RankGroup":
        if self.started or self.closed:
            raise RuntimeError(f"this {self.role} group has been started already: start a new RankGroup")
        env_updates = {**worker_environment(self.mode, base={}, cpu_threads=self.cpu_threads),
                       TOPOLOGY_ENV: self.topology.to_env()}
        if self.plan_for is not None:
            if self.broker is not None:
                env_updates["PKB_BUILD_CACHE"] = str(self.broker.cache_root)
            self._spawn_jail([dict(rank=rank, world_size=self.world_size, mode=self.mode.value, role=self.role,
                                   env_updates=env_updates) for rank in range(self.world_size)])
            return self
        self.store = dist.TCPStore("127.0.0.1", 0, self.world_size + 1, is_master=True, wait_for_workers=False)
        zygote = Zygote.get()
        for rank in range(self.world_size):
            log_path = self._log_dir / f"rank{rank}.log"
            pid, conn = zygote.fork(rank=rank, world_size=self.world_size, mode=self.mode.value,
                                    store_port=self.store.port, role=self.role, log_path=str(log_path),
                                    env_updates=env_updates)
            self.ranks.append(_Rank(rank, pid, conn, log_path))
        return self

    def _spawn_jail(self, ranks: list[dict]) -> None:
        """Start ``ranks`` (worker_main or builder_main keyword arguments) in a sandbox of their own."""
        self.scratch = tempfile.mkdtemp(prefix="pkb-scratch-")
        plan = for_nodes(self.plan_for(self.scratch), self.topology.num_nodes)  # a domain of its own per node
        self._rank_depth = 4 if plan.num_nodes > 1 else 2  # jail -> keeper (-> a node's two processes) -> ranks
        if plan.root:
            os.chown(self.scratch, plan.uid, plan.uid)
        log_paths = [str(self._log_dir / f"rank{rank}.log") for rank in range(len(ranks))]
        for rank, kwargs in enumerate(ranks):
            kwargs["log_path"] = log_paths[rank]
        pid, control, conns = Zygote.get().fork_jail(plan=plan, ranks=ranks, log_paths=log_paths)
        self.jail = (pid, control)
        self.ranks = [_Rank(rank, None, conn, Path(path)) for rank, (conn, path) in enumerate(zip(conns, log_paths))]

    @classmethod
    def builder(cls, plan_for, request: dict) -> "RankGroup":
        """One sandboxed build process for ``request`` (pkb.runtime.builds.builder_main); it sends one reply."""
        group = cls(Mode.CPU, 1, "builder", plan_for)
        group._spawn_jail([dict(target="builder", request=request, env_updates={})])
        return group

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> "RankGroup":
        if not self.ready:
            try:
                replies = self._collect(timeout, what="start-up")
            except GroupFailure as exc:  # no candidate code has run yet: whatever happened is pkb's
                hint = ("; in a sandbox this usually means a file the ranks need is outside what it lets them "
                        "read: PKB_SANDBOX_SKIP=landlock-fs tells whether that is the cause (docs/threat-model.md)"
                        if self.plan_for is not None else "")
                raise StartFailure(f"the {self.role} ranks did not start: {exc}{hint}", exc.rank, exc.log_tail) from None
            failed = [r for r, reply in enumerate(replies) if not reply.get("ready")]
            if failed:
                self.kill()
                errors = {rank: replies[rank].get("error", "") for rank in failed}
                said = "; ".join(f"rank {rank}: {_exception_line(error)}" for rank, error in errors.items())
                raise StartFailure(f"{len(failed)} of {self.world_size} ranks failed to start ({said})\n"
                                   + "\n".join(f"rank {rank}: {error}" for rank, error in errors.items()),
                                   failed[0], self.log_tail(failed[0]))
            self.sandbox_status = replies[0].get("sandbox")
            self.ready = True
        return self

    def request(self, jobs: list[dict], timeout: float) -> list[dict]:
        """Send one job per rank and wait for all replies (or the first error plus a grace period)."""
        self.submit(jobs)
        return self.collect(timeout)

    def submit(self, jobs: list[dict]) -> None:
        """Send rank r ``jobs[r]`` without waiting; ``collect`` gathers the replies."""
        if self.closed:
            raise GroupFailure(f"the {self.role} group is closed")
        self.wait_ready()
        self._pending_op = jobs[0].get("op")
        self.num_runs += self._pending_op == "run"
        for member, job in zip(self.ranks, jobs):
            try:
                with member.send_lock:  # a build thread may answer the same rank (_answer)
                    send_job(member.conn, job)
            except OSError:
                self.kill()
                raise RankCrashed(f"rank {member.rank} is gone", member.rank, self.log_tail(member.rank)) from None

    def collect(self, timeout: float, compile_limit: float | None = None) -> list[dict]:
        """The W replies to the jobs ``submit`` sent. ``compile_limit``: past ``timeout``, the wait goes on for
        as long as processes the ranks started keep using the CPU (compilers, build tools: a first call that
        builds and compiles lazily), up to ``compile_limit`` seconds in all; a hang starts no such process."""
        return self._collect(timeout, what=f"job {self._pending_op!r}", compile_limit=compile_limit)

    COMPILE_CHECK_S = 1.0  # how often the helpers' CPU time is read once ``timeout`` has passed
    COMPILING_SHARE = 0.1  # the share of a core they must have used since: compiling, not idling

    def _collect(self, timeout: float, what: str, compile_limit: float | None = None) -> list[dict]:
        """The W replies; the ranks' time counts against ``timeout`` except while they wait for pkb's build
        broker (its queue and its builds are pkb's, with a limit of their own: pkb.runtime.builds) and,
        up to ``compile_limit``, while what they started compiles (``collect``)."""
        began = time.monotonic()
        deadline = began + timeout
        grace_deadline = None  # once a rank has failed: how long the others get (never extended)
        replies: dict[int, dict] = {}
        by_conn = {member.conn: member for member in self.ranks}
        pending = set(by_conn)
        checked, helpers_cpu, compiled, quiet = began, None, False, 0
        while pending:
            now = time.monotonic()
            if self._num_builds and self.broker is not None and self.broker.waiting_for(self):
                deadline += now - checked
            checked = now
            if now >= deadline and compile_limit and now - began < compile_limit:
                used = self._helpers_cpu_seconds()
                busy = helpers_cpu is not None and used - helpers_cpu[1] >= self.COMPILING_SHARE * (now - helpers_cpu[0])
                if helpers_cpu is None or busy:  # compiling (or not measured yet): a little longer
                    deadline, compiled = now + self.COMPILE_CHECK_S, compiled or busy
                helpers_cpu = (now, used)
            remaining = min(deadline, grace_deadline or deadline) - now
            if remaining <= 0:
                break
            step = 0.5 if self._num_builds or compile_limit else remaining
            if grace_deadline is not None:
                step = GRACE_CHECK_S
            ready = wait(list(pending), timeout=min(remaining, step))
            if grace_deadline is not None:
                quiet = 0 if ready or not asleep(self.root_pids(), children_by_parent()) else quiet + 1
                if quiet == 2:  # no rank is computing: those left are stuck waiting for the one that failed
                    break
            for conn in ready:
                member = by_conn[conn]
                try:
                    reply = recv_reply(conn)
                except (EOFError, OSError):
                    self._crashed(member, what)
                except ChannelError as exc:
                    self.kill()
                    raise RankCrashed(f"rank {member.rank}: {exc}", member.rank) from None
                if "build" in reply and self.broker is not None and len(reply) == 1:
                    self._build_requested(member, reply["build"])  # the rank waits for the answer
                    continue
                pending.discard(conn)
                replies[member.rank] = reply
                if replies.get(member.rank, {}).get("error") and pending and grace_deadline is None:
                    grace_deadline = time.monotonic() + ERROR_GRACE_S
        if pending:
            errors = {r: reply for r, reply in replies.items() if reply.get("error")}
            missing = sorted(by_conn[c].rank for c in pending)
            self.kill()
            if errors:  # the others are stuck waiting for the rank that failed: report the failure
                for rank in missing:
                    replies[rank] = {"error": "did not finish: another rank failed first", "stuck": True}
                return [replies[r] for r in range(self.world_size)]
            raise RankTimeout(f"{what} did not finish within {timeout:.0f} s on rank(s) {missing}"
                              + (" (nor in the time it was given while what it started compiled)" if compiled else "")
                              + f"; the {self.role} ranks were killed", missing[0], self.log_tail(missing[0]))
        return [replies[r] for r in range(self.world_size)]

    def _helpers_cpu_seconds(self) -> float:
        """CPU seconds used so far by the processes the ranks started (pkb.runtime.proctree)."""
        tree = children_by_parent()
        if self.jail is not None:  # jail -> keeper (-> each node's two first processes) -> ranks
            ranks = [self.jail[0]]
            for _ in range(self._rank_depth):
                ranks = [child for pid in ranks for child in tree.get(pid, [])]
        else:
            ranks = [member.pid for member in self.ranks if member.pid is not None]
        return helpers_cpu_seconds(ranks, tree)

    @property
    def max_build_requests(self) -> int:
        """Build requests one group may make: each rank asking once for each source it may build."""
        return self.broker.MAX_SOURCES * self.world_size

    def _build_requested(self, member: _Rank, request) -> None:
        self._num_builds += 1
        if self._num_builds > self.max_build_requests:
            self._answer(member, {"error": f"{LIMIT_WORDS} more than {self.max_build_requests} build requests in one "
                                           "evaluation", "limit": "build requests per evaluation"})
            return
        self.broker.request(request, lambda answer: self._answer(member, answer), owner=self)

    def _answer(self, member: _Rank, answer: dict) -> None:
        if answer.get("limit") or str(answer.get("error", "")).startswith(LIMIT_WORDS):
            self.limits_hit.append(answer["error"])
            answer = {"error": answer["error"]}
        try:
            with member.send_lock:
                send_job(member.conn, BuiltAnswer(op="built", **answer))
        except (OSError, ValueError):  # the group was killed while the build ran
            pass

    def _crashed(self, member: _Rank, what: str) -> None:
        self.kill()
        raise RankCrashed(f"rank {member.rank} died during {what}", member.rank, self.log_tail(member.rank))

    def root_pids(self) -> list[int]:
        """The processes every process of the group descends from: its jail (the ranks and whatever they
        start live below it), or each rank (a rank leads its own session)."""
        if self.closed:
            return []
        if self.jail is not None:
            return [self.jail[0]]
        return [member.pid for member in self.ranks if member.pid is not None]

    def log_tail(self, rank: int) -> str:
        """The end of rank ``rank``'s output (kept from when the group ended, once its logs are gone)."""
        if rank in self._tails:
            return self._tails[rank]
        self._flush_logs()
        return _log_tail(self.ranks[rank].log_path) if rank < len(self.ranks) else ""

    FLUSH_TIMEOUT_S = 2.0

    def _flush_logs(self) -> None:
        """In a sandbox the ranks' output reaches their logs through the jail (pkb.runtime.jail.RankLog): have it
        relay what they have written so far, so that a log's end read next is their latest output."""
        with self._jail_lock:
            if self.jail is None:
                return
            control = self.jail[1]
            try:
                control.send(b"flush")
            except OSError:  # the jail is gone: the logs hold what they hold
                return
            _wait_for(control, b"flushed", self.FLUSH_TIMEOUT_S)  # or, if the jail is slow, what they hold by then
            try:
                control.settimeout(None)
            except OSError:
                pass

    def close(self, timeout: float = 10.0) -> None:
        """Ask every rank to exit; kill whatever has not within ``timeout`` (a sandboxed group: at once)."""
        if self.closed:
            return
        if self.jail is not None:
            self.kill()
            return
        for member in self.ranks:
            try:
                send_job(member.conn, exit_job())
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for member in self.ranks:
            while _alive(member.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
        self.kill()

    def kill(self) -> None:
        """Kill every rank process (and anything it started) now, and the builds only it waited for; keep
        the end of each rank's output and remove the logs (nothing of the group outlives it)."""
        if self.closed:
            return
        if self.jail is not None:
            self._flush_logs()
            self._end_jail()
        if self.broker is not None:
            self.broker.release(self)
        for member in self.ranks:
            for kill in (os.killpg, os.kill) if member.pid is not None else ():
                try:  # the rank leads its own session: killpg ends what it started
                    kill(member.pid, 9)
                except (ProcessLookupError, PermissionError):
                    pass
            member.conn.close()
        self._tails = {member.rank: _log_tail(member.log_path) for member in self.ranks}
        self._remove_logs()
        self.closed = True
        self.store = None

    JAIL_END_TIMEOUT_S = 10.0

    def _end_jail(self) -> None:
        """Have the jail end every process of the group now. The jail kills them at once; the kernel's
        teardown of the namespaces (milliseconds) and the removal of the scratch directory finish on a
        thread, so the next evaluation does not wait for them (``finish_teardowns`` waits)."""
        with self._jail_lock:
            pid, control = self.jail
            self.jail = None
            try:
                control.send(b"kill")
            except OSError:
                pass
        thread = threading.Thread(target=_finish_jail, args=(pid, control, self.scratch), daemon=True,
                                  name="pkb-jail-teardown")
        thread.start()
        _teardowns[:] = [t for t in _teardowns if t.is_alive()] + [thread]

    def __enter__(self) -> "RankGroup":
        return self if self.started else self.spawn()

    def __exit__(self, *exc) -> None:
        self.close()
