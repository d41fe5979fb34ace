"""Building CUDA/C++ extensions from source, once per source.

The extension's name carries a hash of everything that affects the build (sources, flags, the
target architectures, torch's version), so the same source loads from torch's extension cache in
well under a second, a changed source never loads a stale build, and the W ranks of a group that
build at once wait for one build (torch's cpp_extension holds a file lock per build directory).
A failed build raises ``BuildError`` carrying the compiler's output: the verdict is ``compile_error``.
"""

from __future__ import annotations

import hashlib
import os
from typing import Sequence


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
    ``cpp_sources`` with their declarations then). Returns the loaded module.
    """
    import torch
    from torch.utils.cpp_extension import load_inline

    cuda_sources = [cuda_sources] if isinstance(cuda_sources, str) else list(cuda_sources)
    cpp_sources = [cpp_sources] if isinstance(cpp_sources, str) else list(cpp_sources)
    arch = cuda_arch_list()
    flags = ["-O3", *extra_cuda_cflags] if with_cuda else []
    key = "\0".join([*cuda_sources, *cpp_sources, repr(functions), repr(flags), repr(list(extra_cflags)),
                     repr(list(extra_include_paths)), repr(list(extra_ldflags)), arch, torch.__version__])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    previous = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch

    def build():
        return load_inline(
            name=f"{name}_{digest}", cpp_sources=cpp_sources, cuda_sources=cuda_sources if with_cuda else None,
            functions=list(functions) if functions else None, extra_cuda_cflags=flags,
            extra_cflags=["-O3", *extra_cflags], extra_include_paths=list(extra_include_paths),
            extra_ldflags=list(extra_ldflags), with_cuda=with_cuda, verbose=False,
        )

    try:
        try:
            return build()
        except ImportError:
            # Another rank held the build lock and its build failed, so there is nothing to load:
            # build again here, which reports the compiler's own error.
            return build()
    except RuntimeError as exc:
        if "Error building extension" in str(exc):
            raise BuildError(str(exc)) from None
        raise
    finally:
        if previous is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = previous


def compile_cuda_extension(name, cuda_src, extra_cuda_cflags=None, extra_include_paths=None, extra_ldflags=None):
    """The upstream benchmark's helper: CUDA source that carries its own PYBIND11_MODULE; -O3; cached."""
    return load_cuda(name, cuda_src, extra_cuda_cflags=extra_cuda_cflags or (),
                     extra_include_paths=extra_include_paths or (), extra_ldflags=extra_ldflags or ())
