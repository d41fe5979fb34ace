"""The processes that hold one sandboxed candidate group: the jail and its keeper (pkb.runtime.sandbox: their plan;
pkb.runtime.confine: the system calls that carry it out).

The zygote forks the *jail* for each group. The jail takes new namespaces where the kernel allows,
forks the *keeper*, and then relays the ranks' output into their logs until the parent's word to end the
group: it kills the keeper (pid 1 of the group's pid namespace, so the kernel ends every process in it) or,
without a pid namespace, kills every process that reaches it as child subreaper until none is left,
answers ``done`` and exits. The jail runs no candidate code and is outside the candidates' Landlock
domain: they cannot signal it.

A rank's stdout and stderr are a pipe to the jail, not a file on the grader's disk: the jail writes them
into the rank's log, which keeps the latest ``LOG_BYTES`` at most (``RankLog``), so a candidate that prints
without end fills neither the disk that other evaluations and the results share nor the parent's memory,
and its writes never fail for it. The parent asks for a ``flush`` before it reads a log's end.

The keeper makes the private mounts, enters the sandbox (irreversibly), then forks the W ranks (or one
build process) and hosts their rendezvous store; it never imports a candidate either, but it shares the
candidates' domain. On several virtual nodes it first forks, per node, a process that makes the node's own
domain (its pid and mount namespaces, uid, Landlock domain: pkb.runtime.sandbox.NODE_PROTECTIONS) and forks
the node's ranks; then the ranks of one node share a domain, and those of two nodes nothing but the network.
"""

from __future__ import annotations

import errno
import fcntl
import os
import selectors
import signal
import socket
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

from pkb.runtime import confine, sandbox
from pkb.runtime.channel import send_reply
from pkb.runtime.proctree import children_by_parent

LOG_BYTES = 1 << 20  # the most a rank's log on the grader's disk holds: its latest output
LOG_KEPT_BYTES = 64 << 10  # the end of the output a log keeps when it starts again
_READ_BYTES = 64 << 10
_FLUSH_READS = 64  # a flush relays at most this many reads per rank: one that prints without end cannot stall it


