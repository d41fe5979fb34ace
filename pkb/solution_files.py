"""Which problem each solution file is for, and the evaluations of a run (``pkb run``'s planning).

A run pairs problems with candidates: each problem's reference against itself (a self-check of the
suite and the harness) and every solution file found for it, either in a directory the user names
or in pkb's shipped solutions. Every result names its solution set (pkb.store.db): the folder's name
(or the name given with ``--set``), ``pkb shipped`` or ``reference``. The evaluations run through
pkb.loop.EvaluationLoop.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.cases import checked_cases
from pkb.executor import Evaluation
from pkb.options import DEFAULT_EXPERIMENT
from pkb.problem import Problem
from pkb.registry import all_problems
from pkb.store.db import REFERENCE_SET, SHIPPED_SET, SHIPPED_SOLUTIONS

_UPSTREAM_NAME = re.compile(r"^(\d+)_")


# Upstream's earlier revision, in which model solutions were published before it renumbered and renamed
# its problems: one problem was inserted (old 33), one dropped (old 47, fsdp_adamw_sharded), one added
# (today's 46, gemv_decode), so old 34-46 are today's 33-45 and old 48-88 today's 47-87, under the same
# names; four were renamed in place. A renamed problem's old name can be another problem's name today
# (old 12 gemm_allgather is today's 12 allgather_gemm, while today's 14 is gemm_allgather), so a file's
# number and name are read together against this table: (old number, old name) -> today's slug, or None
# where the problem no longer exists upstream.
EARLIER_REVISION: dict[tuple[int, str], str | None] = {
    (11, "gemm_allgather_at"): "allgather_gemm_at",
    (12, "gemm_allgather"): "allgather_gemm",
    (14, "gemm_allscatter"): "gemm_allgather",
    (18, "rms_norm"): "tp_rms_norm",
    (47, "fsdp_adamw_sharded"): None,
}
DROPPED = {old_name for (_, old_name), slug in EARLIER_REVISION.items() if slug is None}  # numbered or not


@dataclass(frozen=True)
class FileMatch:
    """Which problem a solution file is for, and how that was decided (for the user to see)."""

    problem: Problem | None
    how: str


def match_file(path: Path, problems: dict[str, Problem]) -> FileMatch:
    """The problem a solution file is for: ``<slug>[_<anything>].py`` or ``<n>_<name>[_<backend>].py``.

    Number and name together first, against upstream's earlier revision (``EARLIER_REVISION``); then by
    name (case-insensitive, the longest name that the file's starts with: today's slugs, and the old
    names no problem has today); a bare number (``12.py``, ``12_cuda.py``) by number. A name that matches
    nothing is reported, never guessed from its number.
    """
    stem = path.stem
    number_match = _UPSTREAM_NAME.match(stem)
    number = int(number_match.group(1)) if number_match else None
    name = (stem[number_match.end():] if number_match else stem).lower()

    def names(candidate: str) -> bool:
        return name == candidate or name.startswith(candidate + "_")

    for (old_number, old_name), slug in sorted(EARLIER_REVISION.items(), key=lambda item: -len(item[0][1])):
        if number == old_number and names(old_name):
            if slug is None:
                return FileMatch(None, f"{old_number} {old_name} was dropped from the upstream benchmark")
            problem = problems[slug]
            return FileMatch(problem, f"by number and name in upstream's earlier revision ({old_number} {old_name}; "
                                      f"now {problem.upstream_id} {slug})")
    old_only = {old_name: slug for (_, old_name), slug in EARLIER_REVISION.items() if old_name not in problems}
    for known in sorted([*problems, *old_only], key=len, reverse=True):  # longest first: gemm_allgather_at first
        if not names(known):
            continue
        if known in DROPPED:
            return FileMatch(None, f"{known} was dropped from the upstream benchmark")
        if known in old_only:
            problem = problems[old_only[known]]
            return FileMatch(problem, f"by its name in upstream's earlier revision ({known}; now "
                                      f"{problem.upstream_id} {problem.name})")
        problem = problems[known]
        if number is not None and number != problem.upstream_id:
            return FileMatch(problem, f"by name (its number {number} is from an earlier upstream revision; "
                                      f"now {problem.upstream_id})")
        was = [old_number for (old_number, old_name), slug in EARLIER_REVISION.items() if old_name == known and slug != known]
        if number is None and was:  # today's name of one problem, the old name of another: the number decides
            return FileMatch(problem, f"by name ({known} was problem {was[0]}'s name in upstream's earlier revision: "
                                      f"name a file written for that {was[0]}_{known}...)")
        return FileMatch(problem, "by name")
    if number is not None and name in ("", "cuda", "triton", "torch", "nccl"):
        problem = next((p for p in problems.values() if p.upstream_id == number), None)
        return FileMatch(problem, "by number" if problem else f"no problem has number {number}")
    close = difflib.get_close_matches(name, list(problems), n=3)
    return FileMatch(None, "its name matches no problem" + (f" (close: {', '.join(close)})" if close else ""))


def solution_files(directory: Path, notes: list[str] | None = None) -> dict[str, list[Path]]:
    """Solution files under ``directory`` by problem slug; files that name no problem are listed under
    ``__unknown__``. ``notes`` (if given) receives one line per file whose mapping a user should see."""
    problems = all_problems()
    found: dict[str, list[Path]] = {}
    unknown = []
    for path in sorted(directory.glob("*.py")):
        if path.name.startswith("_"):
            continue
        match = match_file(path, problems)
        if match.problem is None:
            unknown.append(path.name)
            if notes is not None:
                notes.append(f"{path.name}: not evaluated: {match.how}")
        else:
            found.setdefault(match.problem.name, []).append(path)
            if notes is not None and match.how != "by name":
                notes.append(f"{path.name} -> {match.problem.upstream_id} {match.problem.name} ({match.how})")
    if unknown:
        found["__unknown__"] = [directory / name for name in unknown]
    return found


def set_name(solutions_dir: Path | None) -> str:
    """The solution set of a ``--solutions`` folder: its name (``runs/gpt5-oneshot`` -> ``gpt5-oneshot``; a folder
    named as one of pkb's own sets, upstream's ``reference/`` say, gets ``-files`` after it: its files are candidates,
    not the references' self-check); ``pkb shipped`` for pkb's own solutions (no folder given)."""
    if solutions_dir is None:
        return SHIPPED_SET
    name = solutions_dir.resolve().name or str(solutions_dir)
    return f"{name}-files" if name in (REFERENCE_SET, SHIPPED_SET) else name


def plan(problems: Iterable[Problem], solutions_dir: Path | None, include_reference: bool,
         solution_set: str | None = None, experiment: str = DEFAULT_EXPERIMENT) -> list[Evaluation]:
    """The evaluations of a run in ``experiment`` (each with the run's settings: no ``config`` of its own);
    ``solution_set`` names the files' set (default: ``set_name(solutions_dir)``)."""
    files = solution_files(solutions_dir or SHIPPED_SOLUTIONS)
    solution_set = solution_set or set_name(solutions_dir)
    evaluations = []
    for problem in problems:
        if include_reference:
            evaluations.append(Evaluation(problem, Candidate.reference_of(problem), REFERENCE_SET,
                                          experiment=experiment))
        for path in files.get(problem.name, []):
            evaluations.append(Evaluation(problem, Candidate.from_file(path), solution_set, experiment=experiment))
    return evaluations


def light_self_checks(evaluations: list[Evaluation], config: EvalConfig, cases: bool = True,
                      trials: int | None = None) -> list[Evaluation]:
    """``evaluations`` (of a run with ``config``) with the references' self-checks made lighter for a first look:
    on their upstream cases (``cases``; a problem whose upstream cases this mode leaves out, too slow where the
    reference runs on the CPU, on its tests cases instead) and with ``trials`` trials, the upstream cases as
    deep (None: the run's)."""
    def lighter(evaluation: Evaluation) -> Evaluation:
        if not evaluation.candidate.is_reference:  # a file is never lightened, whatever its set is named
            return evaluation
        own = config
        if cases:
            upstream = checked_cases(evaluation.problem, replace(config, cases="upstream"))
            own = replace(own, cases="upstream" if upstream else "tests")
        if trials:
            own = replace(own, trials=trials, upstream_trials=trials)
        return replace(evaluation, config=own)

    return [lighter(evaluation) for evaluation in evaluations]


