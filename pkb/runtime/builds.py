"""The build broker: CUDA/C++ extensions for sandboxed candidates, built so that no candidate can
write what another one loads.

A sandboxed rank that needs an extension (``pkb.kernels.load_cuda``, or upstream's
``compile_cuda_extension``) sends the build request — sources, flags, architecture — to its parent.
The parent's broker names the extension by a hash of that request (``extension_name``, computed
here, not taken from the rank), builds it once in a sandboxed build process of its own (the same
sandbox as a candidate: the compiler, run on untrusted source and flags, can write only its own
scratch directory), receives the library's bytes, and writes them into a content-addressed cache
that only the parent writes and candidates read. Ranks of the same group, and later evaluations of
the same source, load it from there without building again; a build that two groups ask for at once
happens once.

The cache is ``<torch's extensions dir>/pkb-broker/<name>_<hash>/<name>_<hash>.so``, apart from the
directory that unsandboxed builds (``--sandbox off``) write.
"""

from __future__ import annotations

import os
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from pkb.kernels.build import BUILD_MEMORY, BuildError, cached_library, extension_name
from pkb.runtime.channel import ChannelError, recv_reply
from pkb.runtime.group import LIMIT_WORDS, RankGroup

BUILD_TIMEOUT_S = 900.0
MAX_REQUEST_BYTES = 16 << 20
_STRING_LISTS = ("cuda_sources", "cpp_sources", "extra_cuda_cflags", "extra_cflags", "extra_include_paths",
                 "extra_ldflags")


def build_slots() -> int:
    """How many builds every broker of this process runs at once, together: no more than the cores, nor than the
    machine's memory holds at ``BUILD_MEMORY`` each with as much again left for the ranks (sessions side by side
    each have a broker; their builds at once took a 24 GiB, 2-core machine out of memory)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(os.cpu_count() or 1, total // (2 * BUILD_MEMORY)))


_SLOTS = threading.BoundedSemaphore(build_slots())


def broker_cache_root() -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root(), "pkb-broker")


def validated(request) -> dict:
    """The request as plain strings and lists, or ValueError: it comes from a candidate's process."""
    if not isinstance(request, dict):
        raise ValueError("a build request must be a dict")
    clean = {}
    for key in ("name", "arch", "torch", "python"):
        if not isinstance(request.get(key), str) or not request[key]:
            raise ValueError(f"build request: {key} must be a non-empty string")
        clean[key] = request[key]
    if not clean["name"].isidentifier():
        raise ValueError(f"build request: the extension name {clean['name']!r} is not an identifier")
    for key in _STRING_LISTS:
        value = request.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"build request: {key} must be a list of strings")
        clean[key] = list(value)
    functions = request.get("functions")
    if functions is not None and (not isinstance(functions, list) or not all(isinstance(f, str) for f in functions)):
        raise ValueError("build request: functions must be a list of strings")
    clean["functions"] = functions
    clean["with_cuda"] = bool(request.get("with_cuda", True))
    if sum(len(s) for key in _STRING_LISTS for s in clean[key]) > MAX_REQUEST_BYTES:
        raise ValueError("build request: the sources exceed 16 MiB")
    return clean