class RankLog:
    """One rank's output, relayed from the read end of its pipe (``fd``, non-blocking) into its log file.

    The file never holds more than ``LOG_BYTES``: a write that would pass it starts the file again with a
    line that says how many bytes were dropped, then the last ``LOG_KEPT_BYTES`` of the output. Its end is
    always the rank's latest output, which is all the parent reads of it."""

    def __init__(self, fd: int, path: str):
        self.fd = fd
        self.file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self.size = 0  # bytes in the file
        self.received = 0  # bytes read from the pipe
        self.dropped = 0
        self._recent = b""  # the last LOG_KEPT_BYTES received

    def relay(self, max_reads: int = 1) -> bool:
        """Move what the pipe holds (up to ``max_reads`` reads) into the file; False once the pipe is closed
        (every process that could write to it has ended)."""
        for _ in range(max_reads):
            try:
                data = os.read(self.fd, _READ_BYTES)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data:
                return False
            self._write(data)
        return True

    def _write(self, data: bytes) -> None:
        if self.size + len(data) > LOG_BYTES:
            self.dropped = self.received - len(self._recent)
            note = (f"[pkb: {self.dropped} earlier bytes of this rank's output dropped: its log keeps the last "
                    f"{LOG_BYTES} bytes at most]\n").encode()
            os.ftruncate(self.file, 0)
            os.lseek(self.file, 0, os.SEEK_SET)
            self.size = 0
            self._append(note + self._recent)
        self._append(data)
        self.received += len(data)
        self._recent = (self._recent + data)[-LOG_KEPT_BYTES:]

    def _append(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                written = os.write(self.file, view)
            except OSError as exc:  # the grader's disk is full: the output is lost, never the candidate's write
                if exc.errno == errno.EINTR:
                    continue
                return
            self.size += written
            view = view[written:]

    def close(self) -> None:
        for fd in (self.fd, self.file):
            try:
                os.close(fd)
            except OSError:
                pass


STACKS_WAIT_S = 0.3  # after asking the ranks for their stacks: time for them to write them before the relay


def relay_until_told(control: socket.socket, logs: list[RankLog], ask_for_stacks=lambda: None) -> None:
    """Relay the ranks' output into their logs until the parent's ``kill`` (or its end closing); answer each
    ``flush`` with ``flushed`` once what the ranks wrote before it is in the logs, and each ``stacks`` the same way
    once the ranks were asked to write their Python stacks (``ask_for_stacks``: SIGUSR1, pkb.runtime.worker)."""
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    for log in logs:
        selector.register(log.fd, selectors.EVENT_READ, log)
    while True:
        for key, _ in selector.select():
            if key.data is not None:
                if not key.data.relay():
                    selector.unregister(key.fd)
                continue
            try:
                word = control.recv(64)
            except InterruptedError:
                continue
            except OSError:
                word = b""
            if word not in (b"flush", b"stacks"):  # "kill", or the parent's end closing
                selector.close()
                return
            if word == b"stacks":
                ask_for_stacks()
                time.sleep(STACKS_WAIT_S)
            for log in logs:
                log.relay(_FLUSH_READS)
            try:
                control.send(b"flushed")
            except OSError:
                selector.close()
                return


def _output_pipe() -> tuple[int, int]:
    """A pipe for a rank's output: the jail's end does not block; the rank's holds up to 1 MiB where the kernel
    allows (a burst of output is not held up by the relay)."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    try:
        fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, 1 << 20)
    except (OSError, AttributeError):  # above /proc/sys/fs/pipe-max-size, or not Linux: the default 64 KiB
        pass
    return read, write


def jail_main(control: socket.socket, rank_ends: list[socket.socket], request: dict) -> None:
    """Entry point of the jail (forked by the zygote); never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    confine.die_with_parent()
    plan: sandbox.SandboxPlan = request["plan"]
    pipes = [_output_pipe() for _ in request["log_paths"]]  # (read, write): a rank's stdout and stderr, to its log
    logs = [RankLog(read, path) for (read, _), path in zip(pipes, request["log_paths"])]
    namespaces = confine.unshare_namespaces(plan)
    if "pid-namespace" not in namespaces:
        confine.become_subreaper()
    keeper = os.fork()
    if keeper == 0:
        control.close()
        for log in logs:
            log.close()
        try:
            keeper_main(rank_ends, plan, namespaces, request, [write for _, write in pipes])
        finally:
            os._exit(1)
    for end in rank_ends:
        end.close()
    for _, write in pipes:
        os.close(write)
    relay_until_told(control, logs, lambda: _signal(keeper, signal.SIGUSR1))  # passed down to the ranks
    _end_tree(keeper, "pid-namespace" in namespaces)
    for log in logs:
        log.close()
    try:
        control.send(b"done")
    except OSError:
        pass
    os._exit(0)


def _end_tree(keeper: int, pid_namespace: bool) -> None:
    """Kill the keeper and everything below it, double-forked ``setsid`` processes included."""
    try:
        os.kill(keeper, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if pid_namespace:  # the kernel kills the namespace with its pid 1; waitpid returns once it is empty
        try:
            os.waitpid(keeper, 0)
        except ChildProcessError:
            pass
        return
    while True:  # as subreaper, every orphaned descendant becomes our child: kill until none is left
        _reap()
        children = _children(os.getpid())
        if not children:
            return
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def pass_stack_requests_down() -> None:
    """A request for the ranks' stacks (SIGUSR1) that reaches this process (the keeper, a node's processes) goes on
    to its children: the ranks write their stacks (pkb.runtime.worker); the jail cannot name them itself, as they live
    in pid namespaces of their own."""
    def forward(signum, frame):
        for child in children_by_parent(include_zombies=False).get(os.getpid(), []):
            _signal(child, signum)

    signal.signal(signal.SIGUSR1, forward)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _children(parent: int) -> list[int]:
    return children_by_parent(include_zombies=False).get(parent, [])


def keeper_main(rank_ends: list[socket.socket], plan: sandbox.SandboxPlan, namespaces: list[str], request: dict,
                log_fds: list[int]) -> None:
    """Enter the sandbox, fork the group's processes (rank i's output to ``log_fds[i]``, a pipe to the jail),
    host their store, reap them; never returns. On several virtual nodes (``plan.num_nodes``) the ranks are
    forked by one process per node (``node_main``), each a domain of its own, forked before the keeper enters
    its own (a sandboxed process can no longer make namespaces or mounts)."""
    confine.die_with_parent()
    ranks: list[dict] = request["ranks"]
    try:
        confine.prepare_keeper(plan, namespaces)
        quiet = os.open(os.devnull, os.O_WRONLY)  # the store's warnings are not the user's business
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        os.close(quiet)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(256)
        if plan.num_nodes > 1:
            _start_nodes(rank_ends, plan, namespaces, ranks, log_fds, listener)
            rank_ends, log_fds = [], []  # the nodes hold them now
        status = confine.enter(plan, namespaces)
        confine.set_dumpable(True)  # the ranks may share memory handles with each other (pidfd_getfd)
    except Exception as exc:
        _refuse(rank_ends, exc)
        os._exit(1)
    pass_stack_requests_down()
    environment = confine.candidate_environment(plan, namespaces)
    os.chdir(plan.scratch)  # the working directory it inherited (perhaps the checkout) is not readable
    _fork_ranks(range(len(rank_ends)), rank_ends, ranks, log_fds, environment, listener, status)
    store = None
    if ranks[0].get("target", "worker") == "worker":
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], len(ranks), True,
                              timeout=timedelta(seconds=600), wait_for_workers=False, master_listen_fd=listener.fileno())
    _reap_all()
    del store
    os._exit(0)


