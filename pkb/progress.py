"""What ``pkb run`` shows while it runs.

On a terminal (stdout and stderr both), with rich installed: a live display on stderr of a bar with
elapsed and estimated time left, the count of each verdict so far, and the evaluations in flight with
how long each has run; every result that needs a look (not ``ok``, not ``skipped``) is printed above
it as it arrives, so the scrollback keeps them. Anywhere else (a CI log, a file, ``--quiet``, no rich):
one plain line per result on stderr.
"""

from __future__ import annotations

import sys
from typing import Callable

from pkb.console import rich_available, shorten

NEEDS_NO_LOOK = ("ok", "skipped")
VERDICT_STYLES = {"ok": "green", "skipped": "dim", "mismatch": "red", "forbidden": "magenta",
                  "harness_error": "bold red", "infra_error": "bold red"}
MAX_IN_FLIGHT_SHOWN = 8


def label_of(result) -> str:
    return f"{result.problem}/{result.solution}"


class Progress:
    """``update(evaluation, result, resumed)`` after each result; ``close()`` at the end (or use ``with``).
    ``in_flight``: what runs now, as ``[(label, seconds running)]`` (an executor's ``in_flight``)."""

    def __init__(self, total: int, enabled: bool = True, live: bool | None = None,
                 in_flight: Callable[[], list[tuple[str, float]]] = list, stream=None):
        self.total, self.done, self.enabled = total, 0, enabled
        self.counts: dict[str, int] = {}
        self.in_flight = in_flight
        self.stream = stream or sys.stderr
        if live is None:  # a terminal both ways: a person watches (stdout to a file: a log is being kept)
            live = sys.stdout.isatty() and self.stream.isatty()
        self._live = _LiveDisplay(self) if enabled and live and rich_available() else None

    def update(self, evaluation, result, resumed: bool) -> None:
        self.done += 1
        status = result.status.value
        self.counts[status] = self.counts.get(status, 0) + 1
        if not self.enabled:
            return
        earlier = " (stored earlier)" if resumed else ""
        if self._live is not None:
            self._live.result(label_of(result) + earlier, status, result.message)
            return
        self.stream.write(f"[{self.done}/{self.total}] {label_of(result)}: {status}{earlier}\n")
        self.stream.flush()

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _LiveDisplay:
    """rich's live view of a ``Progress``; redrawn four times a second from rich's own thread."""

    def __init__(self, progress: Progress):
        from rich.console import Console
        from rich.live import Live
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn
        from rich.progress import TimeRemainingColumn

        self.progress = progress
        self.console = Console(file=progress.stream)
        self.bar = Bar(TextColumn("[bold]pkb run"), BarColumn(), MofNCompleteColumn(), TextColumn("elapsed"),
                       TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(), console=self.console)
        self.task = self.bar.add_task("run", total=progress.total)
        self.live = Live(self, console=self.console, refresh_per_second=4, transient=False)
        self.live.start()

    def result(self, label: str, status: str, message: str) -> None:
        self.bar.advance(self.task)
        if status not in NEEDS_NO_LOOK:
            style = VERDICT_STYLES.get(status, "yellow")
            self.console.print(f"[{style}]{status}[/]  {_escape(label)}  [dim]{_escape(shorten(message, 120))}[/]")

    def __rich__(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        counts = Text("  ")
        for status, n in sorted(self.progress.counts.copy().items(), key=lambda item: -item[1]):
            counts.append(f"{n} {status}", style=VERDICT_STYLES.get(status, "yellow")).append("   ")
        running = sorted(self.progress.in_flight(), key=lambda item: -item[1])
        table = Table(box=None, show_header=False, padding=(0, 1), pad_edge=False)
        for label, seconds in running[:MAX_IN_FLIGHT_SHOWN]:
            table.add_row("  [cyan]running[/]", _escape(label), f"{seconds:.1f} s")
        if len(running) > MAX_IN_FLIGHT_SHOWN:
            table.add_row("", f"[dim]and {len(running) - MAX_IN_FLIGHT_SHOWN} more[/]", "")
        return Group(self.bar, counts, table)

    def stop(self) -> None:
        self.live.stop()


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
