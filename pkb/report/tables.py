"""Tables of a report: the leaderboard and per-category rows (terminal, HTML), and the result rows
(``--format csv|parquet``). Formatting of a number lives here once, so the terminal and the HTML agree.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from pkb.report.metrics import Metrics, Report
from pkb.report.records import Record

LEADERBOARD_COLUMNS = ("group", "problems", "attempted", "pass@1", "fast_1", "fast_2", "geomean_speedup",
                       "median_roofline", "moves_data_itself", "failures")
CATEGORY_COLUMNS = ("group", "category", "problems", "attempted", "pass@1", "fast_1", "geomean_speedup")

# The result rows' columns, in order, for csv and parquet (JSON-valued columns hold JSON text).
RESULT_COLUMNS = ("result_id", "group", "sample", "problem", "category", "problem_version", "solution",
                  "solution_sha256", "status", "message", "mode", "world_size", "num_trials", "speedup",
                  "roofline_fraction", "busbw_gbps", "times_are_gpu_performance", "collectives_used", "hardware",
                  "pkb_version", "schema_version", "created_at", "wall_s", "timings", "details")
_JSON_COLUMNS = ("collectives_used", "timings", "details")


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def leaderboard_rows(report: Report) -> list[dict[str, str]]:
    return [{"group": group, **_metric_cells(m), "median_roofline": percent(m.roofline.quantiles.get("median")),
             "moves_data_itself": percent(m.moves_data_itself),
             "failures": ", ".join(f"{n} {s}" for s, n in m.failures.items()) or "-"}
            for group, m in report.overall.items()]


def category_rows(report: Report) -> list[dict[str, str]]:
    return [{"group": group, "category": category, **_metric_cells(m)}
            for group, by_category in report.by_category.items() for category, m in by_category.items()]


def _metric_cells(m: Metrics) -> dict[str, str]:
    fast_1 = m.fast_p.get(1, {})
    return {"problems": str(m.denominator), "attempted": str(m.num_attempted), "pass@1": percent(m.pass_at_k.get(1)),
            "fast_1": percent(fast_1.get(1.0)), "fast_2": percent(fast_1.get(2.0)),
            "geomean_speedup": times(m.geomean_speedup)}


def result_rows(records: tuple[Record, ...]) -> list[dict]:
    rows = []
    for record in records:
        values = record.result.to_dict()
        row = {"result_id": record.result_id, "group": record.group, "sample": record.sample,
               "category": record.category, **{c: values.get(c) for c in RESULT_COLUMNS if c in values}}
        for column in _JSON_COLUMNS:
            row[column] = json.dumps(row[column], default=str)
        rows.append({c: row.get(c) for c in RESULT_COLUMNS})
    return rows


def to_csv(records: tuple[Record, ...]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=RESULT_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(result_rows(records))
    return out.getvalue()


def write_parquet(records: tuple[Record, ...], path: str | Path) -> None:
    pa, pq = require_pyarrow()
    rows = result_rows(records)
    table = pa.Table.from_pylist(rows, schema=_result_schema(pa))
    pq.write_table(table, str(path))


def _result_schema(pa):
    types = {"result_id": pa.int64(), "problem_version": pa.int64(), "world_size": pa.int64(),
             "num_trials": pa.int64(), "schema_version": pa.int64(), "speedup": pa.float64(),
             "roofline_fraction": pa.float64(), "busbw_gbps": pa.float64(), "created_at": pa.float64(),
             "wall_s": pa.float64(), "times_are_gpu_performance": pa.bool_()}
    return pa.schema([(c, types.get(c, pa.string())) for c in RESULT_COLUMNS])


def require_pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("parquet output needs pyarrow: pip install 'pkb[report]' (or pip install pyarrow)") from None
    return pa, pq
