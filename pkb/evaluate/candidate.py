"""What the parent knows about a candidate without running it: its source, hash, syntax and needs.

The parent reads and compiles the file (compiling runs nothing) but never imports it. A candidate
states what it needs with a literal ``REQUIRES = ("cuda",)``; without one, the needs are inferred
from the source (CUDA builds, Triton, symmetric memory, CUDA tensors), so upstream files that know
nothing of pkb are skipped in ``cpu`` mode rather than failed.
"""

from __future__ import annotations

import ast
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from pkb.problem import Problem
from pkb.runtime.modes import Mode

KNOWN_REQUIREMENTS = ("cuda",)

_CUDA_MARKERS = re.compile(
    r"load_inline|compile_cuda_extension|cuda_helpers|_symmetric_memory|symm_mem|^\s*(import|from)\s+triton"
    r"|torch\.cuda\.|\.cuda\(|device\s*=\s*['\"]cuda|cupy|numba\.cuda|pkb\.kernels",
    re.MULTILINE,
)


@dataclass(frozen=True)
class Candidate:
    """A solution to evaluate: a file, or the problem's own reference (``path is None``, a self-check)."""

    name: str
    path: Path | None
    source: str
    sha256: str
    requires: tuple[str, ...]
    requires_inferred: bool = False

    @classmethod
    def from_file(cls, path: str | Path, name: str | None = None) -> "Candidate":
        path = Path(path).resolve()
        source = path.read_text(encoding="utf-8", errors="replace")
        requires, inferred = _requirements(source)
        return cls(name or path.stem, path, source, hashlib.sha256(source.encode()).hexdigest(), requires, inferred)

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

    def missing_in(self, mode: Mode) -> str | None:
        """Why ``mode`` cannot run this candidate, or None if it can."""
        if "cuda" in self.requires and not mode.uses_gpu:
            how = "uses CUDA (inferred from its source)" if self.requires_inferred else "declares REQUIRES = ('cuda',)"
            return f"the candidate {how}; mode {mode} has no GPU (run it with --mode cuda or shared-gpu)"
        return None


def _requirements(source: str) -> tuple[tuple[str, ...], bool]:
    declared = _declared_requirements(source)
    if declared is not None:
        return declared, False
    return (("cuda",) if _CUDA_MARKERS.search(source) else ()), True


def _declared_requirements(source: str) -> tuple[str, ...] | None:
    try:
        tree = ast.parse(source)
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
