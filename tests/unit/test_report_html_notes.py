"""The HTML report's headline says which sets ran without the full sandbox, read back from the rendered page
(no Chromium: the page is parsed as it is written)."""

from __future__ import annotations

from html.parser import HTMLParser

from pkb.report import html as report_html
from helpers.reports import ALPHA_SANDBOX_NOTE, SANDBOX_ROWS, build, write_db


class SandboxNotes(HTMLParser):
    """The headline's sandbox notes: (section id, data attributes, text) of each ``p.note.sandbox``."""

    def __init__(self):
        super().__init__()
        self.notes: list[tuple[str | None, dict, str]] = []
        self._section: str | None = None
        self._note: tuple | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self._section = attrs.get("id")
        if tag == "p" and "sandbox" in (attrs.get("class") or "").split():
            self._note = (self._section, {k: v for k, v in attrs.items() if k.startswith("data-")}, [])

    def handle_endtag(self, tag):
        if tag == "p" and self._note:
            section, data, text = self._note
            self.notes.append((section, data, "".join(text)))
            self._note = None

    def handle_data(self, data):
        if self._note:
            self._note[2].append(data)


def test_the_html_headline_says_which_sets_ran_without_the_full_sandbox(tmp_path):
    parsed = SandboxNotes()
    parsed.feed(report_html.render(build(write_db(tmp_path / "r.sqlite", SANDBOX_ROWS))))
    assert parsed.notes == [("headline", {"data-group": "alpha", "data-without-full": "3", "data-results": "5",
                                          "data-off": "1", "data-partial": "1", "data-unrecorded": "1"},
                             ALPHA_SANDBOX_NOTE)]

    full_only = [row for row in SANDBOX_ROWS if row.solution_set == "beta"]
    parsed = SandboxNotes()
    parsed.feed(report_html.render(build(write_db(tmp_path / "full.sqlite", full_only))))
    assert parsed.notes == []


def test_a_partial_set_is_plotted_over_the_categories_it_ran_and_told_how_to_report_only_those(tmp_path):
    """Issue 49: with a set of two collectives the per-category table and plot were rows of zeros; they now show
    the categories with results, and a note gives the ``--problems`` that reports only what was run."""
    from helpers.reports import make_result
    from pkb.options import Status

    rows = [make_result("allreduce", "few/allreduce", Status.OK, upstream_ok=True),
            make_result("allgather", "few/allgather", Status.MISMATCH, upstream_ok=True)]
    page = report_html.render(build(write_db(tmp_path / "few.sqlite", rows)))
    assert "To report only what was run: <code>pkb report --problems 1-2 --html FILE</code>" in page
    assert "categories without a result are left out of the plots and tables" in page
    table = page[page.index('<section id="categories"'):page.index('<section id="strict"')]
    assert "<td>collectives</td>" in table and "<td>data_parallel</td>" not in table


def test_a_cpu_timed_results_roofline_share_is_marked_as_its_speedup_is(tmp_path):
    """A new user's walk (issue 54): the problems table marked a cpu-timed speedup `(cpu)` but showed its share of the
    roofline bare, as if it were a GPU's."""
    import re

    from helpers.reports import make_result
    from pkb.options import Status

    rows = [make_result("allreduce", "mine/allreduce", Status.OK, 1.5, 0.24, upstream_ok=True, mode="cpu"),
            make_result("allgather", "mine/allgather", Status.OK, 2.0, 0.5, upstream_ok=True, mode="cuda")]
    page = report_html.render(build(write_db(tmp_path / "cpu.sqlite", rows)))
    marked = '<span class="note" title="not GPU performance">(cpu)</span>'
    assert re.search(r"<td class=num>24\.0% " + re.escape(marked) + "</td>", page)
    assert re.search(r"<td class=num>1\.50x " + re.escape(marked) + "</td>", page)
    assert "<td class=num>50.0%</td>" in page and "<td class=num>2.00x</td>" in page
