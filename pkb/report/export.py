"""Tables out of pkb: a report's tables as CSV, JSON or parquet, and ``pkb export-suite``.

Report tables (``table_text``, ``write_parquet_table``): a list of rows (dicts) with fixed columns; the
headline and metrics table (``pkb report --table metrics``), the comparison of two sets
(``--compare``) and the result rows (``--table rows``) all go through them, so the three formats hold
the same table. JSON is a list of objects; CSV leaves a missing value empty; parquet types columns as
the caller says (int, float, bool, else string).

``pkb export-suite``: the problem suite as a dataset that Hugging Face ``datasets`` loads.

Layout (one split, ``train``)::

    DIR/README.md                             dataset card; its YAML header names the data files
    DIR/data/train-00000-of-00001.parquet     one row per problem (or .jsonl with --format jsonl)

Columns: ``slug``, ``version``, ``upstream_id``, ``category``, ``source``, ``argument_names``,
``world_sizes``, ``reference_source`` (the whole problem module: reference, inputs, cost),
``tests`` and ``benchmarks`` (JSON text: a list of ``{"name", "params", "world_sizes", "note"}``).
``datasets.load_dataset("DIR")`` reads it back.
"""

from __future__ import annotations

import csv
import inspect
import io
import json
import sys
from pathlib import Path

from pkb import __version__
from pkb.problem import Case, Problem

FORMATS = ("parquet", "jsonl")
TABLE_FORMATS = ("csv", "json", "parquet")


def table_text(rows: list[dict], columns, file_format: str) -> str:
    """``rows`` as CSV (a header, then one line per row) or JSON (a list of objects), in ``columns`` order."""
    if file_format == "json":
        return json.dumps([{c: row.get(c) for c in columns} for row in rows], indent=1, default=str) + "\n"
    if file_format != "csv":
        raise ValueError(f"table_text writes csv or json, not {file_format!r}")
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(columns), lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def write_parquet_table(rows: list[dict], columns, types: dict[str, type], path: str | Path) -> None:
    """``rows`` as a parquet file; ``types`` maps a column to int, float or bool (other columns are strings)."""

    pa, pq = require_pyarrow()
    arrow = {int: pa.int64(), float: pa.float64(), bool: pa.bool_()}
    schema = pa.schema([(c, arrow.get(types.get(c), pa.string())) for c in columns])
    pq.write_table(pa.Table.from_pylist([{c: row.get(c) for c in columns} for row in rows], schema=schema), str(path))
COLUMNS = ("slug", "version", "upstream_id", "category", "source", "argument_names", "world_sizes",
           "reference_source", "tests", "benchmarks")


def suite_rows(problems: list[Problem]) -> list[dict]:
    return [{"slug": p.name, "version": p.version, "upstream_id": p.upstream_id, "category": p.category,
             "source": p.source, "argument_names": list(p.argument_names), "world_sizes": list(p.world_sizes),
             "reference_source": inspect.getsource(sys.modules[p.reference.__module__]),
             "tests": _cases_json(p.tests), "benchmarks": _cases_json(p.benchmarks)} for p in problems]


def _cases_json(cases: tuple[Case, ...]) -> str:
    return json.dumps([{"name": c.name, "params": dict(c.params),
                        "world_sizes": None if c.world_sizes is None else list(c.world_sizes), "note": c.note}
                       for c in cases], default=str)


def export_suite(directory: str | Path, file_format: str = "parquet", problems: list[Problem] | None = None) -> Path:
    """Write the suite under ``directory``; returns the data file's path."""
    if file_format not in FORMATS:
        raise ValueError(f"unknown format {file_format!r}; use one of {', '.join(FORMATS)}")
    if problems is None:
        from pkb.registry import all_problems

        problems = list(all_problems().values())
    directory = Path(directory)
    data_dir = directory / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    for stale in data_dir.glob("train-*"):  # a former export in the other format would be loaded too
        stale.unlink()
    path = data_dir / f"train-00000-of-00001.{file_format}"
    rows = suite_rows(problems)
    if file_format == "parquet":
        _write_parquet(rows, path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    (directory / "README.md").write_text(dataset_card(problems, file_format), encoding="utf-8")
    return path


def _write_parquet(rows: list[dict], path: Path) -> None:

    pa, pq = require_pyarrow()
    schema = pa.schema([("slug", pa.string()), ("version", pa.int64()), ("upstream_id", pa.int64()),
                        ("category", pa.string()), ("source", pa.string()),
                        ("argument_names", pa.list_(pa.string())), ("world_sizes", pa.list_(pa.int64())),
                        ("reference_source", pa.string()), ("tests", pa.string()), ("benchmarks", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), str(path))


def dataset_card(problems: list[Problem], file_format: str) -> str:
    categories: dict[str, int] = {}
    for problem in problems:
        categories[problem.category] = categories.get(problem.category, 0) + 1
    by_category = "\n".join(f"| {name} | {count} |" for name, count in categories.items())
    return f"""---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*.{file_format}
license: apache-2.0
pretty_name: pkb multi-GPU kernel problems
tags:
- code
- gpu
- distributed
- benchmark
size_categories:
- n<1K
---

# pkb problem suite

{len(problems)} distributed workloads (ParallelKernelBench), exported by pkb {__version__}. Each
problem is a plain PyTorch + `torch.distributed` reference run on every rank; a candidate replaces it
with its own kernels and must produce the same outputs on every rank.

| category | problems |
|---|---|
{by_category}

## Columns

- `slug`, `version` (bumped when the reference, inputs or cost change), `upstream_id` (the
  ParallelKernelBench number, empty for pkb's own problems), `category`, `source` (the upstream code
  it comes from)
- `argument_names`: the reference's (and a solution's) argument list; `world_sizes`: the ranks it runs at
- `reference_source`: the problem module: `reference`, `make_inputs`, `cost` and `PROBLEM`
- `tests`, `benchmarks`: JSON lists of cases `{{"name", "params", "world_sizes", "note"}}`; tests are
  small awkward correctness cases, benchmarks real model shapes used for timing

Load it with `datasets.load_dataset("<this directory>")`. Run and judge candidates with pkb
(`pkb eval <slug> solution.py`).
"""


def require_pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("parquet output needs pyarrow: pip install 'pkb[report]' (or pip install pyarrow)") from None
    return pa, pq
