"""A group of W rank processes that run many jobs without relaunching.

The parent hosts the group's TCPStore on a port the OS picks (never a fixed one), so no rendezvous
port can already be in use. Each rank talks to the parent over a private pipe; its stdout and
stderr go to a log file whose tail is kept for error messages. A job that outlives its deadline, or
a rank that dies, ends the group: the caller gets ``RankTimeout`` or ``RankCrashed`` and starts a
new group for the next job.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch.distributed as dist

from pkb.runtime.channel import ChannelError, decode_reply, send_job
from pkb.runtime.modes import Mode, worker_environment
from pkb.runtime.zygote import Zygote

# After one rank reports an error, how long the others get to report theirs before the group is
# torn down (they are usually stuck in a collective that the failed rank will never join).
ERROR_GRACE_S = 1.0
STARTUP_TIMEOUT_S = 120.0


class GroupFailure(RuntimeError):
    """The group can take no more jobs; ``rank`` names the first rank that failed."""

    def __init__(self, message: str, rank: int | None = None, log_tail: str = ""):
        super().__init__(message)
        self.rank = rank
        self.log_tail = log_tail


class RankTimeout(GroupFailure):
    pass


class RankCrashed(GroupFailure):
    pass


@dataclass
class _Rank:
    rank: int
    pid: int
    conn: Connection
    log_path: Path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _log_tail(path: Path, limit: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", errors="replace")


class RankGroup:
    """W worker processes in one process group; ``role`` is 'reference' or 'candidate'.

    ``spawn()`` starts the processes and returns at once; ``wait_ready()`` waits for every rank's
    process group. ``request(jobs, timeout)`` sends rank r ``jobs[r]`` and returns the W replies.
    """

    def __init__(self, mode: Mode, world_size: int, role: str):
        self.mode = mode
        self.world_size = world_size
        self.role = role
        self.ranks: list[_Rank] = []
        self.store: dist.TCPStore | None = None
        self.ready = False
        self.closed = False
        self._pending_op = None
        self._log_dir = Path(tempfile.mkdtemp(prefix=f"pkb-{role}-"))

    def spawn(self) -> "RankGroup":
        self.store = dist.TCPStore("127.0.0.1", 0, self.world_size + 1, is_master=True, wait_for_workers=False)
        env_updates = worker_environment(self.mode, base={})
        zygote = Zygote.get()
        for rank in range(self.world_size):
            log_path = self._log_dir / f"rank{rank}.log"
            pid, conn = zygote.fork(rank=rank, world_size=self.world_size, mode=self.mode.value,
                                    store_port=self.store.port, role=self.role, log_path=str(log_path),
                                    env_updates=env_updates)
            self.ranks.append(_Rank(rank, pid, conn, log_path))
        return self

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> "RankGroup":
        if not self.ready:
            replies = self._collect(timeout, what="start-up")
            failed = [r for r, reply in enumerate(replies) if not reply.get("ready")]
            if failed:
                self.kill()
                raise RankCrashed(f"rank {failed[0]} failed to start: {replies[failed[0]].get('error', '')}",
                                  failed[0], _log_tail(self.ranks[failed[0]].log_path))
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
        for member, job in zip(self.ranks, jobs):
            try:
                send_job(member.conn, job)
            except OSError:
                self.kill()
                raise RankCrashed(f"rank {member.rank} is gone", member.rank, _log_tail(member.log_path)) from None

    def collect(self, timeout: float) -> list[dict]:
        return self._collect(timeout, what=f"job {self._pending_op!r}")

    def _collect(self, timeout: float, what: str) -> list[dict]:
        deadline = time.monotonic() + timeout
        replies: dict[int, dict] = {}
        by_conn = {member.conn: member for member in self.ranks}
        pending = set(by_conn)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in wait(list(pending), timeout=remaining):
                member = by_conn[conn]
                pending.discard(conn)
                try:
                    replies[member.rank] = decode_reply(conn.recv_bytes())
                except (EOFError, OSError):
                    self._crashed(member, what)
                except ChannelError as exc:
                    self.kill()
                    raise RankCrashed(f"rank {member.rank}: {exc}", member.rank) from None
                if replies.get(member.rank, {}).get("error") and pending:
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        if pending:
            errors = {r: reply for r, reply in replies.items() if reply.get("error")}
            missing = sorted(by_conn[c].rank for c in pending)
            self.kill()
            if errors:  # the others are stuck waiting for the rank that failed: report the failure
                for rank in missing:
                    replies[rank] = {"error": "did not finish: another rank failed first", "stuck": True}
                return [replies[r] for r in range(self.world_size)]
            raise RankTimeout(f"{what} did not finish within {timeout:.0f} s on rank(s) {missing}; "
                              f"the {self.role} ranks were killed", missing[0], _log_tail(self.ranks[missing[0]].log_path))
        return [replies[r] for r in range(self.world_size)]

    def _crashed(self, member: _Rank, what: str) -> None:
        self.kill()
        raise RankCrashed(f"rank {member.rank} died during {what}", member.rank,
                          _log_tail(member.log_path))

    def log_tail(self, rank: int) -> str:
        return _log_tail(self.ranks[rank].log_path) if rank < len(self.ranks) else ""

    def close(self, timeout: float = 10.0) -> None:
        """Ask every rank to exit; kill whatever has not within ``timeout``."""
        if self.closed:
            return
        for member in self.ranks:
            try:
                send_job(member.conn, {"op": "exit"})
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for member in self.ranks:
            while _alive(member.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
        self.kill()

    def kill(self) -> None:
        """Kill every rank process (and anything it started) now."""
        for member in self.ranks:
            for kill in (os.killpg, os.kill):  # the rank leads its own session: killpg ends what it started
                try:
                    kill(member.pid, 9)
                except (ProcessLookupError, PermissionError):
                    pass
            member.conn.close()
        self.closed = True
        self.store = None

    def __enter__(self) -> "RankGroup":
        return self.spawn()

    def __exit__(self, *exc) -> None:
        self.close()
