"""What every ``pkb`` command shares at the console: the usage error it raises and the table it prints.

Apart from ``pkb.cli`` so that the subsystems' commands (report, hardware, generate) can use them
while ``pkb.cli`` imports those subsystems: the layers stay acyclic (tests/test_layers.py).
"""

from __future__ import annotations


class UsageError(Exception):
    """A command was called wrongly; the message says what to do instead (exit status 2)."""


def print_table(rows: list[dict], columns: list[str], headers: list[str] | None = None) -> None:
    headers = headers or columns
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)
