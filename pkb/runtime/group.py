"""A group of W rank processes that run many jobs without relaunching.

The parent hosts the group's TCPStore on a port the OS picks (never a fixed one), so no rendezvous
port can already be in use. Each rank talks to the parent over a private pipe; its stdout and
stderr go to a log file whose tail is kept for error messages. A job that outlives its deadline, or
a rank that dies, ends the group: the caller gets ``RankTimeout`` (with the Python stack each hung rank
wrote when asked, pkb.runtime.worker) or ``RankCrashed`` and starts a new group for the next job.

A group runs at a sandbox level (pkb.runtime.sandbox): ``off``, or ``auto``/``required``, where the group makes its
ranks' sandbox plan itself and starts them under a jail of their own (pkb.runtime.jail). Replies come back typed
(pkb.runtime.messages.decode): the record of the kind the job asks for, or the RankFailure a rank's reply is.
"""

from __future__ import annotations

import atexit
import os
import re
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

from pkb.runtime.channel import MAX_MESSAGE_BYTES, ChannelError, recv_reply, send_job
from pkb.runtime.messages import BuiltAnswer, RankFailure, Reply, decode, exit_job, stock_calls_of
from pkb.runtime.modes import Mode, worker_environment
from pkb.runtime.proctree import asleep, children_by_parent, helpers_cpu_seconds
from pkb.runtime.sandbox import for_nodes, new_plan, remove_tree
from pkb.runtime.zygote import Zygote
from pkb.topology import ENV as TOPOLOGY_ENV, Topology

MAX_STOCK_CALLS = 4096  # stock-call labels one group keeps (messages.StockCallNote)
TOO_MANY_STOCK_CALLS = "pkb.too_many_stock_calls"  # kept in their place past that: a flood, which no policy allows
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
    """A job that did not finish in time; ``stacks``: each rank that had not answered, and the Python stack it wrote
    when asked before the group was killed (its log's end where it wrote none)."""

    def __init__(self, message: str, rank: int | None = None, log_tail: str = "", stacks: dict[int, str] | None = None):
        super().__init__(message, rank, log_tail)
        self.stacks = stacks or {}


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


# Lines a rank's output holds that say nothing of the candidate (torch's and c10d's start-up warnings), left out of
# what a verdict shows of it.
NOISE = re.compile(r"\[c10d\] The hostname of the client socket cannot be retrieved|"
                   r"^\[W\d+ [\d:.]+ \d+ .*(socket|TCPStore|ProcessGroup)\w*\.(cpp|hpp):\d+\]")


def _log_tail(path: Path, limit: int = 8000) -> str:
    """The last ``limit`` bytes of a rank's log (read from its end: a candidate may have written GiBs), without
    the lines that are noise (``NOISE``)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - limit))
            data = handle.read(limit)
    except OSError:
        return ""
    lines = data.decode("utf-8", errors="replace").splitlines(keepends=True)
    return "".join(line for line in lines if not NOISE.search(line))


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


def _failed(reply) -> bool:
    """Whether a raw reply reports a failure (a RankFailure, or a message with an error or a status other than ok)."""
    if isinstance(reply, RankFailure):
        return True
    return not isinstance(reply, dict) or "error" in reply or reply.get("status", "ok") != "ok"


_STACK_START = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):", re.MULTILINE)


def _stack_in(log: str) -> str:
    """The Python stacks a rank dumped into its log when asked (faulthandler's: a block per thread, the most recent
    call first; it is asked once, at a timeout), or the log's end where it holds none."""
    found = _STACK_START.search(log)
    return log[found.start():] if found else log[-2000:]


