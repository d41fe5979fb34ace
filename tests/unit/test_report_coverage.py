"""Sets that cover part of the selection, and the HTML's plots: the metrics exist on the problems a set covers
and on the whole selection (the paper's denominator: a problem without a result counts as failed); the headline
(``pkb run``'s and the HTML's) is one row per set, with what it covers and its numbers over the whole selection,
the denominator said once; a plot with nothing to draw is a sentence, a plot of shares is scaled to what is there;
category and set names on an x axis do not run into each other. No GPU, no Chromium: the page is read back from
its HTML. ``pkb report``'s terminal headline, JSON and CSV of the same rows:
tests/integration/test_report_coverage_command.py.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from pkb.options import Status
from pkb.registry import all_problems
from pkb.report import html as report_html
from pkb.report import metrics, records
from helpers.reports import KNOWN_ROWS, SELECTION, SUITE, Page, build, make_result, partial_rows, write_db


@pytest.fixture(scope="module")
def partial_db(tmp_path_factory) -> Path:
    return write_db(tmp_path_factory.mktemp("coverage") / "r.sqlite", partial_rows())


def suite_report(db: Path) -> metrics.Report:
    return build(db, selection=SUITE)


def test_a_partial_set_counts_its_problems_on_the_covered_view_and_the_whole_suite_on_the_suite_view(partial_db):
    assert len(SUITE) == 87  # the numbers below are the issue's: 8 of 8 covered, 8 of 87 in the suite
    report = suite_report(partial_db)
    assert report.coverage == {"complete": metrics.Coverage(87, 87), "folder": metrics.Coverage(87, 80),
                               "pkb shipped": metrics.Coverage(87, 8)}
    assert report.partial() == ["folder", "pkb shipped"]
    for protocol in ("pkb", "paper"):
        covered, suite = report.on(protocol, "covered")["pkb shipped"], report.on(protocol, "suite")["pkb shipped"]
        assert (covered.num_attempted, covered.denominator, covered.pass_at_k[1]) == (8, 8, 1.0)
        assert (suite.num_attempted, suite.denominator) == (8, 87)
        assert suite.pass_at_k[1] == pytest.approx(8 / 87)
        # a model's folder missing 7 files: on the suite view (the paper's) the 7 count as failed
        assert report.on(protocol, "covered")["folder"].pass_at_k[1] == pytest.approx(40 / 80)
        assert report.on(protocol, "suite")["folder"].pass_at_k[1] == pytest.approx(40 / 87)
        # a set with every file: both views are the same
        assert report.on(protocol, "covered")["complete"] == report.on(protocol, "suite")["complete"]
    # ranked on the suite view, where every set has the same denominator: 40/87 > 29/87 > 8/87
    assert report.groups == ("folder", "complete", "pkb shipped")
    shipped_collectives = report.on_category("pkb", "covered")["pkb shipped"]["collectives"]
    assert shipped_collectives.pass_at_k[1] == 1.0 and report.category_coverage("pkb shipped", "collectives") == \
        metrics.Coverage(8, 8)
    assert report.on_category("pkb", "covered")["pkb shipped"]["tensor_parallel"].denominator == 0


def test_pkb_runs_headline_is_one_row_per_set_with_what_it_covers_and_the_denominator_said_once(capsys):
    """The issue's "1 of 1 covered (+7 left out)", "1 of 80 in the suite" and "the 79 without a result" said the
    same files three ways: now a set (pkb's shipped examples, a folder that misses files) is one row, what it
    covers beside its pass@1 over the whole selection, and one line says what that counts."""
    from pkb.cli import print_run_summary

    problems = [p for p in all_problems().values() if p.name in SUITE]  # the upstream benchmark's 87
    expected = {"pkb shipped": ("8 of 87", "9.2% / 9.2%", "-", "references: 87 of 87 ok"),
                "folder": ("80 of 87", "46.0% / 46.0%", "40 mismatch", "references: no self-check in these results")}
    for group, (covers, suite_pass, failures, self_check) in expected.items():
        run_sets = {group, "reference"} if group == "pkb shipped" else {group}  # `pkb run` self-checks then only
        print_run_summary([r for r in partial_rows() if r.solution_set in run_sets], problems, "r.sqlite")
        out = capsys.readouterr().out
        lines = out.splitlines()
        assert self_check in lines  # the references' self-check is over the whole selection
        header = next(line for line in lines if line.startswith("set "))
        assert header.split()[:2] == ["set", "covers"]
        (row,) = [line for line in lines if line.startswith(group)]
        assert re.fullmatch(rf"{group} +{covers} +{re.escape(suite_pass)} +- / - +- +- +{failures}", row.rstrip()), row
        assert lines[lines.index(row) + 1].strip() == ""  # no second row of the same set
        assert "covered" not in out and "in the suite" not in out and "without a result as failed)" not in out
        assert out.count("the paper's denominator") == 1
        assert "count the 87 selected problems, the paper's denominator" in out


def test_a_run_without_a_selection_counts_the_papers_suite_and_names_pkbs_own_problems(capsys):
    """`pkb run` over everything ran pkb's own problems too: its headline counts the paper's 87, as
    `pkb report` does, and a note says where the others are."""
    from pkb.cli import print_run_summary

    rows = [make_result("allreduce", "mine/allreduce", Status.OK, upstream_ok=True),
            make_result("hierarchical_allreduce", "mine/hierarchical_allreduce", Status.OK, upstream_ok=None)]
    print_run_summary(rows, None, "r.sqlite")
    out = capsys.readouterr().out
    assert re.search(r"mine +1 of 87 +1\.1% / 1\.1%", out)
    assert "beyond upstream (hierarchical_allreduce)" in out and "`pkb report --problems inter_node`" in out
    print_run_summary(rows, list(all_problems().values()), "r.sqlite")  # `--problems all`: pkb's own count too
    out = capsys.readouterr().out
    assert re.search(rf"mine +2 of {len(all_problems())} ", out) and "beyond upstream" not in out


def test_the_html_headline_is_one_row_per_set_with_what_it_covers(partial_db):
    page_html = report_html.render(suite_report(partial_db))
    page = Page()
    page.feed(page_html)
    assert page.cells[("pkb shipped", "headline.covers")] == ("8", "8 of 87")
    assert float(page.cells[("pkb shipped", "headline.pkb.pass@1")][0]) == pytest.approx(8 / 87)
    assert page.cells[("pkb shipped", "headline.pkb.pass@1")][1] == "9.2%"
    assert page.cells[("pkb shipped", "covers")] == ("8", "8 of 87")  # the leaderboard (on the suite) says it too
    assert page.cells[("complete", "headline.covers")] == ("87", "87 of 87")
    assert not any(metric.startswith("headline.covered.") for _, metric in page.cells)
    headline = re.search(r'<section id="headline">.*?</section>', page_html, re.S).group(0)
    assert [re.findall(r'<tr data-group="([^"]+)"', headline)] == [["folder", "complete", "pkb shipped"]]
    assert headline.count("the paper&#x27;s denominator") == 1 and "note coverage" not in page_html


def plots_and_sentences(page_html: str) -> tuple[list[str], list[str]]:
    plots = re.findall(r'<svg [^>]*data-plot="([^"]+)"', page_html)
    sentences = re.findall(r'<p class="note no-plot" data-plot="([^"]+)">', page_html)
    return plots, sentences


def test_a_plot_with_nothing_to_draw_is_a_sentence_not_an_empty_box(partial_db):
    page_html = report_html.render(suite_report(partial_db))  # nothing timed, no roofline
    plots, sentences = plots_and_sentences(page_html)
    assert sentences == ["speedup-by-set", "roofline-by-set", "fast-p", "scatter", "roofline"]
    assert plots == ["leaderboard", "protocols", "verdicts"]
    for svg in re.findall(r"<svg .*?</svg>", page_html):
        assert 'class="mark"' in svg  # every plot drawn has something in it
    assert "no correct result was timed on GPUs (`pkb run --perf --mode cuda` times them)" in page_html

    timed = write_db(partial_db.parent / "timed.sqlite", partial_rows(timed=True))
    plots, sentences = plots_and_sentences(report_html.render(suite_report(timed)))
    assert "speedup-by-set" in plots and "fast-p" in plots and "speedup-by-set" not in sentences


def bars(page_html: str, plot: str) -> tuple[float, list[tuple[dict, float]]]:
    """A plot's ``data-top`` and its bars: (attributes, height as a share of the plot area) each."""
    svg = re.search(rf'<svg [^>]*data-plot="{plot}"[^>]*>.*?</svg>', page_html, re.S).group(0)
    top = float(re.search(r'data-top="([\d.]+)"', svg).group(1))
    area = report_html.HEIGHT - report_html.MARGIN["top"] - report_html.MARGIN["bottom"]
    marks = [dict(re.findall(r'([\w-]+)="([^"]*)"', mark)) for mark in re.findall(r'<rect class="mark"[^>]*>', svg)]
    return top, [(attrs, float(attrs["height"]) / area) for attrs in marks]


def test_a_plot_of_shares_is_scaled_to_what_is_there_and_an_untimed_set_has_no_fast_1_bar(partial_db):
    """The issue's whole-suite HTML drew every bar 1-3 % tall (a few problems solved of 87): the axis now ends at
    the smallest of 5, 10, 25, 50, 100 % that holds every bar."""
    page_html = report_html.render(suite_report(partial_db))  # pass@1 up to 46 %: an axis to 50 %
    top, leaderboard = bars(page_html, "leaderboard")
    assert top == 0.5
    folder = next(height for attrs, height in leaderboard if attrs["data-group"] == "folder")
    assert folder == pytest.approx((40 / 87) / 0.5, abs=0.01)  # 46 % drawn 92 % tall
    assert {attrs["data-metric"] for attrs, _ in leaderboard} == {"pass@1"}  # nothing timed: no fast_1 bar at all
    assert ">50%</text>" in page_html and ">100%</text>" not in re.search(
        r'<svg [^>]*data-plot="leaderboard".*?</svg>', page_html, re.S).group(0)
    shipped_only = write_db(partial_db.parent / "shipped.sqlite",
                            [r for r in partial_rows() if r.solution_set == "pkb shipped"][:1])
    top, [(attrs, height)] = bars(report_html.render(suite_report(shipped_only)), "leaderboard")
    assert top == 0.05 and height == pytest.approx((1 / 87) / 0.05, abs=0.01)  # 1.1 % of the suite: 23 % tall


def x_labels(page_html: str, plot: str) -> tuple[float, list[tuple[str, str]]]:
    """The height of ``plot`` and its x axis labels: (transform or x, text) each."""
    svg = re.search(rf'<svg [^>]*data-plot="{plot}" [^>]*height="([\d.]+)".*?</svg>', page_html, re.S)
    labels = re.findall(r'<text class="x-label" (?:transform="([^"]+)"|x="([^"]+)")[^>]*>([^<]*)</text>', svg.group(0))
    return float(svg.group(1)), [(transform or f"x={x}", text) for transform, x, text in labels]


def test_category_names_are_turned_and_drawn_whole_when_they_would_run_into_each_other(partial_db):
    page_html = report_html.render(suite_report(partial_db))
    height, labels = x_labels(page_html, "protocols")
    categories = list(dict.fromkeys(SUITE.values()))
    assert len(categories) == 6 and [text for _, text in labels] == categories  # whole names, not cut at 16
    assert all(re.fullmatch(r"translate\([\d.]+ [\d.]+\) rotate\(-40\)", transform) for transform, _ in labels)
    longest = max(len(c) for c in categories) * report_html.CHAR_WIDTH * math.sin(math.radians(40))
    assert height >= report_html.HEIGHT + longest  # the plot grew to hold them

    # two short names side by side fit: drawn flat, the plot its usual height
    height, labels = x_labels(report_html.render(build(write_db(partial_db.parent / "known.sqlite", KNOWN_ROWS),
                                                       selection=SELECTION)), "protocols")
    assert [text for _, text in labels] == ["collectives", "tensor_parallel"]
    assert all(place.startswith("x=") for place, _ in labels) and height == report_html.HEIGHT


def test_long_set_names_on_the_per_set_axes_are_turned_too(tmp_path):
    names = ["openai-gpt-5-oneshot-cuda", "anthropic-claude-agentic", "qwen3-coder-k10", "pkb shipped",
             "deepseek-v3-oneshot"]
    rows = [make_result("allreduce", f"{name}/allreduce", Status.OK, 1.2, 0.5, upstream_ok=True, solution_set=name)
            for name in names]
    page_html = report_html.render(build(write_db(tmp_path / "r.sqlite", rows)))
    for plot in ("leaderboard", "verdicts", "speedup-by-set", "roofline-by-set"):
        _, labels = x_labels(page_html, plot)
        assert sorted(text for _, text in labels) == sorted(
            name if len(name) <= report_html.LABEL_CHARS else "openai-gpt-5-oneshot\u2026" for name in names)
        assert all("rotate(-40)" in place for place, _ in labels), plot


def test_records_from_a_run_and_from_the_database_give_the_same_coverage(partial_db):
    """``pkb run``'s headline (its results) and ``pkb report`` (the database) agree on a set's coverage."""
    rows = [r for r in partial_rows() if r.solution_set in ("reference", "pkb shipped")]
    from_run = metrics.build_report(records.from_results(rows), SUITE, "set", ks=(1,))
    assert from_run.coverage == {"pkb shipped": suite_report(partial_db).coverage["pkb shipped"]}
