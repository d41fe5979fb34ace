"""The results database: SQLite, one row per evaluation, with a schema version and migrations.

Each row keeps the columns reports filter on (problem, solution, status, speedup, ...) and the whole
EvalResult as JSON (details, per-case timings). Rows are committed as they arrive, so an interrupted
``pkb run`` loses nothing, and ``run_key`` lets a rerun skip what is already done.

Migrations: ``MIGRATIONS[i]`` takes a database from schema version i to i + 1 (``PRAGMA user_version``):
SQL text, or a function of the connection where old rows need Python to fill a new column. A database
written by a newer pkb is refused with a message rather than misread.

Solution sets: every result row names the set it belongs to (``solution_set``), which is what reports
compare: the folder given to ``pkb run --solutions`` (its name, or ``--set``), a generation run of
``pkb generate`` / ``pkb agent`` (``generated_set``), pkb's shipped solutions (``SHIPPED_SET``) or a
reference's self-check (``REFERENCE_SET``).

Experiments: every result row names the experiment it belongs to (``experiment``; pkb.options: a user's
``--experiment``, else ``default``, ``served`` for the service's traffic, ``rl`` for the RL environments'), and a
report reads one experiment, or compares several, never another's rows unasked.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sqlite3
import time
from pathlib import Path
from typing import Callable, Iterator

from pkb import __version__
from pkb.console import UsageError
from pkb.evaluate.result import SCHEMA_VERSION, EvalResult
from pkb.options import DEFAULT_EXPERIMENT, RL_EXPERIMENT, SERVED_EXPERIMENT, SERVED_SET

DEFAULT_DB = "pkb-results.sqlite"

SHIPPED_SET = "pkb shipped"  # pkb/solutions
REFERENCE_SET = "reference"  # a problem's reference checked against itself
UNNAMED_SET = "unnamed"  # a row from before sets whose folder is unknown (see _name_solution_sets)
SHIPPED_SOLUTIONS = Path(__file__).resolve().parent.parent / "solutions"


def generated_set(model: str, run: str) -> str:
    """The set of a generation run: the run's name, led by the model unless the name already says it.

    ``generated_set("openai:gpt-5", "openai-gpt-5-cuda") == "openai-gpt-5-cuda"`` (pkb's default run
    names start with the model); ``generated_set("openai:gpt-5", "trial") == "openai:gpt-5/trial"``.
    """
    safe_model = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-")
    return run if model in run or (safe_model and safe_model in run) else f"{model}/{run}"


def _name_solution_sets(conn: sqlite3.Connection) -> None:
    """2 -> 3: ``solution_set`` and ``upstream_ok`` columns, filled in for the rows already there.

    An old row's set: ``reference`` for a self-check; the generation run that links to it; ``pkb shipped``
    when its hash is that of a file in pkb/solutions today; the folder of a ``dir/stem`` name; else
    ``unnamed`` (a ``pkb run --solutions`` row, whose folder was not recorded). ``upstream_ok`` comes
    from the stored result where it was recorded, else NULL (unknown).
    """
    conn.execute("ALTER TABLE results ADD COLUMN solution_set TEXT NOT NULL DEFAULT ''")
    conn.execute("ALTER TABLE results ADD COLUMN upstream_ok INTEGER")
    conn.execute("CREATE INDEX results_set ON results (solution_set, problem)")
    rows = conn.execute("SELECT id, solution, solution_sha256, result_json FROM results").fetchall()
    if not rows:
        return
    runs = {result_id: generated_set(model, run) for result_id, model, run in conn.execute(
        "SELECT result_id, model, run FROM generations WHERE result_id IS NOT NULL ORDER BY id DESC")}
    shipped = {hashlib.sha256(path.read_text(encoding="utf-8").encode()).hexdigest()
               for path in SHIPPED_SOLUTIONS.glob("*.py")}
    for result_id, solution, sha256, text in rows:
        row = json.loads(text)
        if solution == REFERENCE_SET:
            name = REFERENCE_SET
        elif result_id in runs:
            name = runs[result_id]
        elif sha256 in shipped:
            name = SHIPPED_SET
        elif "/" in solution:
            name = solution.rsplit("/", 1)[0]
        else:
            name = UNNAMED_SET
        row["solution_set"] = name
        upstream_ok = row.get("upstream_ok")
        conn.execute("UPDATE results SET solution_set = ?, upstream_ok = ?, result_json = ? WHERE id = ?",
                     (name, None if upstream_ok is None else int(bool(upstream_ok)), json.dumps(row), result_id))


RL_SET = "rl"  # the solution set pkb's RL environments stored their turns under before experiments


def _name_experiments(conn: sqlite3.Connection) -> None:
    """6 -> 7: the ``experiment`` column, filled in for the rows already there from their origin: the service's
    requests (set ``served``) are ``served``, the RL environments' turns (set ``rl``) are ``rl``, every other row
    (``pkb run``, ``generate``, ``agent``) is ``default``. The stored result says the same."""
    conn.execute(f"ALTER TABLE results ADD COLUMN experiment TEXT NOT NULL DEFAULT '{DEFAULT_EXPERIMENT}'")
    conn.execute("CREATE INDEX results_experiment ON results (experiment, solution_set)")
    origins = {SERVED_SET: SERVED_EXPERIMENT, RL_SET: RL_EXPERIMENT}
    for result_id, solution_set, text in conn.execute("SELECT id, solution_set, result_json FROM results").fetchall():
        row = json.loads(text)
        row["experiment"] = origins.get(solution_set, DEFAULT_EXPERIMENT)
        conn.execute("UPDATE results SET experiment = ?, result_json = ? WHERE id = ?",
                     (row["experiment"], json.dumps(row), result_id))


MIGRATIONS: list[str | Callable[[sqlite3.Connection], None]] = [
    # 0 -> 1: the results table
    """
    CREATE TABLE results (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        run_key TEXT NOT NULL,
        problem TEXT NOT NULL,
        problem_version INTEGER NOT NULL,
        solution TEXT NOT NULL,
        solution_sha256 TEXT NOT NULL,
        status TEXT NOT NULL,
        message TEXT NOT NULL,
        mode TEXT NOT NULL,
        world_size INTEGER NOT NULL,
        num_trials INTEGER NOT NULL,
        speedup REAL,
        roofline_fraction REAL,
        busbw_gbps REAL,
        times_are_gpu_performance INTEGER NOT NULL,
        collectives_used TEXT NOT NULL,
        hardware TEXT NOT NULL,
        pkb_version TEXT NOT NULL,
        schema_version INTEGER NOT NULL,
        created_at REAL NOT NULL,
        wall_s REAL NOT NULL,
        result_json TEXT NOT NULL
    );
    CREATE INDEX results_run_key ON results (run_key);
    CREATE INDEX results_problem ON results (problem, solution);
    """,
    # 1 -> 2: model generations (pkb generate / pkb agent): one row per model call, linked to its verdict
    """
    CREATE TABLE generations (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        run TEXT NOT NULL,
        kind TEXT NOT NULL,
        model TEXT NOT NULL,
        provider TEXT NOT NULL,
        problem TEXT NOT NULL,
        problem_version INTEGER NOT NULL,
        sample INTEGER NOT NULL,
        step INTEGER NOT NULL,
        backend TEXT NOT NULL,
        hardware TEXT NOT NULL,
        world_size INTEGER NOT NULL,
        case_name TEXT NOT NULL,
        temperature REAL,
        max_tokens INTEGER NOT NULL,
        system TEXT NOT NULL,
        prompt TEXT NOT NULL,
        response TEXT,
        status TEXT NOT NULL,
        code TEXT,
        code_path TEXT,
        code_sha256 TEXT,
        tokens_in INTEGER,
        tokens_out INTEGER,
        cost_usd REAL,
        latency_s REAL,
        attempts INTEGER NOT NULL,
        error TEXT,
        result_id INTEGER REFERENCES results (id),
        run_key TEXT,
        speedup REAL,
        pkb_version TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE INDEX generations_sample ON generations (run, problem, sample, step);
    """,
    # 2 -> 3: the solution set each result belongs to, and its verdict on the upstream cases alone
    _name_solution_sets,
    # 3 -> 4: whose prompt a generation was asked with: pkb's own, or the upstream benchmark's
    "ALTER TABLE generations ADD COLUMN prompt_kind TEXT NOT NULL DEFAULT 'pkb';",
    # 4 -> 5: the run's precision (--dtype); every earlier run was bf16, the paper's
    """
    ALTER TABLE results ADD COLUMN precision TEXT NOT NULL DEFAULT 'bf16';
    ALTER TABLE generations ADD COLUMN precision TEXT NOT NULL DEFAULT 'bf16';
    """,
    # 5 -> 6: the nodes the ranks were split into (--nodes); every earlier run was on one
    "ALTER TABLE results ADD COLUMN nodes INTEGER NOT NULL DEFAULT 1;",
    # 6 -> 7: the experiment each result belongs to, named from its origin for the rows already there
    _name_experiments,
]
assert len(MIGRATIONS) == SCHEMA_VERSION, "every schema version needs its migration"

_GENERATION_COLUMNS = frozenset((
    "run", "kind", "model", "provider", "problem", "problem_version", "sample", "step", "backend", "hardware",
    "world_size", "case_name", "temperature", "max_tokens", "system", "prompt", "response", "status", "code", "code_path",
    "code_sha256", "tokens_in", "tokens_out", "cost_usd", "latency_s", "attempts", "error", "result_id", "run_key",
    "speedup", "pkb_version", "created_at", "prompt_kind", "precision"))

_COLUMNS = ("problem", "problem_version", "solution", "solution_sha256", "status", "message", "mode",
            "world_size", "num_trials", "speedup", "roofline_fraction", "busbw_gbps",
            "times_are_gpu_performance", "hardware", "pkb_version", "schema_version", "created_at", "wall_s",
            "solution_set", "upstream_ok", "precision", "nodes", "experiment")


class StoreError(RuntimeError):
    pass


class StoreUnavailable(StoreError, UsageError):
    """The results database cannot be opened or written where it was asked for (a directory, a file that is not
    one, a folder pkb cannot write): the message says what to give instead. A usage error (exit status 2; a
    service refuses to start), raised before anything is written."""


# The verdicts' rules, in the key: a row judged by other rules is never restored as this pkb's verdict (2: pkb's
# verdict judges accuracy against the exact answer, the paper's runs on upstream's own values; they no longer nest).
VERDICT_RULES = 2


def run_key(problem: str, problem_version: int, solution_sha256: str, mode: str, world_size: int,
            num_trials: int, timing: str) -> str:
    """What makes two evaluations the same job (a rerun with the same key is skipped).

    ``timing``: "" without timing, else what was timed and how (e.g. "perf", "perf+graph").
    """
    text = f"{problem}|{problem_version}|{solution_sha256}|{mode}|{world_size}|{num_trials}|{timing}|{VERDICT_RULES}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


SQLITE_MAGIC = b"SQLite format 3\x00"


def unreadable_store(path: str | Path, first: str = "`pkb run`") -> str | None:
    """Why a command that reads results finds none at ``path`` (a directory, or nothing there: run ``first`` first),
    in one sentence; None where a file is there."""
    path = Path(path)
    if path.is_dir():
        return f"{path} is a directory: give the results database's file, e.g. --db {path / DEFAULT_DB}"
    if not path.is_file():
        return f"no results database at {path}: run {first} first, or point --db at one"
    return None


def check_store(path: str | Path) -> None:
    """StoreUnavailable, saying what to give instead, where ``path`` cannot hold pkb's results: a directory, a
    path under a file, a folder or file pkb cannot write, a file that is not SQLite, another program's SQLite
    database. Reads only the file's 100-byte header: writes nothing (a command checks its --db before any work)."""
    path = Path(path)
    if path.is_dir():
        raise StoreUnavailable(unreadable_store(path))
    blocked = next((folder for folder in reversed(path.parents) if folder.exists() and not folder.is_dir()), None)
    if blocked is not None:
        raise StoreUnavailable(f"{blocked} is a file, so {path} cannot be made in it: give a --db in a folder")
    folder = next(folder for folder in path.absolute().parents if folder.exists())  # the nearest that exists
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise StoreUnavailable(f"cannot write {path} (its folder or the file is read-only): give a --db in a "
                               "folder you can write")
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb") as file:
        header = file.read(100)
    if not header.startswith(SQLITE_MAGIC) or len(header) < 100:
        raise StoreUnavailable(f"{path} is not a pkb results database (not SQLite): give another --db")
    pages, user_version = int.from_bytes(header[28:32], "big"), int.from_bytes(header[60:64], "big")
    if user_version == 0 and pages > 1:  # tables of its own, none of pkb's schema versions
        raise StoreUnavailable(f"{path} is a SQLite database of something else (not pkb's results): give another --db")


class ResultStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        check_store(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(str(self.path))
        self.conn.execute("PRAGMA journal_mode=WAL")
        self._migrate()

    def _migrate(self) -> None:
        version = self.conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.path} has schema version {version}, newer than this pkb's {SCHEMA_VERSION}: "
                             "upgrade pkb or use another --db")
        for target in range(version, SCHEMA_VERSION):
            migration = MIGRATIONS[target]
            if isinstance(migration, str):
                with self.conn:
                    self.conn.executescript(migration)
                    self.conn.execute(f"PRAGMA user_version = {target + 1}")
            else:
                # one transaction, DDL included: a failed migration leaves the database as it was
                self.conn.execute("BEGIN")
                try:
                    migration(self.conn)
                    self.conn.execute(f"PRAGMA user_version = {target + 1}")
                except BaseException:
                    self.conn.rollback()
                    raise
                self.conn.commit()

    @property
    def schema_version(self) -> int:
        return self.conn.execute("PRAGMA user_version").fetchone()[0]

    def add(self, result: EvalResult, key: str) -> int:
        """Store ``result`` under run key ``key`` (an unnamed experiment filed as ``default``); its row id."""
        row = {**result.to_dict(), "experiment": result.experiment or DEFAULT_EXPERIMENT}
        values = [row[c] for c in _COLUMNS]
        values = [None if isinstance(v, float) and not math.isfinite(v) else v for v in values]
        with self.conn:
            cursor = self.conn.execute(
                f"INSERT INTO results (run_key, {', '.join(_COLUMNS)}, collectives_used, result_json) "
                f"VALUES ({', '.join('?' * (len(_COLUMNS) + 3))})",
                [key, *values, json.dumps(row["collectives_used"]), json.dumps(row, default=str)],
            )
        return cursor.lastrowid

    def has(self, key: str) -> bool:
        return self.conn.execute("SELECT 1 FROM results WHERE run_key = ? LIMIT 1", (key,)).fetchone() is not None

    def results(self, problem: str | None = None) -> Iterator[EvalResult]:
        query, args = "SELECT result_json FROM results", ()
        if problem:
            query, args = query + " WHERE problem = ?", (problem,)
        for (text,) in self.conn.execute(query + " ORDER BY id", args):
            yield EvalResult.from_dict(json.loads(text))


    # -- generations (pkb.generate): one row per model call, its verdict filled in once evaluated ------

    def add_generation(self, row: dict) -> int:
        """Insert a generation row (keys: the ``generations`` columns except ``id``); returns its id."""
        row = {"pkb_version": __version__, "created_at": time.time(), **row}
        columns = [c for c in row if c in _GENERATION_COLUMNS]
        with self.conn:
            cursor = self.conn.execute(f"INSERT INTO generations ({', '.join(columns)}) VALUES "
                                       f"({', '.join('?' * len(columns))})", [row[c] for c in columns])
        return cursor.lastrowid

    def set_generation_verdict(self, generation_id: int, status: str, result_id: int | None, key: str | None,
                               speedup: float | None) -> None:
        """Record the evaluation of a generation's file (the only update a generation row receives)."""
        speedup = speedup if speedup is None or math.isfinite(speedup) else None
        with self.conn:
            self.conn.execute("UPDATE generations SET status = ?, result_id = ?, run_key = ?, speedup = ? WHERE id = ?",
                              (status, result_id, key, speedup, generation_id))

    def generations(self, run: str | None = None, problem: str | None = None) -> list[dict]:
        """Generation rows as dicts, oldest first, optionally of one run and one problem."""
        clauses, args = [], []
        for column, value in (("run", run), ("problem", problem)):
            if value is not None:
                clauses.append(f"{column} = ?")
                args.append(value)
        query = "SELECT * FROM generations" + (" WHERE " + " AND ".join(clauses) if clauses else "") + " ORDER BY id"
        cursor = self.conn.execute(query, args)
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, values)) for values in cursor]

    def result_by_id(self, result_id: int) -> EvalResult | None:
        row = self.conn.execute("SELECT result_json FROM results WHERE id = ?", (result_id,)).fetchone()
        return EvalResult.from_dict(json.loads(row[0])) if row else None

    def latest_id(self, key: str, solution_set: str | None = None, solution: str | None = None,
                  experiment: str | None = None) -> int | None:
        """The newest row stored under ``key`` (and under that set, solution name and experiment, where given)."""
        query, args = "SELECT id FROM results WHERE run_key = ?", [key]
        for column, value in (("solution_set", solution_set), ("solution", solution), ("experiment", experiment)):
            if value is not None:
                query, args = query + f" AND {column} = ?", args + [value]
        row = self.conn.execute(query + " ORDER BY id DESC LIMIT 1", args).fetchone()
        return row[0] if row else None

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