def _refuse(rank_ends: list[socket.socket], exc: Exception) -> None:
    """Tell each rank behind ``rank_ends`` that the sandbox could not be set up (no candidate code has run)."""
    message = f"the sandbox could not be set up: {exc}\n{traceback.format_exc(limit=-4)}"
    for end in rank_ends:
        send_reply(Connection(end.detach()), {"ready": False, "error": message})


def _fork_ranks(indices, rank_ends: list[socket.socket], ranks: list[dict], log_fds: list[int],
                environment: dict[str, str], listener: socket.socket, status: sandbox.SandboxStatus) -> None:
    """Fork rank ``indices[i]`` on ``rank_ends[i]`` (its output to ``log_fds[i]``), with ``environment``; then
    close this process's copies of their ends."""
    port = listener.getsockname()[1]  # the group's store (in the keeper)
    for index, end, log_fd in zip(indices, rank_ends, log_fds):
        pid = os.fork()
        if pid == 0:
            confine.die_with_parent()
            for other in rank_ends:
                if other is not end:
                    other.close()
            listener.close()
            conn = Connection(end.detach())
            kwargs = {**ranks[index], "env_updates": {**ranks[index].get("env_updates", {}), **environment}}
            try:
                _run_target(conn, kwargs, port, log_fd, status.to_dict())
            finally:
                os._exit(1)
    _close(rank_ends, log_fds)


def _close(rank_ends: list[socket.socket], log_fds: list[int]) -> None:
    """Close this process's copies of ranks' ends and log pipes (a rank's end held elsewhere would hide its death)."""
    for end in rank_ends:
        end.close()
    for fd in log_fds:
        os.close(fd)


