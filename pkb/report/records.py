"""Result rows as report records: each stored result with the group it counts for, its sample, its
verdict on both protocols and its code.

A *group* is what a report compares. ``group_by`` picks it:

- ``set`` (the default): the solution set the result row names (pkb.store.db): the folder given to
  ``pkb run --solutions`` (or ``--set``), ``pkb shipped``, or, for a result that generations link to
  (``result_id``), the generation run (``generated_set(model, run)``), once per linked generation.
- ``model``: the ``model`` of the generations that link to the result; results that no generation links
  to fall back to their set.
- ``solution``: every solution name is its own group.

Groups never come from a file name's suffix. A result in another precision than the paper's bf16
(``--dtype``) counts for its group with the precision added, ``my-set [fp32]``: a set's fp32 and bf16
results are never pooled.

Experiments: a report reads the rows of the experiments it is asked for (``Filter.experiments``; ``pkb report``:
``default`` unless ``--experiment`` names others), never service or RL traffic unasked. Compared side by side
(several experiments), a group is named with its experiment first, ``sweep-1: my-set``.

Two verdicts per record (``Record.verdict(protocol)``), independent of each other: ``pkb`` is the stored status
(pkb's cases on secret inputs, judged against the exact answer); ``paper`` is the paper's protocol on the upstream
cases (upstream's inputs and rule: ``paper_status``), ``None`` when the row cannot tell (the upstream cases were
not checked). Either may pass where the other fails.

One row per sample counts: a sample is the generation's run and sample number when one is linked,
else the solution name. Of several rows of a sample the latest counts (a rerun replaces the earlier
result); of an agent's steps (generations with a ``step``) the best counts, as the agent keeps the
best file: correct first, then the fastest, then the latest. Intermediate turns are never samples: an
agent's steps are one sample, and in an RL experiment (``rl``, ``rl:NAME``) a result's sample is its rollout
(``rollout``: its name without the last ``/<turn>``, as pkb's RL environments name each judged turn
``<sample>/<epoch or trace>/<turn>``), of which the last judged turn counts: the one its reward was computed
from. Reference self-checks are kept as records (the headline's self-check, the per-problem pages) and marked
``is_reference``; metrics leave them out.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from dataclasses import dataclass, replace
from pathlib import Path

from pkb.evaluate.result import EvalResult
from pkb.options import DEFAULT_EXPERIMENT, Status, is_rl_experiment, traffic_kind
from pkb.problem import DEFAULT_PRECISION
from pkb.store.db import REFERENCE_SET, UNNAMED_SET, ResultStore, StoreError, generated_set, unreadable_store

GROUP_KEYS = ("set", "model", "solution")
PROTOCOLS = ("paper", "pkb")  # paper: correct on the upstream cases (upstream_ok); pkb: correct on every case
REFERENCE = REFERENCE_SET
UNKNOWN_CATEGORY = "unknown"
SANDBOX_GAPS = ("off", "partial", "unrecorded")  # sandbox_gap: how a row's candidate ran short of the full sandbox

# verdicts reached before any input was run: the file fails on any inputs, so on the paper's protocol too
_FAILS_ON_ANY_INPUTS = (Status.COMPILE_ERROR, Status.IMPORT_ERROR, Status.SIGNATURE_ERROR)
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
    precision: str | None = None
    experiments: tuple[str, ...] | None = (DEFAULT_EXPERIMENT,)  # None: every experiment's rows

    def keeps(self, result: EvalResult) -> bool:
        return ((self.problems is None or result.problem in self.problems)
                and (self.mode is None or result.mode == self.mode)
                and (self.world_size is None or result.world_size == self.world_size)
                and (self.precision is None or result.precision == self.precision)
                and (self.experiments is None or (result.experiment or DEFAULT_EXPERIMENT) in self.experiments))

    @property
    def compares_experiments(self) -> bool:
        """Several experiments side by side: each group is named with its experiment."""
        return self.experiments is None or len(self.experiments) > 1


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
    paper_status: Status | None = None  # the verdict on the upstream cases alone; None: unknown
    beyond_upstream: bool = False  # its problem has no upstream case (pkb's own): the paper's protocol has no say
    run: str | None = None  # the generation run whose model call the result judged (pkb.report.transcripts)

    @property
    def problem(self) -> str:
        return self.result.problem

    @property
    def status(self) -> Status:
        return self.result.status

    def verdict(self, protocol: str) -> Status | None:
        """The verdict under ``protocol`` (``PROTOCOLS``): pkb's, the stored status; the paper's, ``paper_status``
        (None when the row cannot tell). The two are independent: neither implies the other."""
        return self.paper_status if protocol == "paper" else self.result.status

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
    group_by: str  # set, model or solution
    notes: tuple[str, ...]  # what the reader should know (fallbacks, unlinked generations)
    held: tuple[str, ...] = ()  # every experiment the database holds results of, the latest first


def load(path: str | Path, group_by: str = "set", row_filter: Filter = Filter(),
         categories: dict[str, str] | None = None, upstream_cases: dict[str, frozenset[str]] | None = None) -> Loaded:
    """Read a results database into records. ``categories`` maps problem slug -> category and
    ``upstream_cases`` slug -> the names of its upstream cases (both default to the registry's)."""
    if group_by not in GROUP_KEYS:
        raise ReportError(f"unknown group key {group_by!r}; use one of {', '.join(GROUP_KEYS)}")
    path = Path(path)
    unreadable = unreadable_store(path)
    if unreadable:
        raise ReportError(unreadable)
    if categories is None:
        categories = registry_categories()
    if upstream_cases is None:
        upstream_cases = registry_upstream_cases()
    try:
        store = ResultStore(path)  # checks the schema version (and migrates an older database)
    except (StoreError, sqlite3.DatabaseError) as exc:
        raise ReportError(f"cannot read {path}: {exc}") from None
    with store:
        generations, notes = _generations(store.conn)
        stored = [(result_id, json.loads(text))
                  for result_id, text in store.conn.execute("SELECT id, result_json FROM results ORDER BY id")]
        held = dict(store.conn.execute("SELECT experiment, COUNT(*) FROM results GROUP BY experiment ORDER BY "
                                       "MAX(id) DESC"))
    results = [(result_id, EvalResult.from_dict(row), "upstream_ok" in row) for result_id, row in stored]
    results = [item for item in results if row_filter.keeps(item[1])]
    if group_by == "model" and not any(result_id in generations for result_id, _, _ in results):
        notes.append("no generation links to these results: grouped by solution set instead of model")
    notes += experiments_note(row_filter.experiments, held)
    rows = [record for result_id, result, recorded in results
            for record in _records(result_id, result, generations.get(result_id, []), group_by, categories,
                                   paper_status(result, upstream_cases.get(result.problem), recorded),
                                   upstream_cases.get(result.problem) == frozenset(), row_filter.compares_experiments)]
    return Loaded(records=one_per_sample(rows), rows=tuple(rows), group_by=group_by, notes=tuple(notes),
                  held=tuple(held))


def experiments_note(shown: tuple[str, ...] | None, held: dict[str, int]) -> list[str]:
    """A note naming the experiments a database ``held`` (experiment -> results, the latest first) that a report of
    ``shown`` leaves out, e.g. ``experiment default; also in this database: sweep (40 results), served (12 results,
    service traffic): `pkb report --experiment NAME` reports one, a comma list compares them``; none when none is
    left out."""
    if shown is None:
        return []
    others = {name: count for name, count in held.items() if name not in shown}
    if not others:
        return []
    listed = ", ".join(_held_text(name, count) for name, count in others.items())
    return [f"experiment {', '.join(shown)}; also in this database: {listed}: `pkb report --experiment NAME` "
            "reports one, a comma list compares them"]


def _held_text(experiment: str, count: int) -> str:
    """e.g. ``sweep (40 results)``, ``served (1 result, service traffic)``."""
    kind = traffic_kind(experiment)
    return f"{experiment} ({count} result{'s' * (count != 1)}" + (f", {kind})" if kind else ")")


def rollout(solution: str) -> str:
    """The rollout an RL turn's result belongs to: its name without the last ``/<turn>`` (pkb's RL environments
    name each judged turn ``<sample>/<epoch or trace>/<turn>``), e.g. ``rollout("allreduce/1/2") ==
    "allreduce/1"``; a name without a ``/`` is its own."""
    return solution.rsplit("/", 1)[0] if "/" in solution else solution


def from_results(results: list[EvalResult], categories: dict[str, str] | None = None,
                 upstream_cases: dict[str, frozenset[str]] | None = None) -> tuple[Record, ...]:
    """Records of results not read from a database (``pkb run``'s own), grouped by their set; the
    latest of each sample counts, as in ``load``."""
    categories = registry_categories() if categories is None else categories
    upstream_cases = registry_upstream_cases() if upstream_cases is None else upstream_cases
    rows = [record for index, result in enumerate(results, 1)
            for record in _records(index, result, [], "set", categories,
                                   paper_status(result, upstream_cases.get(result.problem), True),
                                   upstream_cases.get(result.problem) == frozenset())]
    return one_per_sample(rows)


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


def paper_status(result: EvalResult, upstream_cases: frozenset[str] | None, recorded: bool = True) -> Status | None:
    """The verdict on the upstream cases alone (the paper's protocol), or None when the row cannot tell.

    ``upstream_ok`` decides where the evaluator set it: True is ``ok`` whatever pkb's verdict said; False is what
    the first failing upstream trial earned (``details.upstream["failed"]["status"]``; a row that failed before
    any trial keeps its status, and ``mismatch`` stands in where neither says). Where it is None: ``skipped``,
    ``harness_error`` and ``infra_error``
    stay what they are; a file that failed before any input ran (compile, import, signature) fails on
    the paper's inputs too, and so does any other failure of a row that ``recorded`` upstream_ok and
    had upstream cases among its ``cases`` (it stopped before the first upstream trial finished).
    Otherwise (an ``ok`` row whose run left the upstream cases out, a row from before upstream_ok was
    recorded) it is unknown. ``upstream_cases``: the problem's upstream case names (None: unknown problem).
    """
    if result.upstream_ok is True:
        return Status.OK
    if result.upstream_ok is False:
        failed = (result.details.upstream or {}).get("failed") or {}
        if failed.get("status") in Status._value2member_map_:
            return Status(failed["status"])
        return result.status if result.status is not Status.OK else Status.MISMATCH
    if result.status in (Status.SKIPPED, *_FAILS_ON_ANY_INPUTS) or not result.status.is_verdict:
        return result.status
    if result.status is not Status.OK and recorded and upstream_cases and set(result.cases) & upstream_cases:
        return result.status
    return None


def sandbox_gap(result: EvalResult) -> str | None:
    """How far short of the full sandbox the candidate of ``result`` ran (one of ``SANDBOX_GAPS``), from the
    row's ``details.sandbox``: ``off`` (``--sandbox off``: unconfined), ``partial`` (its machine lacked
    a protection), ``unrecorded`` (a row from a pkb before the sandbox); None under the full sandbox."""
    sandbox = result.details.sandbox
    if not isinstance(sandbox, dict):
        return "unrecorded"
    if sandbox.get("level") == "off":
        return "off"
    return None if sandbox.get("full") else "partial"


def registry_categories() -> dict[str, str]:
    from pkb.registry import all_problems

    return {name: problem.category for name, problem in all_problems().items()}


def registry_case_tags() -> dict[str, dict[str, tuple[str, ...]]]:
    """slug -> case name -> the tags of each tests case (pkb.problem.CASE_TAGS)."""
    from pkb.registry import all_problems

    return {name: {case.name: case.tags for case in problem.tests} for name, problem in all_problems().items()}


def registry_upstream_cases() -> dict[str, frozenset[str]]:
    from pkb.registry import all_problems

    return {name: frozenset(case.name for case in problem.upstream) for name, problem in all_problems().items()}


def _records(result_id: int, result: EvalResult, generations: list[Generation], group_by: str,
             categories: dict[str, str], paper: Status | None, beyond_upstream: bool = False,
             named_by_experiment: bool = False) -> list[Record]:
    """One record per generation that links to the result (one record when none does, or by solution); its group
    led by the result's experiment where several are compared (``named_by_experiment``)."""
    records = [replace(record, beyond_upstream=beyond_upstream)
               for record in _records_in_groups(result_id, result, generations, group_by, categories, paper)]
    if result.precision != DEFAULT_PRECISION:
        records = [replace(record, group=f"{record.group} [{result.precision}]") for record in records]
    if named_by_experiment:
        experiment = result.experiment or DEFAULT_EXPERIMENT
        records = [record if record.is_reference else replace(record, group=f"{experiment}: {record.group}")
                   for record in records]
    return records


def _records_in_groups(result_id: int, result: EvalResult, generations: list[Generation], group_by: str,
                       categories: dict[str, str], paper: Status | None) -> list[Record]:
    category = categories.get(result.problem, UNKNOWN_CATEGORY)
    if result.solution == REFERENCE:
        return [Record(str(result_id), result_id, REFERENCE, REFERENCE, category, result,
                       Code(None, "the problem's reference (`pkb show` prints it)"), paper_status=paper)]

    def own(group: str) -> Record:  # the result as a sample of a group of its own (no generation's)
        sample = rollout(result.solution) if is_rl_experiment(result.experiment) else result.solution
        return Record(str(result_id), result_id, group, sample, category, result, _code(result, None),
                      paper_status=paper)

    if group_by == "solution" or not generations:
        return [own(result.solution if group_by == "solution" else (result.solution_set or UNNAMED_SET))]
    records = [Record(f"{result_id}-{g.id}", result_id,
                      g.model if group_by == "model" else generated_set(g.model, g.run or ""),
                      f"{g.run or 'run'} sample {g.sample}", category, result, _code(result, g), g.step, paper,
                      run=g.run)
               for g in generations]
    own_set = result.solution_set
    if group_by != "model" and own_set and own_set not in {record.group for record in records}:
        # a result stored under a set of its own (`pkb run --solutions`) that a generation later reused (a replay of
        # the same file, judged the same way): it still belongs to that set too
        records.append(own(own_set))
    return records


def _code(result: EvalResult, generation: Generation | None) -> Code:
    if generation is not None and generation.code:
        return Code(generation.code, "the generations table")
    stored_path = (generation.path if generation is not None else None) or result.details.solution_path \
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
