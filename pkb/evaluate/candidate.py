"""What the parent knows about a candidate without running it: its source, hash, syntax and needs.

The parent reads and parses the file (parsing runs nothing) but never imports it. A candidate may state what it needs
with a literal ``REQUIRES = ("cuda",)``: ``cpu`` mode then reports it ``skipped`` without running it. Without one, it
runs (upstream files touch CUDA only on some paths, e.g. under ``if x.is_cuda``, and many run on a CPU), and where it
fails in a mode without a GPU, it is ``skipped`` only if its source holds code that cannot run without one
(``gpu_code``: a CUDA extension built, a Triton or CuPy kernel, a CUDA device, stream or event asked for), or, where
the run cannot give NVSHMEM, code that uses it (``nvshmem_code``): facts the parent reads itself through the parser
(comments and docstrings say nothing), never the words of an error a candidate's process sends
(pkb.evaluate.failures). Such a ``skipped`` is the candidate's (``Details.skipped_by``): reports count it as not
passed, unlike a skip the run causes for every candidate alike (pkb.report.metrics).
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

# Code that cannot run without a GPU, as the parser sees it: modules that need one, and calls that ask for a device,
# a stream or a CUDA build (a build of C++ alone, ``load_cuda(..., with_cuda=False)``, runs on the CPU; importing
# symmetric memory does too).
_GPU_MODULES = ("triton", "cupy", "pycuda", "cuda", "nvshmem", "cutlass")
_CUDA_BUILDS = ("compile_cuda_extension", "load_cuda", "load_inline")
_CPU_QUERIES = ("is_available", "device_count", "is_initialized", "is_bf16_supported")  # torch.cuda calls a CPU answers
# NVSHMEM in a string the code uses: CUDA source that calls or includes it (``nvshmem_ptr(``, ``nvshmemx_...``,
# ``#include <nvshmem.h>``), or a name that selects it (``set_backend("NVSHMEM")``); never a word in a docstring.
_NVSHMEM_IN_TEXT = re.compile(r"\bnvshmemx?_\w|\bnvshmemx?\.h\b|^\s*nvshmem\s*$", re.IGNORECASE)


def gpu_code(source: str) -> str | None:
    """The first line of ``source`` that holds code needing a GPU (``line N: what``), or None."""
    try:
        tree = syntax.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        found = _gpu_construct(node)
        if found:
            return f"line {getattr(node, 'lineno', 0)}: {found}"
    return None


def nvshmem_code(source: str) -> str | None:
    """The first line of ``source`` whose code uses NVSHMEM (``line N: what``), or None: read through the parser, so
    a comment or a docstring that names it is no use of it. A use is an import of a module, or a name or attribute,
    that holds ``nvshmem`` (``import nvshmem.core``, ``symm_mem.nvshmem_...``), or a string the code uses that holds
    CUDA source calling or including NVSHMEM, or names it alone (``set_backend("NVSHMEM")``)."""
    try:
        tree = syntax.parse(source)
    except (SyntaxError, ValueError):
        return None
    unused = {id(node.value) for node in ast.walk(tree)  # a string statement (a docstring) does nothing
              if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    for node in ast.walk(tree):
        found = _nvshmem_construct(node, unused)
        if found:
            return f"line {getattr(node, 'lineno', 0)}: {found}"
    return None


def _nvshmem_construct(node: ast.AST, unused: set[int]) -> str | None:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [alias.name for alias in node.names] + ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found = [name for name in names if "nvshmem" in name.lower()]
        return f"imports {found[0]}" if found else None
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    if name is not None and "nvshmem" in name.lower():
        return f"names {name}"
    if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in unused
            and _NVSHMEM_IN_TEXT.search(node.value)):
        return f"a string that uses NVSHMEM ({_NVSHMEM_IN_TEXT.search(node.value).group(0).strip()!r})"
    return None


def _gpu_construct(node: ast.AST) -> str | None:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        for name in names:
            if any(name == module or name.startswith(module + ".") for module in _GPU_MODULES):
                return f"imports {name}"
        return None
    if not isinstance(node, ast.Call):
        return None
    name = syntax.dotted(node.func) or getattr(node.func, "attr", "")
    last = name.rsplit(".", 1)[-1]
    keywords = {keyword.arg: keyword.value for keyword in node.keywords}
    if last == "cuda" and isinstance(node.func, ast.Attribute):
        return f"calls {name}()"
    if last in _CUDA_BUILDS and not _cpu_only_build(last, node, keywords):
        return f"builds a CUDA extension ({name})"
    if name.startswith("torch.cuda.") and last not in _CPU_QUERIES:
        return f"calls {name}()"
    for value in (*node.args, *keywords.values()):
        if isinstance(value, ast.Constant) and isinstance(value.value, str) and re.fullmatch(r"cuda(:\d+)?", value.value):
            return f"asks for the device {value.value!r} ({name or 'a call'})"
    return None


def _cpu_only_build(name: str, node: ast.Call, keywords: dict) -> bool:
    """A build of C++ alone: ``load_cuda(..., with_cuda=False)``, or ``load_inline`` without CUDA sources."""
    if name == "load_cuda":
        flag = keywords.get("with_cuda")
        return isinstance(flag, ast.Constant) and flag.value is False
    if name == "load_inline":
        sources = keywords.get("cuda_sources", node.args[2] if len(node.args) > 2 else None)
        return sources is None or (isinstance(sources, ast.Constant) and not sources.value)
    return False


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

    @property
    def gpu_code(self) -> str | None:
        """Where its source holds code that needs a GPU (``gpu_code``); None for the reference."""
        return None if self.is_reference else gpu_code(self.source)

    @property
    def nvshmem_code(self) -> str | None:
        """Where its code uses NVSHMEM (``nvshmem_code``: imports, names, CUDA source in strings; never comments or
        docstrings); None for the reference."""
        return None if self.is_reference else nvshmem_code(self.source)

    @property
    def uses_nvshmem(self) -> bool:
        """Whether it declares NVSHMEM or its code uses it (what a mode without NVSHMEM cannot run)."""
        return "nvshmem" in self.requires or self.nvshmem_code is not None

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
        """Why ``mode`` on ``nodes`` nodes cannot run this candidate, or None if it can: a skip its declaration causes,
        counted as not passed. NVSHMEM needs a GPU per rank (cuda mode) and, across nodes, real ones
        (docs/topology.md)."""
        if "cuda" in self.requires and not mode.uses_gpu:
            return (f"the candidate declares REQUIRES = ('cuda',); mode {mode} has no GPU: counted as not passed (run it "
                    "with --mode cuda or shared-gpu)")
        if "nvshmem" in self.requires and (mode is not Mode.CUDA or nodes > 1):
            return ("the candidate declares REQUIRES nvshmem: NVSHMEM needs a GPU per rank (cuda mode) and, across "
                    f"nodes, real nodes; this run is {mode} mode on {nodes} node(s)"
                    + (" (virtual: its inter-node traffic would go over NVLink)" if nodes > 1 else "")
                    + ": counted as not passed")
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
