"""Discovery of the problem suite: every module under ``pkb/problems/`` that defines ``PROBLEM``.

No dispatch table: adding a problem is adding a module. Lookup is by slug or upstream number, and
a selection string (``"1-8,12,allgather_gemm"``) picks several.

The names are known before anything is imported: ``problem_names`` reads each module's
``PROBLEM = Problem(name=..., upstream_id=..., category=...)`` from its source, so that a command checks the
problems it is given (and suggests the closest names) in a fraction of a second, without torch; importing this
module imports no torch either. ``all_problems`` imports the modules and checks that they are exactly the
problems their source declares, so the two cannot disagree.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from pkb.problem import Problem

PROBLEMS_PACKAGE = "pkb.problems"
PROBLEMS_DIR = Path(__file__).resolve().parent / "problems"
DECLARED = ("name", "upstream_id", "category")  # what PROBLEM = Problem(...) gives as literals, read unimported


class UnknownProblem(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; this one reads as a sentence
        return str(self.args[0])


@dataclass(frozen=True)
class ProblemName:
    """A problem as its module's source declares it: its slug, upstream number (None: one of pkb's own),
    category and module, e.g. ``ProblemName("allreduce", 1, "collectives", "pkb.problems.collectives.allreduce")``."""

    name: str
    upstream_id: int | None
    category: str
    module: str


@functools.cache
def problem_names() -> dict[str, ProblemName]:
    """Every problem of the suite by slug, in upstream order (problems without a number last), read from the
    source of the modules under pkb/problems/ without importing them (no torch; importing them takes seconds)."""
    found = [declared for path in sorted(PROBLEMS_DIR.rglob("*.py")) if not path.name.startswith("_")
             for declared in [_declared(path)] if declared is not None]
    return {entry.name: entry for entry in sorted(found, key=_suite_order)}


def _declared(path: Path) -> ProblemName | None:
    """What the module at ``path`` declares in ``PROBLEM = Problem(...)``; None where it assigns no PROBLEM (a
    helper) or does not give ``DECLARED`` as literals (``all_problems`` then says what to write)."""
    module = ".".join((PROBLEMS_PACKAGE, *path.relative_to(PROBLEMS_DIR).with_suffix("").parts))
    for node in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and any(isinstance(target, ast.Name) and target.id == "PROBLEM" for target in node.targets):
            keywords = {keyword.arg: keyword.value for keyword in node.value.keywords}
            try:
                return ProblemName(*(ast.literal_eval(keywords[name]) for name in DECLARED), module)
            except (KeyError, ValueError, TypeError):
                return None
    return None


def _suite_order(problem) -> tuple:
    return problem.upstream_id is None, problem.upstream_id or 0, problem.name


@functools.cache
def all_problems() -> dict[str, Problem]:
    """Every problem of the suite by slug, in upstream order (problems without a number last)."""
    from pkb.problem import Problem, ProblemError

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
    undeclared = _not_as_declared(found.values())
    if undeclared:
        raise ProblemError(f"{', '.join(undeclared)}: write PROBLEM = Problem({', '.join(f'{n}=...' for n in DECLARED)}"
                           ", ...) with literal values (pkb reads them from the source, without importing the module: "
                           "pkb.registry.problem_names)")
    return {p.name: p for p in sorted(found.values(), key=_suite_order)}


def _not_as_declared(problems: Iterable[Problem]) -> list[str]:
    """The modules whose imported problem is not what ``problem_names`` read from their source."""
    def entries(found) -> set[ProblemName]:
        return {ProblemName(p.name, p.upstream_id, p.category, p.module) for p in found}

    return sorted({entry.module for entry in entries(problems) ^ entries(problem_names().values())})


def get_problem(key: str | int) -> Problem:
    """A problem by slug (``"allreduce"``) or upstream number (``1`` or ``"1"``)."""
    return all_problems()[problem_name(key)]


def problem_name(key: str | int) -> str:
    """The slug of the problem ``key`` names (a slug, or an upstream number: ``1`` or ``"1"``), without importing
    the suite; UnknownProblem, naming the closest problems, where it names none."""
    names = problem_names()
    text = str(key).strip()
    if text in names:
        return text
    if text.isdigit():
        for entry in names.values():
            if entry.upstream_id == int(text):
                return entry.name
    raise UnknownProblem(f"unknown problem {text!r}; {closest_names(text)}")


def closest_names(text: str) -> str:
    """The end of a sentence naming the problems closest to ``text`` (a slug misspelt, or a word of one), e.g.
    ``did you mean 2 allgather or 12 allgather_gemm? `pkb list` shows all 95 (give a slug or an upstream number)``."""
    names = problem_names()
    word = text.lower().replace("-", "_")
    close = difflib.get_close_matches(word, names, n=4, cutoff=0.6)
    close += [name for name in names if word and word in name and name not in close][:4 - len(close)]
    named = [f"{e.upstream_id} {e.name}" if e.upstream_id else e.name for e in map(names.get, close)]
    suggestion = f"did you mean {', '.join(named[:-1])}{' or ' if len(named) > 1 else ''}{named[-1]}? " if named else ""
    return f"{suggestion}`pkb list` shows all {len(names)} (give a slug or an upstream number)"


def select(selection: str | Iterable[str] | None) -> list[Problem]:
    """Problems named by a selection such as ``"1-8,12,allgather_gemm"`` or a category name (``selected_names``)."""
    problems = all_problems()
    return [problems[name] for name in selected_names(selection)]


def selected_names(selection: str | Iterable[str] | None) -> list[str]:
    """The slugs a selection such as ``"1-8,12,allgather_gemm"`` or a category name picks, without importing the
    suite; UnknownProblem, naming the closest problems, for a part that names none.

    ``None`` or ``"all"`` selects the whole suite; ``"upstream"`` the problems of the upstream benchmark
    (the paper's 87, without pkb's own). Order follows the suite; duplicates collapse.
    """
    names = problem_names()
    if selection is None:
        return list(names)
    parts = selection.split(",") if isinstance(selection, str) else list(selection)
    chosen: set[str] = set()
    for part in (p.strip() for p in parts):
        if not part:
            continue
        if part == "all":
            chosen.update(names)
        elif part == "upstream":
            chosen.update(name for name, e in names.items() if e.upstream_id is not None)
        elif part in {e.category for e in names.values()}:
            chosen.update(name for name, e in names.items() if e.category == part)
        elif "-" in part and all(s.strip().isdigit() for s in part.split("-", 1)):
            low, high = (int(s) for s in part.split("-", 1))
            matched = [name for name, e in names.items() if e.upstream_id is not None and low <= e.upstream_id <= high]
            if not matched:
                raise UnknownProblem(f"no problem has an upstream number in {part}")
            chosen.update(matched)
        else:
            chosen.add(problem_name(part))
    return [name for name in names if name in chosen]


def selection_text(names: Iterable[str]) -> str:
    """The selection ``select`` reads back as exactly the problems ``names`` (slugs): upstream numbers as ranges,
    then the slugs of problems without one, e.g. ``1-8,12,hierarchical_allreduce``."""
    problems = problem_names()
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
