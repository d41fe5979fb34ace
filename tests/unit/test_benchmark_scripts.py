"""Every script in benchmarks/ imports and answers ``--help`` on a machine without a GPU (issue 55): the GPU timing
proofs the README's numbers rest on once stopped at an ImportError (a name that had moved inside pkb.evaluate) and
nothing noticed until a GPU ran them. Here, in this process, each script runs as ``python SCRIPT --help`` runs it
(``runpy``, as ``__main__``): its imports execute and its parser answers, before any GPU is asked for. Every name
of pkb a file imports, inside a function or in a program it writes for a subprocess too, must exist where it is
imported from. The shell scripts name only files that exist and pass the Python scripts only flags they take
(``bash -n`` on them: tests/integration/test_benchmark_shell_scripts.py).

A .py file under benchmarks/ is a script (it has a ``__main__`` block) or a candidate for ``pkb eval`` (it defines
``solution``, as benchmarks/sandbox_probe.py does); a candidate is checked for its imports, not for ``--help``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import re
import runpy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
PY_FILES = sorted(path for path in BENCHMARKS.rglob("*.py") if "results" not in path.relative_to(BENCHMARKS).parts)
SHELL_SCRIPTS = sorted(path for path in BENCHMARKS.rglob("*.sh") if "results" not in path.relative_to(BENCHMARKS).parts)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _is_script(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) for node in tree.body)


def _defines_solution(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.FunctionDef) and node.name == "solution" for node in tree.body)


SCRIPTS = [path for path in PY_FILES if _is_script(_tree(path))]


def _name(path: Path) -> str:
    return str(path.relative_to(REPO))


def help_text(script: Path) -> str:
    """What ``python SCRIPT --help`` prints; AssertionError if it does not end there with exit status 0."""
    out = io.StringIO()
    argv, path = sys.argv, sys.path
    sys.argv, sys.path = [str(script), "--help"], [str(script.parent), *sys.path]  # as `python SCRIPT` sets them
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path = argv, path
    assert exit_.value.code in (0, None), f"{_name(script)} --help exited {exit_.value.code}"
    assert out.getvalue().startswith("usage:"), f"{_name(script)} --help printed {out.getvalue()[:200]!r}"
    return out.getvalue()


def test_every_python_file_in_benchmarks_is_a_script_or_a_candidate():
    expected = {BENCHMARKS / "gpu_timing.py", BENCHMARKS / "nccl_fidelity.py", BENCHMARKS / "node_isolation" / "run.py"}
    assert expected <= set(SCRIPTS), "the scripts were not found"
    neither = [_name(path) for path in PY_FILES if not _is_script(_tree(path)) and not _defines_solution(_tree(path))]
    assert not neither, f"neither a script (no __main__ block) nor a candidate (no solution): {neither}"


@pytest.mark.parametrize("script", SCRIPTS, ids=_name)
def test_script_imports_and_answers_help_without_a_gpu(script):
    help_text(script)


def _imported_pkb_names(tree: ast.AST) -> list[tuple[str, str | None, int]]:
    """``(module, name, line)`` for each ``from pkb... import name`` and ``import pkb...`` anywhere in ``tree``,
    and in every string constant that is itself a program with such imports (code run by a subprocess)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "pkb":
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names if alias.name.split(".")[0] == "pkb"]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            try:
                program = ast.parse(node.value)
            except SyntaxError:  # prose, a docstring
                continue
            found += [(module, name, node.lineno) for module, name, _ in _imported_pkb_names(program)]
    return found


@pytest.mark.parametrize("path", PY_FILES, ids=_name)
def test_every_name_of_pkb_a_benchmark_file_imports_exists(path):
    missing = []
    for module_name, name, line in _imported_pkb_names(_tree(path)):
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            missing.append(f"line {line}: {module_name}: {exc}")
            continue
        if name is not None and name != "*" and not hasattr(module, name):
            try:
                importlib.import_module(f"{module_name}.{name}")
            except ImportError:
                missing.append(f"line {line}: {module_name} has no {name}")
    assert not missing, f"{_name(path)} imports what pkb no longer has:\n" + "\n".join(missing)


def _logical_lines(script: Path) -> list[str]:
    return script.read_text(encoding="utf-8").replace("\\\n", " ").splitlines()


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=_name)
def test_shell_script_names_only_files_that_exist(script):
    named = {match for line in _logical_lines(script) if not line.lstrip().startswith("#")
             for match in re.findall(r"(?<![\w./$-])((?:benchmarks|tests|pkb|scripts)/[\w./-]*)", line)}
    assert named, f"{_name(script)} names no file of the checkout"
    missing = sorted(path for path in named if not (REPO / path).exists())
    assert not missing, f"{_name(script)} names what the checkout lacks: {missing}"


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=_name)
def test_shell_script_passes_each_python_script_only_flags_it_takes(script):
    calls = [(match.group(1), match.group(2)) for line in _logical_lines(script)
             for match in re.finditer(r"python3? (benchmarks/[\w/]+\.py)([^;|&]*)", line)]
    assert calls, f"{_name(script)} runs no script of benchmarks/"
    unknown = []
    for called, arguments in calls:
        flags = set(re.findall(r"--[a-z][\w-]*", arguments))
        usage = help_text(REPO / called)
        unknown += [f"{called} {flag}" for flag in sorted(flags) if not re.search(rf"(?<![\w-]){flag}(?![\w-])", usage)]
    assert not unknown, f"{_name(script)} passes flags its scripts do not take: {unknown}"
