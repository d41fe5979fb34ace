"""The processes that hold one sandboxed candidate group: the jail and its keeper (pkb.runtime.sandbox).

The zygote forks the *jail* for each group. The jail takes new namespaces where the kernel allows,
forks the *keeper*, and then only waits for the parent's word to end the group: it kills the keeper
(pid 1 of the group's pid namespace, so the kernel ends every process in it) or, without a pid
namespace, kills every process that reaches it as child subreaper until none is left, answers
``done`` and exits. The jail runs no candidate code and is outside the candidates' Landlock domain:
they cannot signal it.

The keeper makes the private mounts, opens the ranks' logs, enters the sandbox (irreversibly), then
forks the W ranks (or one build process) and hosts their rendezvous store; it never imports a
candidate either, but it shares the candidates' domain.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

from pkb.runtime import sandbox
from pkb.runtime.channel import send_reply
from pkb.runtime.proctree import children_by_parent

def jail_main(control: socket.socket, rank_ends: list[socket.socket], request: dict) -> None:
    """Entry point of the jail (forked by the zygote); never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sandbox.die_with_parent()
    plan: sandbox.SandboxPlan = request["plan"]
    namespaces = sandbox.unshare_namespaces(plan)
    if "pid-namespace" not in namespaces:
        sandbox.become_subreaper()
    keeper = os.fork()
    if keeper == 0:
        control.close()
        try:
            keeper_main(rank_ends, plan, namespaces, request)
        finally:
            os._exit(1)
    for end in rank_ends:
        end.close()
    try:
        control.recv(64)  # "kill", or the parent's end closing
    except OSError:
        pass
    _end_tree(keeper, "pid-namespace" in namespaces)
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


def keeper_main(rank_ends: list[socket.socket], plan: sandbox.SandboxPlan, namespaces: list[str], request: dict) -> None:
    """Enter the sandbox, fork the group's processes, host their store, reap them; never returns."""
    sandbox.die_with_parent()
    ranks: list[dict] = request["ranks"]
    try:
        sandbox.prepare_keeper(plan, namespaces)
        log_fds = [os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
                   for path in request["log_paths"]]
        quiet = os.open(os.devnull, os.O_WRONLY)  # the store's warnings are not the user's business
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        os.close(quiet)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(256)
        status = sandbox.enter(plan, namespaces)
        sandbox.set_dumpable(True)  # the ranks may share memory handles with each other (pidfd_getfd)
    except Exception as exc:
        message = f"the sandbox could not be set up: {exc}\n{traceback.format_exc(limit=-4)}"
        for end in rank_ends:
            send_reply(Connection(end.detach()), {"ready": False, "error": message})
        os._exit(1)
    environment = sandbox.candidate_environment(plan, namespaces)
    os.chdir(plan.scratch)  # the working directory it inherited (perhaps the checkout) is not readable
    port = listener.getsockname()[1]
    for index, end in enumerate(rank_ends):
        pid = os.fork()
        if pid == 0:
            sandbox.die_with_parent()
            for other in rank_ends:
                if other is not end:
                    other.close()
            listener.close()
            conn = Connection(end.detach())
            kwargs = {**ranks[index], "env_updates": {**ranks[index].get("env_updates", {}), **environment}}
            try:
                _run_target(conn, kwargs, port, log_fds[index], status.to_dict())
            finally:
                os._exit(1)
    for end in rank_ends:
        end.close()
    for fd in log_fds:
        os.close(fd)
    store = None
    if ranks[0].get("target", "worker") == "worker":
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, len(ranks), True, timeout=timedelta(seconds=600),
                              wait_for_workers=False, master_listen_fd=listener.fileno())
    while True:  # reap the ranks (and, as pid 1 of a pid namespace, whatever is orphaned in it)
        try:
            os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    del store
    os._exit(0)


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
