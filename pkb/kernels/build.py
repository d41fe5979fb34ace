"""Building CUDA/C++ extensions from source, once per source.

The extension's name carries a hash of everything that affects the build (sources, flags, the
target architectures, torch's and Python's versions), so the same source loads from the extension
cache (``$TORCH_EXTENSIONS_DIR/pkb``, else under torch's default build root) in well under a second,
and a changed source never loads a stale build.

The W ranks of a group that build at once wait for one build under an OS file lock (``flock``), which
the kernel releases when its holder dies. torch's own lock is a file that only its owner deletes: a
build killed half way (a timeout, Ctrl-C) leaves it behind, and every later load of that source would
wait for it forever. Under pkb's lock no other pkb build of the directory is running, so a torch lock
found there is such a leftover and is removed. Ranks that waited for a build that failed report its
error without building again.

A failed build raises ``BuildError`` carrying the compiler's output: the verdict is ``compile_error``.

In a sandboxed candidate process nothing here writes a cache: the build is requested from pkb's
build broker (pkb.runtime.builds, through pkb.runtime.build_client), which builds in a sandboxed process
of its own and keeps the library in a content-addressed cache that only the trusted parent writes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence


class BuildError(RuntimeError):
    """The compiler rejected the source; the message holds its output."""


def cuda_arch_list() -> str:
    """``TORCH_CUDA_ARCH_LIST`` if the user set it, else this GPU's architecture (e.g. ``9.0`` on Hopper)."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}"
    return "9.0"


def load_cuda(name: str, cuda_sources: str | Sequence[str], cpp_sources: str | Sequence[str] = (),
              functions: Sequence[str] | None = None, extra_cuda_cflags: Sequence[str] = (),
              extra_cflags: Sequence[str] = (), extra_include_paths: Sequence[str] = (),
              extra_ldflags: Sequence[str] = (), with_cuda: bool = True):
    """Build (or load from the cache) an extension with ``torch.utils.cpp_extension.load_inline``.

    ``functions`` names the C++ functions to bind when the sources carry no PYBIND11_MODULE (pass a
    ``cpp_sources`` with their declarations then). Returns the loaded module. In a sandboxed candidate
    process the build is done by pkb's build broker (``BROKER``) and the module loaded read-only.
    """
    import torch

    request = {
        "name": name, "cuda_sources": [cuda_sources] if isinstance(cuda_sources, str) else list(cuda_sources),
        "cpp_sources": [cpp_sources] if isinstance(cpp_sources, str) else list(cpp_sources),
        "functions": list(functions) if functions else None, "extra_cuda_cflags": list(extra_cuda_cflags),
        "extra_cflags": list(extra_cflags), "extra_include_paths": list(extra_include_paths),
        "extra_ldflags": list(extra_ldflags), "with_cuda": bool(with_cuda), "arch": cuda_arch_list(),
        "torch": str(torch.__version__), "python": sys.version.split()[0],
    }
    if BROKER is not None:
        return BROKER.load(request)
    return build_locally(request, build_directory(extension_name(request)))


def extension_name(request: dict) -> str:
    """The extension's module name: its name and a hash of everything that affects the build."""
    flags = ["-O3", *request["extra_cuda_cflags"]] if request["with_cuda"] else []
    key = "\0".join([*request["cuda_sources"], *request["cpp_sources"], repr(request["functions"]), repr(flags),
                      repr(request["extra_cflags"]), repr(request["extra_include_paths"]),
                      repr(request["extra_ldflags"]), request["arch"], request["torch"], request["python"]])
    return f"{request['name']}_{hashlib.sha256(key.encode()).hexdigest()[:16]}"


BUILD_MEMORY = 2 << 30  # what one build may take: cc1plus over torch's headers reaches about 1.5 GiB
MEMORY_WAIT_S = 300.0  # the longest a build waits for that much memory to be free before it starts anyway


def meminfo_bytes(key: str) -> int | None:
    """The line ``key`` of /proc/meminfo (``MemTotal``, ``MemAvailable``) in bytes, or None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def wait_for_memory(needed: int = BUILD_MEMORY, limit_s: float = MEMORY_WAIT_S) -> None:
    """Wait (at most ``limit_s``) until ``needed`` bytes of memory are free: builds of every process on the machine
    (ranks that each build, other evaluations, another pkb) at once took a 24 GiB machine out of memory."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        free = meminfo_bytes("MemAvailable")
        if free is None or free >= needed:
            return
        time.sleep(0.5)


def build_locally(request: dict, directory: Path):
    """Build ``request`` in ``directory`` (under an OS lock shared by the processes that build it) and load it."""
    from torch.utils.cpp_extension import load_inline

    full_name = extension_name(request)
    with_cuda = request["with_cuda"]
    failure = directory / "pkb-build-failed.txt"
    previous = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = request["arch"]
    waiting_since = time.time()
    try:
        with _exclusive(directory / "pkb-build.lock"):
            if failure.is_file() and failure.stat().st_mtime >= waiting_since:
                raise BuildError(failure.read_text())  # the build this rank waited for failed: same source, same error
            (directory / "lock").unlink(missing_ok=True)  # torch's lock, left by a build that was killed
            if not any(directory.glob("*.so")):  # a build to run, not a library to load
                wait_for_memory()
            try:
                return load_inline(
                    name=full_name, cpp_sources=request["cpp_sources"],
                    cuda_sources=request["cuda_sources"] if with_cuda else None,
                    functions=request["functions"], extra_cuda_cflags=["-O3", *request["extra_cuda_cflags"]] if with_cuda else [],
                    extra_cflags=["-O3", *request["extra_cflags"]], extra_include_paths=request["extra_include_paths"],
                    extra_ldflags=request["extra_ldflags"], with_cuda=with_cuda, build_directory=str(directory),
                    verbose=False,
                )
            except RuntimeError as exc:
                if "Error building extension" not in str(exc):
                    raise
                failure.write_text(str(exc))
                raise BuildError(str(exc)) from None
    finally:
        if previous is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = previous


# In a sandboxed candidate process: what builds for it, set by the rank's start-up
# (pkb.runtime.build_client.BrokerClient: an object whose ``load(request)`` returns the built module).
BROKER = None


def cached_library(cache_root: Path, full_name: str) -> Path:
    """Where the broker keeps the built library of ``full_name``."""
    return Path(cache_root, full_name, f"{full_name}.so")


def import_extension(full_name: str, library: Path):
    """Import the extension module ``full_name`` from its built library."""
    import importlib.util

    if full_name in sys.modules:
        return sys.modules[full_name]
    spec = importlib.util.spec_from_file_location(full_name, str(library))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[full_name] = module
    return module


def build_directory(full_name: str) -> Path:
    """Where the extension ``full_name`` (name + source hash) is built and cached; created if missing."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    directory = Path(root, "pkb", full_name)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path``: other processes wait; the OS releases it if this one dies."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def compile_cuda_extension(name, cuda_src, extra_cuda_cflags=None, extra_include_paths=None, extra_ldflags=None):
    """The upstream benchmark's helper: CUDA source that carries its own PYBIND11_MODULE; -O3; cached."""
    return load_cuda(name, cuda_src, extra_cuda_cflags=extra_cuda_cflags or (),
                     extra_include_paths=extra_include_paths or (), extra_ldflags=extra_ldflags or ())
