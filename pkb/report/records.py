"""Result rows as report records: each stored result with the group it counts for, its sample and its code.

A *group* is what a report compares: a model, or a set of solution files. ``group_by`` picks it:

- ``model``: the ``model`` of the ``generations`` rows that link to the result (``result_id``); a result
  that several generations link to (the same file twice) counts once per generation; results that no
  generation links to fall back to ``set``.
- ``set``: the solution set. A solution named ``dir/stem`` belongs to ``dir``; otherwise the name minus
  the problem's own prefix (``1_allreduce_cuda_peer`` -> ``cuda_peer``), and ``solutions`` when nothing
  is left (``allreduce.py``).
- ``solution``: every solution name is its own group.
- ``auto``: ``model`` when a generation links to any of the results read, else ``set``. (The table itself
  may exist in every database; what matters is whether it links to results.)

One row per sample counts: a sample is the generation's run and sample number when one is linked,
else the solution name. Of several rows of a sample the latest counts (a rerun replaces the earlier
result); of an agent's steps (generations with a ``step``) the best counts, as the agent keeps the
best file: correct first, then the fastest, then the latest. Reference self-checks are
kept as records (for the per-problem pages) and marked ``is_reference``; metrics leave them out.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from pkb.evaluate.result import EvalResult
from pkb.problem import Status

GROUP_KEYS = ("auto", "model", "set", "solution")
REFERENCE = "reference"
UNKNOWN_CATEGORY = "unknown"

_UPSTREAM_PREFIX = re.compile(r"^\d+_")
# generations columns read when present (the table belongs to pkb.generate; only model and result_id are needed)
_OPTIONAL_GENERATION_COLUMNS = ("run", "sample", "step", "code", "code_path")


class ReportError(RuntimeError):
    """The database cannot be reported on; the message says what to do."""


@dataclass(frozen=True)
class Filter:
    """Which stored rows a report reads. ``None`` keeps everything."""

    problems: frozenset[str] | None = None
    mode: str | None = None
    world_size: int | None = None

    def keeps(self, result: EvalResult) -> bool:
        return ((self.problems is None or result.problem in self.problems)
                and (self.mode is None or result.mode == self.mode)
                and (self.world_size is None or result.world_size == self.world_size))


@dataclass(frozen=True)
class Code:
    """A candidate's source as the report shows it, or why it cannot: ``text is None`` means unavailable."""

    text: str | None
    origin: str  # where the text came from, or why there is none


@dataclass(frozen=True)
class Record:
    key: str  # unique per record: the result id, plus the generation id when one links to it
    result_id: int
    group: str
    sample: str
    category: str
    result: EvalResult
    code: Code
    step: int | None = None  # an agent's step, when a generation with a step links to the result

    @property
    def problem(self) -> str:
        return self.result.problem

    @property
    def status(self) -> Status:
        return self.result.status

    @property
    def is_reference(self) -> bool:
        return self.result.solution == REFERENCE


@dataclass(frozen=True)
class Generation:
    id: int
    model: str
    run: str | None
    sample: str | None
    step: int | None
    code: str | None
    path: str | None


@dataclass(frozen=True)
class Loaded:
    records: tuple[Record, ...]  # the latest row of each sample, reference self-checks included
    rows: tuple[Record, ...]  # every row the filter keeps, in id order (csv / parquet exports)
    group_by: str  # the key actually used (``auto`` resolved)
    notes: tuple[str, ...]  # what the reader should know (fallbacks, unlinked generations)


def load(path: str | Path, group_by: str = "auto", row_filter: Filter = Filter(),
         categories: dict[str, str] | None = None) -> Loaded:
    """Read a results database into records. ``categories`` maps problem slug -> category (default: the registry)."""
    if group_by not in GROUP_KEYS:
        raise ReportError(f"unknown group key {group_by!r}; use one of {', '.join(GROUP_KEYS)}")
    path = Path(path)
    if not path.is_file():
        raise ReportError(f"no results database at {path}: run `pkb run` first, or point --db at one")
    if categories is None:
        categories = registry_categories()
    from pkb.store.db import ResultStore, StoreError

    try:
        store = ResultStore(path)  # checks the schema version (and migrates an older database)
    except (StoreError, sqlite3.DatabaseError) as exc:
        raise ReportError(f"cannot read {path}: {exc}") from None
    with store:
        generations, notes = _generations(store.conn)
        results = [(result_id, EvalResult.from_dict(json.loads(text)))
                   for result_id, text in store.conn.execute("SELECT id, result_json FROM results ORDER BY id")]
    results = [(result_id, result) for result_id, result in results if row_filter.keeps(result)]
    linked = any(result_id in generations for result_id, _ in results)
    resolved = ("model" if linked else "set") if group_by == "auto" else group_by
    if resolved == "model" and not linked:
        notes.append("no generation links to these results: grouped by solution set instead of model")
    rows = [record for result_id, result in results
            for record in _records(result_id, result, generations.get(result_id, []), resolved, categories)]
    return Loaded(records=one_per_sample(rows), rows=tuple(rows), group_by=resolved, notes=tuple(notes))


