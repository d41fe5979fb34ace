"""What the parent knows about a candidate without running it: its source, hash, syntax and needs.

The parent reads and compiles the file (compiling runs nothing) but never imports it. A candidate
may state what it needs with a literal ``REQUIRES = ("cuda",)``: ``cpu`` mode then reports it
``skipped`` without running it. Without one, it runs, and ``cpu`` mode reports it ``skipped`` only if
what it did shows that it needs a GPU (``gpu_needed_by``: it asked for a CUDA device, built a CUDA
extension, launched a Triton kernel); words in its source decide nothing (upstream files touch CUDA
only on some paths, e.g. under ``if x.is_cuda``).
"""

from __future__ import annotations

import ast
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from pkb import syntax
from pkb.problem import Problem
from pkb.options import Mode

KNOWN_REQUIREMENTS = ("cuda", "nvshmem")

# What code that needs a GPU raises on a machine (or in a mode) without one.
_NEEDS_GPU = re.compile(
    r"Torch not compiled with CUDA enabled|Found no NVIDIA driver|No CUDA GPUs are available"
    r"|CUDA driver initialization failed|Cannot access accelerator device when none is available"
    r"|CUDA_HOME environment variable is not set|No module named '(triton|cupy|pycuda|cuda|nvshmem)[.']"
    r"|\b0 active drivers\b|with arguments from the 'CPU' backend|needs a CUDA device"
)


def gpu_needed_by(error: str) -> str | None:
    """The line of ``error`` that shows the code needs a GPU, or None (then it is the code's own failure)."""
    for line in (error or "").splitlines():
        if _NEEDS_GPU.search(line):
            return line.strip()[:200]
    return None


@dataclass(frozen=True)
class Candidate:
    """A solution to evaluate: a file, or the problem's own reference (``path is None``, a self-check)."""

    name: str
    path: Path | None
    source: str
    sha256: str
    requires: tuple[str, ...]

    @classmethod
    def from_file(cls, path: str | Path, name: str | None = None) -> "Candidate":
        path = Path(path).resolve()
        source = path.read_text(encoding="utf-8", errors="replace")
        return cls(name or path.stem, path, source, hashlib.sha256(source.encode()).hexdigest(),
                   _declared_requirements(source) or ())

    @classmethod
    def reference_of(cls, problem: Problem) -> "Candidate":
        import inspect
        import sys

        source = inspect.getsource(sys.modules[problem.reference.__module__])
        return cls("reference", None, source, hashlib.sha256(source.encode()).hexdigest(), ())

    @property
    def is_reference(self) -> bool:
        return self.path is None

    def syntax_error(self) -> str | None:
        """The compiler's message if the file is not valid Python (checked without running it)."""
        if self.path is None:
            return None
        try:
            compile(self.source, str(self.path), "exec", dont_inherit=True)
        except SyntaxError as exc:
            return f"{exc.filename}:{exc.lineno}:{exc.offset}: {exc.msg}\n    {(exc.text or '').rstrip()}"
        except ValueError as exc:  # e.g. null bytes in the source
            return str(exc)
        return None

    def missing_in(self, mode: Mode, nodes: int = 1) -> str | None:
        """Why ``mode`` on ``nodes`` nodes cannot run this candidate, or None if it can. NVSHMEM needs a GPU per
        rank (cuda mode) and, across nodes, real ones (docs/topology.md)."""
        if "cuda" in self.requires and not mode.uses_gpu:
            return f"the candidate declares REQUIRES = ('cuda',); mode {mode} has no GPU (run it with --mode cuda or shared-gpu)"
        if "nvshmem" in self.requires and (mode is not Mode.CUDA or nodes > 1):
            return ("the candidate declares REQUIRES nvshmem: NVSHMEM needs a GPU per rank (cuda mode) and, across "
                    f"nodes, real nodes; this run is {mode} mode on {nodes} node(s)"
                    + (" (virtual: its inter-node traffic would go over NVLink)" if nodes > 1 else ""))
        return None


def _declared_requirements(source: str) -> tuple[str, ...] | None:
    try:
        tree = syntax.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "REQUIRES" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return None
            values = (value,) if isinstance(value, str) else tuple(value)
            return tuple(str(v) for v in values)
    return None