def _exception_line(error: str) -> str:
    """The line of a traceback that names the exception (its last non-blank one), cut to 200 characters."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no error given"


# What a rank was doing, in the user's words (a timeout says which step did not finish)
JOB_WORDS = {"load": "loading the candidate", "run": "a call of solution()", "time_prepare": "the timing's warm-up",
             "time_copies": "the timing's first calls", "time_refresh": "a refresh of the timed inputs",
             "time_repeat": "a timed repeat", "time_check": "the check of a timed repeat",
             "time_finish": "the end of the timing", "time_outputs": "sending the timed outputs",
             "time_exact": "the exact answer to a timed call"}


class RankGroup:
    """W worker processes in one process group; ``role`` is 'reference' or 'candidate'.

    ``spawn()`` starts the processes and returns at once; ``wait_ready()`` waits for every rank's
    process group. ``request(jobs, timeout, kind)`` sends rank r ``jobs[r]`` and returns the W replies, each a
    ``kind`` (a pkb.runtime.messages reply type) or the RankFailure it is.

    With ``sandbox`` ``auto`` or ``required``, the ranks run in a sandbox of that level (the group makes its plan,
    pkb.runtime.sandbox.new_plan) under a jail of their own (pkb.runtime.jail), and their rendezvous store lives
    inside it; ``broker`` (pkb.runtime.builds.BuildBroker) answers their requests for CUDA extensions.
    """

    def __init__(self, mode: Mode, world_size: int, role: str, sandbox: str = "off", broker=None,
                 cpu_threads: int | None = None, nodes: int = 1):
        self.mode = mode
        self.world_size = world_size
        self.role = role
        self.topology = Topology(world_size, nodes)  # the ranks' nodes (virtual: pkb runs them on one machine)
        self.cpu_threads = cpu_threads  # each rank's share of the cores (pkb.runtime.modes.worker_environment)
        self.sandbox = sandbox
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
        self.awaiting = False  # a job was sent whose replies were not read: the group's next reply would be stale
        self.num_runs = 0  # "run" jobs sent (its first call may build and compile: pkb.evaluate.evaluator._run_case)
        self._num_builds = 0  # build requests its ranks made (max_build_requests at most)
        self.limits_hit: list[str] = []  # pkb's own limits that refused something its ranks asked for
        self.stock_calls: set[str] = set()  # labels its ranks noted mid-job (messages.StockCallNote), all kept
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
        if self.sandbox != "off":
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
        cache_roots = [str(self.broker.cache_root)] if self.broker is not None else []
        plan = new_plan(self.sandbox, self.scratch, len(ranks), cpu_mode=self.mode is Mode.CPU, cache_roots=cache_roots)
        plan = for_nodes(plan, self.topology.num_nodes)  # a domain of its own per node
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
    def builder(cls, sandbox: str, request: dict) -> "RankGroup":
        """One build process for ``request`` in a sandbox of level ``sandbox`` (pkb.runtime.builds.builder_main); it
        sends one reply. Its plan is a GPU rank's (cpu_mode False): a build needs the toolchain, not the device."""
        group = cls(Mode.CUDA, 1, "builder", sandbox)
        group._spawn_jail([dict(target="builder", request=request, env_updates={})])
        return group

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> "RankGroup":
        if not self.ready:
            try:
                replies = self._collect(timeout, what="start-up")
            except GroupFailure as exc:  # no candidate code has run yet: whatever happened is pkb's
                hint = ("; in a sandbox this usually means a file the ranks need is outside what it lets them "
                        "read: PKB_SANDBOX_SKIP=landlock-fs tells whether that is the cause (docs/threat-model.md)"
                        if self.sandbox != "off" else "")
                raise StartFailure(f"the {self.role} ranks did not start: {exc}{hint}", exc.rank, exc.log_tail) from None
            failed = [r for r, reply in enumerate(replies) if not (isinstance(reply, dict) and reply.get("ready") is True)]
            if failed:
                self.kill()
                errors = {rank: str(replies[rank].get("error", "") if isinstance(replies[rank], dict) else replies[rank])
                          for rank in failed}
                said = "; ".join(f"rank {rank}: {_exception_line(error)}" for rank, error in errors.items())
                raise StartFailure(f"{len(failed)} of {self.world_size} ranks failed to start ({said})\n"
                                   + "\n".join(f"rank {rank}: {error}" for rank, error in errors.items()),
                                   failed[0], self.log_tail(failed[0]))
            status = replies[0].get("sandbox")  # the sandbox's own report, from its keeper, before any candidate ran
            self.sandbox_status = status if isinstance(status, dict) else None
            self.ready = True
        return self

    def request(self, jobs: list[dict], timeout: float, kind: type, max_reply_bytes: int = MAX_MESSAGE_BYTES
                ) -> list[Reply | RankFailure]:
        """Send one job per rank and wait for all replies (or the first failure plus a grace period), each a ``kind``
        or the RankFailure it is."""
        self.submit(jobs)
        return self.collect(timeout, kind, max_reply_bytes=max_reply_bytes)

    def submit(self, jobs: list[dict]) -> None:
        """Send rank r ``jobs[r]`` without waiting; ``collect`` gathers the replies."""
        if self.closed:
            raise GroupFailure(f"the {self.role} group is closed")
        if self.awaiting:  # its ranks would answer this job with the replies to the last one
            self.kill()
            raise GroupFailure(f"the {self.role} group was sent {jobs[0].get('op')!r} before its replies to "
                               f"{self._pending_op!r} were read; its ranks were killed")
        self.wait_ready()
        self._pending_op = jobs[0].get("op")
        self.awaiting = True
        self.num_runs += self._pending_op == "run"
        for member, job in zip(self.ranks, jobs):
            try:
                with member.send_lock:  # a build thread may answer the same rank (_answer)
                    send_job(member.conn, job)
            except OSError:
                self.kill()
                raise RankCrashed(f"rank {member.rank} is gone", member.rank, self.log_tail(member.rank)) from None

    def collect(self, timeout: float, kind: type, compile_limit: float | None = None,
                max_reply_bytes: int = MAX_MESSAGE_BYTES) -> list[Reply | RankFailure]:
        """The W replies to the jobs ``submit`` sent, each a ``kind`` or the RankFailure it is (pkb.runtime.messages:
        a rank that reported an error, sent a malformed reply, or was cut short while it waited for one that failed).
        ``compile_limit``: past ``timeout``, the wait goes on for as long as processes the ranks started keep using the
        CPU (compilers, build tools: a first call that builds and compiles lazily), up to ``compile_limit`` seconds in
        all; a hang starts no such process. ``max_reply_bytes``: a larger reply is the sender's failure (a rank that
        tried to exhaust the parent's memory), RankCrashed."""
        try:
            raw = self._collect(timeout, what=JOB_WORDS.get(self._pending_op, f"job {self._pending_op!r}"),
                                compile_limit=compile_limit,
                                max_reply_bytes=max_reply_bytes)
        except BaseException:  # replies left unread (an interrupt mid-wait): the group cannot be used again
            self.kill()
            raise
        self.awaiting = False
        return [reply if isinstance(reply, RankFailure) else decode(reply, kind) for reply in raw]

    COMPILE_CHECK_S = 1.0  # how often the helpers' CPU time is read once ``timeout`` has passed
    COMPILING_SHARE = 0.1  # the share of a core they must have used since: compiling, not idling

    def _collect(self, timeout: float, what: str, compile_limit: float | None = None,
                 max_reply_bytes: int = MAX_MESSAGE_BYTES) -> list:
        """The W raw replies (a RankFailure for a rank cut short); the ranks' time counts against ``timeout`` except
        while they wait for pkb's build broker (its queue and its builds are pkb's, with a limit of their own:
        pkb.runtime.builds) and, up to ``compile_limit``, while what they started compiles (``collect``)."""
        began = time.monotonic()
        deadline = began + timeout
        grace_deadline = None  # once a rank has failed: how long the others get (never extended)
        replies: dict[int, object] = {}
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
                    reply = recv_reply(conn, max_bytes=max_reply_bytes)
                except (EOFError, OSError):
                    self._crashed(member, what)
                except ChannelError as exc:
                    self.kill()
                    raise RankCrashed(f"rank {member.rank} sent a reply pkb does not accept: {exc}", member.rank) from None
                noted = stock_calls_of(reply)
                if noted is not None:  # the rank goes on with its job: not its reply
                    fresh = set(noted) - self.stock_calls
                    if len(self.stock_calls) + len(fresh) > MAX_STOCK_CALLS:  # a flood: said so, never allowed
                        fresh = {*sorted(fresh)[:max(0, MAX_STOCK_CALLS - len(self.stock_calls))], TOO_MANY_STOCK_CALLS}
                    self.stock_calls.update(fresh)
                    continue
                if isinstance(reply, dict) and len(reply) == 1 and "build" in reply and self.broker is not None:
                    self._build_requested(member, reply["build"])  # the rank waits for the answer
                    continue
                pending.discard(conn)
                replies[member.rank] = reply
                if _failed(reply) and pending and grace_deadline is None:
                    grace_deadline = time.monotonic() + ERROR_GRACE_S
        if pending:
            missing = sorted(by_conn[c].rank for c in pending)
            if any(_failed(reply) for reply in replies.values()):  # the others wait for the rank that failed
                self.kill()
                for rank in missing:
                    replies[rank] = RankFailure("stuck", "did not finish: another rank failed first")
                return [replies[r] for r in range(self.world_size)]
            stacks = self.stacks(missing)
            self.kill()
            raise RankTimeout(f"{what} did not finish within {timeout:.0f} s on rank(s) {missing}"
                              + (" (nor in the time it was given while what it started compiled)" if compiled else "")
                              + f"; the {self.role} ranks were killed", missing[0], self.log_tail(missing[0]), stacks)
        return [replies[r] for r in range(self.world_size)]

    STACKS_WAIT_S = 0.3  # after asking ranks for their stacks (without a jail): time for them to write them

    def stacks(self, ranks: list[int]) -> dict[int, str]:
        """Each of ``ranks``' Python stacks, as it writes them when asked (SIGUSR1: pkb.runtime.worker), read from the
        end of its log; what a rank wrote last where it wrote none."""
        if self.jail is not None:
            with self._jail_lock:
                try:
                    self.jail[1].send(b"stacks")
                    _wait_for(self.jail[1], b"flushed", self.FLUSH_TIMEOUT_S + 1)
                except OSError:
                    pass
        else:
            for member in self.ranks:
                if member.rank in ranks and member.pid is not None:
                    try:
                        os.kill(member.pid, signal.SIGUSR1)
                    except (ProcessLookupError, PermissionError):
                        pass
            time.sleep(self.STACKS_WAIT_S)
        return {rank: _stack_in(_log_tail(self.ranks[rank].log_path, 32000)) for rank in ranks if rank < len(self.ranks)}

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
