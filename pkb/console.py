"""What every ``pkb`` command shares at the console: the usage error it raises and the table it prints.

At the bottom of the layers (tests/unit/test_layers.py), so that every command (pkb.cli's and the subsystems':
report, measure, generate, serve) and the executors can use them.
"""

from __future__ import annotations

import sys


class UsageError(Exception):
    """A command was called wrongly; the message says what to do instead (exit status 2)."""


def print_table(rows: list[dict], columns: list[str], headers: list[str] | None = None) -> None:
    """``rows`` under ``headers``: drawn by rich on a terminal, plain aligned text anywhere else (a file,
    a pipe, CI: the same bytes whichever rich version is installed)."""
    headers = headers or columns
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    if sys.stdout.isatty() and rich_available():
        _print_rich_table(cells, headers)
        return
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


def rich_available() -> bool:
    """Whether rich is installed (an offline node where setup could not install it gets plain text)."""
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def _print_rich_table(cells: list[list[str]], headers: list[str]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(*headers, box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False)
    for row in cells:
        table.add_row(*row)
    Console(highlight=False, markup=False).print(table)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)