def one_per_sample(rows: list[Record]) -> tuple[Record, ...]:
    """The record that counts for each sample (see the module docstring); ``rows`` in id order."""
    chosen: dict[tuple[str, str, str], Record] = {}
    for record in rows:
        sample = (record.group, record.problem, record.sample)
        previous = chosen.get(sample)
        if previous is None or previous.step is None or record.step is None or record.step == previous.step \
                or _step_rank(record) >= _step_rank(previous):
            chosen[sample] = record
    return tuple(sorted(chosen.values(), key=lambda r: (r.result_id, r.key)))


def _step_rank(record: Record) -> tuple:
    return (record.status is Status.OK, record.result.speedup or 0.0)


def registry_categories() -> dict[str, str]:
    from pkb.registry import all_problems

    return {name: problem.category for name, problem in all_problems().items()}


def solution_set(solution: str, problem: str, upstream_id: int | None = None) -> str:
    """The solution set a solution name belongs to (see the module docstring)."""
    if "/" in solution:
        return solution.rsplit("/", 1)[0]
    rest = solution
    if upstream_id is not None and rest.startswith(f"{upstream_id}_"):
        rest = rest[len(f"{upstream_id}_"):]
    else:
        rest = _UPSTREAM_PREFIX.sub("", rest)
    if rest == problem:
        rest = ""
    elif rest.startswith(problem + "_"):
        rest = rest[len(problem) + 1:]
    return rest or "solutions"


def _records(result_id: int, result: EvalResult, generations: list[Generation], group_by: str,
             categories: dict[str, str]) -> list[Record]:
    """One record per generation that links to the result (one record when none does)."""
    category = categories.get(result.problem, UNKNOWN_CATEGORY)
    if result.solution == REFERENCE:
        return [Record(str(result_id), result_id, REFERENCE, REFERENCE, category, result,
                       Code(None, "the problem's reference (`pkb show` prints it)"))]
    if group_by == "solution":
        group = result.solution
    else:
        group = solution_set(result.solution, result.problem)
    if group_by != "model" or not generations:
        return [Record(str(result_id), result_id, group, result.solution, category, result, _code(result, None))]
    return [Record(f"{result_id}-{g.id}", result_id, g.model, f"{g.run or 'run'} sample {g.sample}", category,
                   result, _code(result, g), g.step) for g in generations]


def _code(result: EvalResult, generation: Generation | None) -> Code:
    if generation is not None and generation.code:
        return Code(generation.code, "the generations table")
    stored_path = (generation.path if generation is not None else None) or result.details.get("solution_path") \
        or getattr(result, "solution_path", None)
    if not stored_path:
        return Code(None, "unavailable: the result row records no path to the solution file "
                          "(pkb run stores the name and sha256 only)")
    path = Path(stored_path)
    if not path.is_file():
        return Code(None, f"unavailable: {path} no longer exists")
    text = path.read_text(encoding="utf-8", errors="replace")
    if hashlib.sha256(text.encode()).hexdigest() != result.solution_sha256:
        return Code(None, f"unavailable: {path} changed since it was evaluated (sha256 differs)")
    return Code(text, str(path))


def _generations(conn: sqlite3.Connection) -> tuple[dict[int, list[Generation]], list[str]]:
    """Generations by the id of the result they link to; empty when the database has none."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='generations'").fetchone() is None:
        return {}, []
    columns = [row[1] for row in conn.execute("PRAGMA table_info(generations)")]
    if "model" not in columns or "result_id" not in columns:
        return {}, [f"the generations table has no model or result_id column (has {columns}): "
                    "results are grouped by solution set"]
    optional = ", ".join(c if c in columns else "NULL" for c in _OPTIONAL_GENERATION_COLUMNS)
    found: dict[int, list[Generation]] = {}
    query = f"SELECT id, model, result_id, {optional} FROM generations WHERE result_id IS NOT NULL ORDER BY id"
    for gen_id, model, result_id, run, sample, step, code, path in conn.execute(query):
        found.setdefault(int(result_id), []).append(Generation(
            id=gen_id, model=str(model), run=None if run is None else str(run),
            sample=None if sample is None else str(sample), step=None if step is None else int(step),
            code=code, path=path))
    return found, []
