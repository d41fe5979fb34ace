"""What every ``pkb`` command shares at the console: the usage error it raises, the table it prints, and how it
shortens text for display (``shorten``: never mid-word or mid-number, and always with a visible ellipsis).

At the bottom of the layers (tests/unit/test_layers.py), so that every command (pkb.cli's and the subsystems':
report, measure, generate, serve) and the executors can use them.
"""

from __future__ import annotations

import re
import sys

ELLIPSIS = "\u2026"
# What ``shorten`` never cuts inside: a number (``-1.5e-05``, ``1.24219``), a word (``bf16``, ``all_gather``) or a
# run of spaces; anything else (punctuation, a slash) is a token of its own.
_TOKEN = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?![\w.])|\w+|\s+|.", re.S)
_SEPARATORS = " \t\n-_/,;:=."  # left off the cut end, before the ellipsis


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


def shorten(text: str, limit: int, keep: str = "start", one_line: bool = True) -> str:
    """``text`` in at most ``limit`` characters for display, cut between two tokens (never inside a word or a number)
    and ending in an ellipsis where it was cut; whole where it fits. ``keep="end"`` keeps the tail instead (a log's
    last lines), the ellipsis first. ``one_line`` first joins its lines and runs of spaces into single spaces (a
    table cell); otherwise lines stay, and the cut falls between two lines where one is in reach. A single token
    longer than ``limit`` is the one thing cut inside. Wherever pkb shortens, the whole text is one step away (the
    JSON, the HTML row's details, ``--full``).

        >>> shorten("rank 0: expected 1.24219, got 1.5", 28)
        'rank 0: expected 1.24219…'
        >>> shorten("line one\\nline two\\nline three", 15, keep="end", one_line=False)
        '…line three'
    """
    if one_line:
        text = " ".join(text.split())
    if len(text) <= limit:
        return text
    room = max(limit - len(ELLIPSIS), 1)
    if keep == "end":
        line = text.find("\n", len(text) - room)
        cut = line + 1 if line >= 0 and text[line + 1:].strip() else _token_start_after(text, len(text) - room)
        return ELLIPSIS + text[cut:].lstrip(_SEPARATORS)
    line = text.rfind("\n", 0, room)
    cut = line if line > 0 and text[:line].strip() else _token_end_before(text, room)
    return text[:cut].rstrip(_SEPARATORS) + ELLIPSIS


def _token_end_before(text: str, room: int) -> int:
    """The end of the last whole token within ``text[:room]`` (``room`` itself where the first token is longer)."""
    cut = 0
    for token in _TOKEN.finditer(text):
        if token.end() > room:
            break
        cut = token.end()
    return cut if text[:cut].strip(_SEPARATORS) else room


def _token_start_after(text: str, start: int) -> int:
    """The start of the first whole token at or after ``start`` (``start`` itself where no token begins there)."""
    for token in _TOKEN.finditer(text):
        if token.start() >= start and text[token.start():].strip(_SEPARATORS):
            return token.start()
    return start
