"""The results database: SQLite, one row per evaluation, with a schema version and migrations.

Each row keeps the columns reports filter on (problem, solution, status, speedup, ...) and the whole
EvalResult as JSON (details, per-case timings). Rows are committed as they arrive, so an interrupted
``pkb run`` loses nothing, and ``run_key`` lets a rerun skip what is already done.

Migrations: ``MIGRATIONS[i]`` takes a database from schema version i to i + 1 (``PRAGMA user_version``).
A database written by a newer pkb is refused with a message rather than misread.
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
from pathlib import Path
from typing import Iterator

from pkb.evaluate.result import SCHEMA_VERSION, EvalResult

DEFAULT_DB = "pkb-results.sqlite"

MIGRATIONS: list[str] = [
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
]
assert len(MIGRATIONS) == SCHEMA_VERSION, "every schema version needs its migration"

_COLUMNS = ("problem", "problem_version", "solution", "solution_sha256", "status", "message", "mode",
            "world_size", "num_trials", "speedup", "roofline_fraction", "busbw_gbps",
            "times_are_gpu_performance", "hardware", "pkb_version", "schema_version", "created_at", "wall_s")


class StoreError(RuntimeError):
    pass


def run_key(problem: str, problem_version: int, solution_sha256: str, mode: str, world_size: int,
            num_trials: int, timing: str) -> str:
    """What makes two evaluations the same job (a rerun with the same key is skipped).

    ``timing``: "" without timing, else what was timed and how (e.g. "perf", "perf+graph").
    """
    text = f"{problem}|{problem_version}|{solution_sha256}|{mode}|{world_size}|{num_trials}|{timing}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class ResultStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if self.path.parent and not self.path.parent.exists():
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
            with self.conn:
                self.conn.executescript(MIGRATIONS[target])
                self.conn.execute(f"PRAGMA user_version = {target + 1}")

    @property
    def schema_version(self) -> int:
        return self.conn.execute("PRAGMA user_version").fetchone()[0]

    def add(self, result: EvalResult, key: str) -> int:
        row = result.to_dict()
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

    def latest(self, key: str) -> EvalResult | None:
        row = self.conn.execute("SELECT result_json FROM results WHERE run_key = ? ORDER BY id DESC LIMIT 1",
                                (key,)).fetchone()
        return EvalResult.from_dict(json.loads(row[0])) if row else None

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
