"""Discovery of the problem suite: every module under ``pkb/problems/`` that defines ``PROBLEM``.

No dispatch table: adding a problem is adding a module. Lookup is by slug or upstream number, and
a selection string (``"1-8,12,allgather_gemm"``) picks several.
"""

from __future__ import annotations

import difflib
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
    raise UnknownProblem(f"unknown problem {text!r}; {closest_names(text)}")


def closest_names(text: str) -> str:
    """The end of a sentence naming the problems closest to ``text`` (a slug misspelt, or a word of one), e.g.
    ``did you mean 2 allgather or 12 allgather_gemm? `pkb list` shows all 95 (give a slug or an upstream number)``."""
    problems = all_problems()
    word = text.lower().replace("-", "_")
    close = difflib.get_close_matches(word, problems, n=4, cutoff=0.6)
    close += [name for name in problems if word and word in name and name not in close][:4 - len(close)]
    named = [f"{p.upstream_id} {p.name}" if p.upstream_id else p.name for p in map(problems.get, close)]
    suggestion = f"did you mean {', '.join(named[:-1])}{' or ' if len(named) > 1 else ''}{named[-1]}? " if named else ""
    return f"{suggestion}`pkb list` shows all {len(problems)} (give a slug or an upstream number)"


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


def selection_text(names: Iterable[str]) -> str:
    """The selection ``select`` reads back as exactly the problems ``names`` (slugs): upstream numbers as ranges,
    then the slugs of problems without one, e.g. ``1-8,12,hierarchical_allreduce``."""
    problems = all_problems()
    names = set(names)
    numbers = sorted(problems[name].upstream_id for name in names if problems[name].upstream_id)
    ranges: list[tuple[int, int]] = []
    for number in numbers:
        if ranges and ranges[-1][1] == number - 1:
            ranges[-1] = (ranges[-1][0], number)
        else:
            ranges.append((number, number))
    parts = [str(low) if low == high else f"{low}-{high}" for low, high in ranges]
    return ",".join(parts + sorted(name for name in names if not problems[name].upstream_id))
