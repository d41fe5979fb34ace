"""Many evaluations in one go (``pkb run``): which candidates, in what order, stored as they finish.

A run pairs problems with candidates: each problem's reference against itself (a self-check of the
suite and the harness) and every solution file found for it, either in a directory the user names
or in pkb's shipped solutions. Results go to the database one by one; a rerun with the same
settings skips what is already there, so an interrupted run resumes and loses nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.evaluator import EvalConfig, Session, evaluate
from pkb.evaluate.result import EvalResult
from pkb.problem import Problem, Status
from pkb.registry import all_problems
from pkb.store.db import ResultStore, run_key

SHIPPED_SOLUTIONS = Path(__file__).parent / "solutions"
_UPSTREAM_NAME = re.compile(r"^(\d+)_")


@dataclass(frozen=True)
class Job:
    problem: Problem
    candidate: Candidate


def problem_for_file(path: Path, problems: dict[str, Problem]) -> Problem | None:
    """The problem a solution file is for: ``<slug>.py``, ``<slug>_<anything>.py`` or ``<number>_<name>[_<backend>].py``."""
    stem = path.stem
    match = _UPSTREAM_NAME.match(stem)
    if match:
        number = int(match.group(1))
        return next((p for p in problems.values() if p.upstream_id == number), None)
    for slug in sorted(problems, key=len, reverse=True):  # longest first: allgather_gemm before allgather
        if stem == slug or stem.startswith(slug + "_"):
            return problems[slug]
    return None


def solution_files(directory: Path) -> dict[str, list[Path]]:
    """Solution files under ``directory`` by problem slug; files that name no problem are reported."""
    problems = all_problems()
    found: dict[str, list[Path]] = {}
    unknown = []
    for path in sorted(directory.glob("*.py")):
        if path.name.startswith("_"):
            continue
        problem = problem_for_file(path, problems)
        if problem is None:
            unknown.append(path.name)
        else:
            found.setdefault(problem.name, []).append(path)
    if unknown:
        found["__unknown__"] = [directory / name for name in unknown]
    return found


def plan(problems: Iterable[Problem], solutions_dir: Path | None, include_reference: bool) -> list[Job]:
    files = solution_files(solutions_dir or SHIPPED_SOLUTIONS)
    jobs = []
    for problem in problems:
        if include_reference:
            jobs.append(Job(problem, Candidate.reference_of(problem)))
        for path in files.get(problem.name, []):
            jobs.append(Job(problem, Candidate.from_file(path)))
    return jobs


def evaluation_key(problem: Problem, candidate: Candidate, config: EvalConfig) -> str:
    """The store's key for evaluating ``candidate`` on ``problem`` with ``config`` (equal keys: same job)."""
    timing = ("perf+graph" if config.cuda_graph else "perf") if config.perf else ""
    cases = "" if config.cases == "all" else f"|cases={config.cases}"
    return run_key(problem.name, problem.version, candidate.sha256, config.mode.value, config.world_size,
                   config.num_trials, f"{timing}|{config.policy}{cases}")


def run_jobs(jobs: list[Job], config: EvalConfig, store: ResultStore,
             on_result: Callable[[Job, EvalResult, bool], None] = lambda job, result, resumed: None) -> list[EvalResult]:
    """Evaluate every job not already in ``store``; ``on_result(job, result, resumed)`` after each."""
    results = []
    with Session(config.mode, config.world_size) as session:
        for job in jobs:
            key = evaluation_key(job.problem, job.candidate, config)
            previous = store.latest(key)
            if previous is not None and previous.status is not Status.HARNESS_ERROR:  # pkb's failures are retried
                results.append(previous)
                on_result(job, previous, True)
                continue
            result = evaluate(job.problem, job.candidate, config, session)
            store.add(result, key)
            results.append(result)
            on_result(job, result, False)
    return results