def _start_nodes(rank_ends: list[socket.socket], plan: sandbox.SandboxPlan, namespaces: list[str], ranks: list[dict],
                 log_fds: list[int], listener: socket.socket) -> None:
    """Fork each node's first process (``node_main``), in a pid namespace of its own where the group has one;
    close this process's copies of the ranks' ends.

    A new pid namespace takes effect for the children of the process that makes it, so each node has a process
    between the keeper and its first one, which waits for it: each dies with its parent (PR_SET_PDEATHSIG, set
    while the parent is sure to be alive), and nothing but the node's own processes holds its ranks' ends (the
    parent sees a rank that dies)."""
    per_node = len(ranks) // plan.num_nodes
    for node in range(plan.num_nodes):
        mine = range(node * per_node, (node + 1) * per_node)
        if os.fork() == 0:
            try:
                confine.die_with_parent()
                pass_stack_requests_down()
                own_pids = confine.node_pid_namespace(plan, namespaces)
                first = os.fork()
                if first == 0:
                    for index, end in enumerate(rank_ends):
                        if index not in mine:
                            end.close()
                            os.close(log_fds[index])
                    node_main(node, mine, [rank_ends[i] for i in mine], plan, namespaces, ranks,
                              [log_fds[i] for i in mine], listener, own_pids)
                _close(rank_ends, log_fds)
                listener.close()
                os.waitpid(first, 0)
            finally:
                os._exit(0)
    _close(rank_ends, log_fds)


def node_main(node: int, indices: range, rank_ends: list[socket.socket], plan: sandbox.SandboxPlan,
              namespaces: list[str], ranks: list[dict], log_fds: list[int], listener: socket.socket,
              own_pids: bool) -> None:
    """A virtual node's first process: set up the node's domain, enter it, fork its ranks and reap them; never
    returns. Pid 1 of the node's pid namespace where it has one (when it dies, so does every process of the node)."""
    confine.die_with_parent()
    try:
        mine = sandbox.node_plan(plan, node)
        done = confine.prepare_node(mine, node, namespaces, own_pids)
        status = confine.enter(mine, namespaces)
        status.nodes = sandbox.node_status(mine, status, done)
        confine.set_dumpable(True)  # the node's ranks may share memory handles with each other (pidfd_getfd)
    except Exception as exc:
        _refuse(rank_ends, exc)
        os._exit(1)
    os.chdir(mine.scratch)
    _fork_ranks(indices, rank_ends, ranks, log_fds, confine.candidate_environment(mine, namespaces, node=node),
                listener, status)
    listener.close()
    _reap_all()
    os._exit(0)


def _reap_all() -> None:
    """Reap the children (and, as pid 1 of a pid namespace or a subreaper, whatever is orphaned below) until none is left."""
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def _run_target(conn: Connection, kwargs: dict, port: int, log_fd: int, status: dict) -> None:
    target = kwargs.pop("target", "worker")
    if target == "builder":
        builder_main(conn, log_fd=log_fd, sandbox=status, **kwargs)
    else:
        from pkb.runtime.worker import worker_main

        worker_main(conn, store_port=port, log_fd=log_fd, sandbox=status, **kwargs)


def builder_main(conn: Connection, request: dict, log_path: str, env_updates: dict[str, str], log_fd: int,
                 sandbox: dict, **_) -> None:
    """A sandboxed build process: build ``request`` in this sandbox's scratch directory and send the
    library's bytes (never a path: the parent reads nothing this process wrote). Never returns."""
    os.setsid()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.environ.update(env_updates)
    import torch

    from pkb.kernels.build import BuildError, build_locally, extension_name

    try:
        directory = Path(os.environ["TORCH_EXTENSIONS_DIR"], extension_name(request))
        directory.mkdir(parents=True, exist_ok=True)
        module = build_locally(request, directory)
        data = Path(module.__file__).read_bytes()
        reply = {"library": torch.frombuffer(bytearray(data), dtype=torch.uint8)}
    except BuildError as exc:
        reply = {"error": str(exc)}
    except Exception:
        reply = {"error": traceback.format_exc(limit=-6)}
    send_reply(conn, reply)
    os._exit(0)
