"""The rank-process server: imports torch once, then forks a fresh rank process on each request.

Importing torch takes a second or more per process; forking an interpreter that has already done it
takes milliseconds. The zygote is trusted and never runs candidate code: each request forks a child
that closes the control socket and becomes a rank process (``pkb.runtime.worker.worker_main``), with
a private socket pair whose other end goes back to the parent.

Protocol (SOCK_SEQPACKET, one message per request): the parent sends a pickled dict of
``worker_main`` keyword arguments; the zygote answers with the child's pid and its socket's fd.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

from pkb.runtime.confine import die_with_parent, set_dumpable


def serve(control: socket.socket) -> None:
    # Started with ``python -c``, Python put the working directory ('') first on the import path: every
    # rank would import from wherever it runs (a sandboxed rank's scratch directory, the user's folder)
    # before the installed packages. Rank processes import by absolute paths only.
    sys.path[:] = [os.path.abspath(entry) for entry in sys.path if entry]
    die_with_parent()
    set_dumpable(False)  # its children (reference ranks, jails) too: no candidate of the same user reads them
    from pkb.runtime import worker  # imports torch: the one import every rank process shares

    try:  # the suite too, so no rank process imports a problem module again
        from pkb.registry import all_problems

        all_problems()
    except Exception:  # a broken problem module: the ranks will report it when they load it
        pass

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    try:
        _serve_requests(control, worker)
    except (BrokenPipeError, ConnectionResetError):  # the parent has gone mid-request: nothing to answer
        return


def _serve_requests(control: socket.socket, worker) -> None:
    while True:
        message = control.recv(1 << 20)
        if not message:
            return
        request = pickle.loads(message)
        if request.get("kind") == "jail":
            _fork_jail(control, request)
            continue
        parent_end, child_end = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            die_with_parent()
            control.close()
            parent_end.close()
            try:
                worker.worker_main(Connection(child_end.detach()), **request)
            finally:
                os._exit(1)
        child_end.close()
        socket.send_fds(control, [pickle.dumps(pid)], [parent_end.fileno()])
        parent_end.close()


def _fork_jail(control: socket.socket, request: dict) -> None:
    """Fork a jail for a sandboxed group (pkb.runtime.jail); answer its pid, a control socket and one
    socket per rank."""
    from pkb.runtime import jail

    pairs = [socket.socketpair() for _ in request["ranks"]]
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        control.close()
        ours.close()
        for parent_end, _ in pairs:
            parent_end.close()
        try:
            jail.jail_main(theirs, [child_end for _, child_end in pairs], request)
        finally:
            os._exit(1)
    theirs.close()
    for _, child_end in pairs:
        child_end.close()
    socket.send_fds(control, [pickle.dumps(pid)], [ours.fileno()] + [parent_end.fileno() for parent_end, _ in pairs])
    ours.close()
    for parent_end, _ in pairs:
        parent_end.close()


class Zygote:
    """The parent's handle on its zygote process (one per parent, started on first use)."""

    _instance: "Zygote | None" = None
    _lock = threading.Lock()

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import socket, sys; from pkb.runtime.zygote import serve; "
                                   "serve(socket.socket(fileno=int(sys.argv[1])))", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,  # Ctrl-C in the terminal reaches pkb alone; the server ends with its parent
        )
        theirs.close()
        self.control = ours
        atexit.register(self.stop)

    @classmethod
    def get(cls) -> "Zygote":
        with cls._lock:
            if cls._instance is None or cls._instance.process.poll() is not None:
                cls._instance = cls()
            return cls._instance

    def fork(self, **worker_kwargs) -> tuple[int, Connection]:
        """A new rank process running ``worker_main(conn, **worker_kwargs)``: its pid and our end."""
        with self._lock:
            self.control.send(pickle.dumps(worker_kwargs))
            message, fds, _, _ = socket.recv_fds(self.control, 1024, 1)
        if not fds:
            raise RuntimeError("the rank-process server did not answer (it may have died); see its output above")
        return pickle.loads(message), Connection(fds[0])

    def fork_jail(self, **request) -> tuple[int, socket.socket, list[Connection]]:
        """A sandboxed group (``request``: plan, ranks, log_paths): the jail's pid, its control socket and
        one connection per rank."""
        with self._lock:
            self.control.send(pickle.dumps({"kind": "jail", **request}))
            message, fds, _, _ = socket.recv_fds(self.control, 1024, 1 + len(request["ranks"]))
        if len(fds) != 1 + len(request["ranks"]):
            raise RuntimeError("the rank-process server did not answer (it may have died); see its output above")
        return pickle.loads(message), socket.socket(fileno=fds[0]), [Connection(fd) for fd in fds[1:]]

    def stop(self) -> None:
        try:
            self.control.close()
            self.process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
