"""Discovery of the problem suite: every module under ``pkb/problems/`` that defines ``PROBLEM``.

No dispatch table: adding a problem is adding a module. Lookup is by slug or upstream number, and
a selection string (``"1-8,12,allgather_gemm"``) picks several.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import Iterable

from pkb.problem import Problem, ProblemError

PROBLEMS_PACKAGE = "pkb.problems"


class UnknownProblem(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; this one reads as a sentence
        return str(self.args[0])


@functools.cache
def all_problems() -> dict[str, Problem]:
    """Every problem of the suite by slug, in upstream order (problems without a number last)."""
    package = importlib.import_module(PROBLEMS_PACKAGE)
    found: dict[str, Problem] = {}
    for info in pkgutil.walk_packages(package.__path__, prefix=PROBLEMS_PACKAGE + "."):
        if info.ispkg or info.name.rsplit(".", 1)[-1].startswith("_"):
            continue
        module = importlib.import_module(info.name)
        problem = getattr(module, "PROBLEM", None)
        if problem is None:
            continue
        if not isinstance(problem, Problem):
            raise ProblemError(f"{info.name}: PROBLEM must be a pkb.problem.Problem, got {type(problem).__name__}")
        for name in ("make_inputs", "reference", "cost"):
            if getattr(module, name, None) is not getattr(problem, name):
                raise ProblemError(f"{info.name}: PROBLEM.{name} must be the module's own `{name}` function")
        if problem.name in found:
            raise ProblemError(f"{info.name}: slug {problem.name!r} is already used by {found[problem.name].module}")
        object.__setattr__(problem, "module", info.name)
        found[problem.name] = problem
    upstream = [p.upstream_id for p in found.values() if p.upstream_id is not None]
    duplicates = sorted({u for u in upstream if upstream.count(u) > 1})
    if duplicates:
        raise ProblemError(f"upstream numbers used twice: {duplicates}")
    ordered = sorted(found.values(), key=lambda p: (p.upstream_id is None, p.upstream_id or 0, p.name))
    return {p.name: p for p in ordered}


def get_problem(key: str | int) -> Problem:
    """A problem by slug (``"allreduce"``) or upstream number (``1`` or ``"1"``)."""
    problems = all_problems()
    text = str(key).strip()
    if text in problems:
        return problems[text]
    if text.isdigit():
        for problem in problems.values():
            if problem.upstream_id == int(text):
                return problem
    raise UnknownProblem(
        f"unknown problem {text!r}; known problems: "
        + ", ".join(f"{p.upstream_id or '-'}:{p.name}" for p in problems.values())
        + " (run `pkb list`)"
    )


def select(selection: str | Iterable[str] | None) -> list[Problem]:
    """Problems named by a selection such as ``"1-8,12,allgather_gemm"`` or a category name.

    ``None`` or ``"all"`` selects the whole suite; ``"upstream"`` the problems of the upstream benchmark
    (the paper's 87, without pkb's own). Order follows the suite; duplicates collapse.
    """
    problems = all_problems()
    if selection is None:
        return list(problems.values())
    parts = selection.split(",") if isinstance(selection, str) else list(selection)
    chosen: set[str] = set()
    for part in (p.strip() for p in parts):
        if not part:
            continue
        if part == "all":
            chosen.update(problems)
        elif part == "upstream":
            chosen.update(name for name, p in problems.items() if p.upstream_id is not None)
        elif part in {p.category for p in problems.values()}:
            chosen.update(p.name for p in problems.values() if p.category == part)
        elif "-" in part and all(s.strip().isdigit() for s in part.split("-", 1)):
            low, high = (int(s) for s in part.split("-", 1))
            matched = [p.name for p in problems.values() if p.upstream_id is not None and low <= p.upstream_id <= high]
            if not matched:
                raise UnknownProblem(f"no problem has an upstream number in {part}")
            chosen.update(matched)
        else:
            chosen.add(get_problem(part).name)
    return [p for name, p in problems.items() if name in chosen]