class BuildBroker:
    """Builds requested extensions in sandboxed build processes; one per session (its cache outlives it).

    At most ``max_parallel`` builds run at once (and no more than ``build_slots`` over every broker of the process,
    each started once the machine has ``BUILD_MEMORY`` free: pkb.kernels.build.build_locally); the others wait in a
    queue, however many one evaluation asks for (a solution that builds one extension per rank asks for W at once). The time a group's ranks
    spend waiting for the broker, in its queue or while it builds, is not counted against them
    (``waiting_for``: their deadline stops meanwhile): how fast this machine builds, and how many other
    evaluations build beside them, is no part of a verdict. A build has its own limit, pkb's
    (``BUILD_TIMEOUT_S``), and an evaluation at most ``MAX_SOURCES`` sources. A build belongs to the groups
    that wait for it: when the last of them ends (its evaluation is over, or timed out), the build is
    dropped from the queue or its process killed, so that no candidate can keep the build slots busy
    beyond its own evaluation.
    """

    MAX_PARALLEL = 4
    # Extensions of different sources one evaluation may ask for: far beyond any real solution (one per
    # rank at W = 8, times a few kernels), a bound on what one candidate can queue; past it, a refusal
    # that says it is pkb's limit.
    MAX_SOURCES = 64

    def __init__(self, sandbox: str, cache_root: Path | None = None, max_parallel: int = MAX_PARALLEL):
        self.sandbox = sandbox  # the level its build processes run at (a candidate's: pkb.runtime.sandbox)
        self.cache_root = Path(cache_root or broker_cache_root())
        self.cache_root.mkdir(parents=True, exist_ok=True)  # it must exist when a sandbox's rules are made
        self._builds: dict[str, Future] = {}
        self._waiters: dict[str, set] = {}  # extension -> the groups waiting for its build
        self._running: dict[str, object] = {}  # extension -> its build process's group
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="pkb-build")

    def request(self, raw: object, answer: Callable[[dict], None], owner: object = None) -> None:
        """Answer ``raw`` (a rank's request, for the group ``owner``) with ``{"path": library}`` or
        ``{"error": text}``, from a build thread once the library is in the cache."""
        try:
            request = validated(raw)
        except ValueError as exc:
            answer({"error": str(exc)})
            return
        full_name = extension_name(request)
        with self._lock:
            asked = {name for name, waiting in self._waiters.items() if owner in waiting}
            if owner is not None and full_name not in asked and len(asked) >= self.MAX_SOURCES:
                answer({"error": f"{LIMIT_WORDS} more than {self.MAX_SOURCES} extensions of different sources asked "
                                 "for by one evaluation (a bound on what one evaluation may queue, not a verdict on "
                                 "its kernels)", "limit": "extensions per evaluation"})
                return
            build = self._builds.get(full_name)
            if build is None or build.cancelled() or (build.done() and "error" in build.result()):
                build = self._pool.submit(self._build, full_name, request)
                self._builds[full_name] = build
                self._waiters[full_name] = set()
            self._waiters[full_name].add(owner)
        build.add_done_callback(lambda done: answer({"error": "the build was cancelled"} if done.cancelled()
                                                    else done.result()))

    def waiting_for(self, owner: object) -> bool:
        """Whether ``owner``'s group waits for a build: queued, or building."""
        with self._lock:
            return any(owner in waiting and not self._builds[name].done() for name, waiting in self._waiters.items())

    def release(self, owner: object) -> None:
        """``owner``'s group has ended: drop or kill the builds that no other group waits for."""
        with self._lock:
            for full_name, waiting in self._waiters.items():
                if owner not in waiting:
                    continue
                waiting.discard(owner)
                build = self._builds[full_name]
                if waiting or build.done() or build.cancel():
                    continue
                running = self._running.get(full_name)
                if running is not None:
                    running.kill()  # its build thread reads the end of the channel: a build error

    def _build(self, full_name: str, request: dict) -> dict:
        library = cached_library(self.cache_root, full_name)
        if library.is_file():
            return {"path": str(library)}
        try:
            data = self._build_sandboxed(full_name, request)
        except BuildError as exc:
            return {"error": str(exc)}
        except Exception as exc:  # pkb's own failure: said so, as a build error the candidate's verdict names
            return {"error": f"pkb's build broker failed: {type(exc).__name__}: {exc}"}
        library.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.NamedTemporaryFile(dir=library.parent, prefix=".incoming-", delete=False)
        with staging:
            staging.write(data)
        os.chmod(staging.name, 0o755)
        os.replace(staging.name, library)
        return {"path": str(library)}

    def _build_sandboxed(self, full_name: str, request: dict) -> bytes:
        with _SLOTS:  # the process's build slots (build_slots; the build process then waits for memory to be free)
            return self._build_in_a_slot(full_name, request)

    def _build_in_a_slot(self, full_name: str, request: dict) -> bytes:
        with self._lock:  # started and registered at once, so that ``release`` always finds it
            if not self._waiters.get(full_name):
                raise BuildError("the evaluations that asked for this build have ended")
            group = RankGroup.builder(self.sandbox, request)
            self._running[full_name] = group
        try:
            conn = group.ranks[0].conn
            if not conn.poll(BUILD_TIMEOUT_S):
                raise BuildError(f"{LIMIT_WORDS} the build did not finish within {BUILD_TIMEOUT_S:.0f} s")
            try:
                reply = recv_reply(conn)
            except (EOFError, OSError, ChannelError):
                raise BuildError("the build process died:\n" + group.log_tail(0)) from None
        finally:
            with self._lock:
                self._running.pop(full_name, None)
            group.kill()
        if reply.get("error"):
            raise BuildError(reply["error"] if isinstance(reply["error"], str) else "the build failed")
        library = reply.get("library")
        if not isinstance(library, torch.Tensor) or library.dtype != torch.uint8:
            raise BuildError("the build process sent no library")
        return library.numpy().tobytes()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
