"""The HTML report: one static file, plots drawn as inline SVG, no script and nothing fetched to view it.

Sections: the headline (the references' self-check, one row per set on both protocols), leaderboard
(table and bars), plots by set (speedup distribution, % of roofline distribution, correct on the
upstream cases against correct on every case per category), fast_p curves, verdicts stacked by group,
speedup against % of roofline, % of roofline histogram, per-category table, and one section per
problem (anchor ``#problem-<slug>``) with every result, its verdict details and the candidate's code.

Every number cell carries ``data-group``, ``data-metric`` and ``data-value`` (the unrounded value), and
every plotted mark is an SVG element of class ``mark``, so a test (or a script) can read the page back.
The headline's note on a set whose results ran without the full sandbox is a ``p.note.sandbox`` with
``data-group``, ``data-without-full``, ``data-results`` and a count per gap (``data-off``, ``data-partial``,
``data-unrecorded``). The headline has one row per set (cells ``headline.*``): what it covers
(``headline.covers``), then its metrics over the whole selection, the paper's denominator, said once under it.

A plot with nothing to draw is a sentence (``p.note.no-plot`` with ``data-plot``), not an empty frame. A plot of
shares is scaled to what is there (its axis ends at the smallest of 5, 10, 25, 50 or 100 % that holds every bar,
``data-top``), and a set with nothing timed on GPUs has no fast_1 bar (its cells say ``-``). Category and set
names on an x axis are drawn whole up to ``LABEL_CHARS``, turned 40 degrees when they would not fit side by side.
Text shortened for a cell (a message, a long name) is cut between words with an ellipsis (pkb.console.shorten);
the whole text is the row's details, one click away. With transcripts, a section per generation run shows
each conversation's turns (pkb.report.transcripts).
"""

from __future__ import annotations

import html
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from pkb.console import shorten
from pkb.options import Status
from pkb.report.metrics import FAST_P_THRESHOLDS, Report, gpu_speedup
from pkb.report.records import Record
from pkb.report.tables import (OFF_GPU_COLUMN, STRICT_GAP_COLUMNS, covers_text, headline_footnote, headline_notes,
                               percent, reason_meanings, sandbox_notes, strict_gap_rows, times)
from pkb.report.transcripts import Transcript, speed_text

PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac")
STATUS_COLORS = {
    Status.OK: "#59a14f", Status.MISMATCH: "#e15759", Status.COMPILE_ERROR: "#9c755f",
    Status.IMPORT_ERROR: "#b07aa1", Status.SIGNATURE_ERROR: "#ff9da7", Status.RUNTIME_ERROR: "#f28e2b",
    Status.TIMEOUT: "#edc948", Status.CRASH: "#76b7b2", Status.TAMPERED: "#000000", Status.FORBIDDEN: "#555555",
    Status.SKIPPED: "#bab0ac", Status.HARNESS_ERROR: "#7f3c8d", Status.INFRA_ERROR: "#4e79a7",
}
WIDTH, HEIGHT = 620, 300
MARGIN = {"left": 56, "right": 150, "top": 16, "bottom": 40}
CHAR_WIDTH = 6.2  # px of an 11 px label character, to tell whether x labels fit side by side
LABEL_ANGLE = 40  # degrees an x axis's labels turn when they do not fit
LABEL_CHARS = 24  # the longest x label drawn whole
LEGEND_CHARS = 20  # the longest legend label drawn whole
CELL_CHARS = 160  # of a message in a table cell (the whole message is in the row's details)
SUMMARY_CHARS = 200  # of a message in a result's summary line
PERCENT_TOPS = (0.05, 0.1, 0.25, 0.5, 1.0)  # where an axis of shares may end: the smallest that holds every value

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1300px; }
h1 { margin: 0 0 4px; } h2 { margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0; } th, td { padding: 3px 8px; border-bottom: 1px solid #eee; }
th { text-align: left; background: #f6f6f6; } td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.plots { display: flex; flex-wrap: wrap; gap: 16px; align-items: flex-start; } figure { margin: 0; max-width: 624px; }
figcaption { color: #555; }
svg.plot { background: #fff; border: 1px solid #ddd; } svg text { font: 11px system-ui, sans-serif; fill: #333; }
.status { padding: 1px 6px; border-radius: 3px; color: #fff; } .note { color: #666; }
p.no-plot { width: 420px; margin: 0; padding: 6px 10px; border-left: 3px solid #ddd; }
tr.view-suite td { color: #555; }
pre { background: #f6f8fa; padding: 8px; overflow-x: auto; max-height: 480px; font-size: 12px; }
section.problem { margin-bottom: 24px; }
"""


def render(report: Report, title: str = "pkb report", source: str = "",
           transcripts: list[Transcript] | tuple = ()) -> str:
    """The whole report as one HTML document; ``transcripts`` (pkb.report.transcripts) get a section per run."""
    colors = {group: PALETTE[i % len(PALETTE)] for i, group in enumerate(report.groups)}
    parts = [
        _header(report, title, source),
        _section("headline", "Headline", _headline(report)),
        _section("leaderboard", "Leaderboard (pkb's protocol, in the suite)", _leaderboard_table(report) + _figure(
            _leaderboard_bars(report, colors),
            "pass@1 and fast_1 (correct and faster than the reference) per group, in the suite")),
        _section("sets", "By set", '<div class="plots">' + "".join([
            _figure(_strip(report, colors, "speedup-by-set"),
                    "speedup over the reference of each correct, timed sample (log); the bar is the geometric mean"),
            _figure(_strip(report, colors, "roofline-by-set"),
                    "% of roofline of each correct sample; the bar is the median"),
            _figure(_protocol_bars(report, colors),
                    "pass@1 per category with results, in the suite: the paper's verdict (upstream's inputs and "
                    "rule, solid) and pkb's (its cases against the exact answer, light)"),
        ]) + "</div>"),
        _section("plots", "Speed", '<div class="plots">' + "".join([
            _figure(_fast_p_curves(report, colors),
                    "fast_p@1 in the suite: share of problems solved correctly with speedup > p"),
            _figure(_verdict_stacks(report), "verdicts per group (latest result of each sample)"),
            _figure(_scatter(report, colors), "correct results: speedup over the reference (log) against % of roofline"),
            _figure(_roofline_histogram(report, colors), "correct results per 10 % bin of roofline"),
        ]) + "</div>"),
        _section("categories", "Per category (in the suite)", _category_table(report)),
        _section("strict", "Correct on the paper's protocol, failing pkb's cases", _strict_gap_table(report)),
        _section("problems", "Problems", _problem_index(report) + "".join(_problem_section(report, p)
                                                                           for p in _problems_with_results(report))),
        _section("transcripts", "Transcripts", _transcripts(transcripts)),
    ]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{CSS}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n")


def write(report: Report, path: str | Path, source: str = "", transcripts: list[Transcript] | tuple = ()) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(report, source=source, transcripts=transcripts), encoding="utf-8")
    return path


# -- page parts ------------------------------------------------------------------------------------


def _header(report: Report, title: str, source: str) -> str:
    counted = sum(1 for r in report.records if not r.is_reference)
    notes = "".join(f'<p class="note">{_e(n)}</p>' for n in report.notes)
    return (f"<header><h1>{_e(title)}</h1><p>{_e(source)} · {len(report.problems)} problems selected · "
            f'<span data-metric="num_results" data-value="{counted}">{counted}</span> candidate results '
            f"(latest per sample) · grouped by {_e(report.group_by)} · generated "
            f"{time.strftime('%Y-%m-%d %H:%M', time.localtime())}</p>{notes}{_partial_note(report)}"
            '<nav><a href="#headline">headline</a> · <a href="#leaderboard">leaderboard</a> · '
            '<a href="#sets">by set</a> · <a href="#plots">plots</a> · '
            '<a href="#categories">categories</a> · <a href="#problems">problems</a> · '
            '<a href="#transcripts">transcripts</a></nav></header>')


def _headline(report: Report) -> str:
    check = report.self_check
    if check.num_checked:
        details = check.details()
        text = ("<p>references checked against themselves: "
                f'<span data-group="reference" data-metric="self_check.ok" data-value="{check.num_ok}">'
                f"{check.num_ok}</span>"
                f' of <span data-group="reference" data-metric="self_check.checked" data-value="{check.num_checked}">'
                f"{check.num_checked}</span> ok" + (f" ({_e('; '.join(details))})" if details else "") + "</p>")
    else:
        text = f"<p>{_e(check.summary())}</p>"
    if not report.groups:
        return text + '<p class="note">No candidate results in this selection (reference self-checks do not count).</p>'
    off_gpu = f"<th>{_e(OFF_GPU_COLUMN)}</th>" if report.off_gpu_shown else ""
    head = ("<tr><th>#</th><th>" + _e(report.group_by) + "</th><th>covers</th><th>pass@1 paper</th>"
            "<th>pass@1 pkb</th><th>fast_1 paper</th><th>fast_1 pkb</th><th>fast_1.5 pkb</th><th>fast_2 pkb</th><th>geomean speedup</th>"
            f"<th>median % roofline</th><th>failures (pkb)</th><th>failures (paper)</th>{off_gpu}</tr>")
    rows = "".join(_headline_row(report, group, rank) for rank, group in enumerate(report.groups, 1))
    sandbox = {note: group for group, note in sandbox_notes(report).items()}
    notes = "".join(_sandbox_note(report, sandbox[n], n) if n in sandbox else f'<p class="note">{_e(n)}</p>'
                    for n in headline_notes(report) if n not in report.notes)
    footnote = "".join(f'<p class="note footnote">{_e(line)}</p>' for line in headline_footnote(report).splitlines())
    return f"{text}<table>{head}{rows}</table>{footnote}{notes}"


def _headline_row(report: Report, group: str, rank: int) -> str:
    """``group``'s headline row: what it covers (``headline.covers``), then its metrics over the whole selection
    (cells ``headline.<metric>``), speed from GPU timings only; the off-GPU speedup where asked for."""
    m, paper = report.overall[group], report.paper[group]
    coverage = report.coverage[group]
    cells = (_num(group, "headline.covers", coverage.num_covered, covers_text(report, group))
             + _num(group, "headline.paper.pass@1", paper.pass_at_k.get(1), percent(paper.pass_at_k.get(1)))
             + _num(group, "headline.pkb.pass@1", m.pass_at_k.get(1), percent(m.pass_at_k.get(1)))
             + _num(group, "headline.paper.fast_1", paper.fast(), percent(paper.fast()))
             + _num(group, "headline.pkb.fast_1", m.fast(), percent(m.fast()))
             + _num(group, "headline.pkb.fast_1.5", m.fast(1.5), percent(m.fast(1.5)))
             + _num(group, "headline.pkb.fast_2", m.fast(2.0), percent(m.fast(2.0)))
             + _num(group, "headline.geomean_speedup", m.geomean_speedup, times(m.geomean_speedup))
             + _num(group, "headline.median_roofline", m.roofline.quantiles.get("median"),
                    percent(m.roofline.quantiles.get("median")))
             + f"<td>{_e(', '.join(f'{n} {s}' for s, n in m.failures.items()) or '-')}</td>"
             + f"<td>{_e(', '.join(f'{n} {s}' for s, n in paper.failures.items()) or '-')}</td>")
    if report.off_gpu_shown:
        cells += _num(group, "headline.off_gpu_speedup", m.off_gpu.geomean_speedup, m.off_gpu.text())
    return f'<tr data-group="{_e(group)}"><td>{rank}</td><td>{_e(group)}</td>{cells}</tr>'


def _sandbox_note(report: Report, group: str, note: str) -> str:
    """A group's results not run under the full sandbox: the headline's note, its counts readable as data."""
    tally = report.sandbox(group)
    counts = "".join(f' data-{gap}="{n}"' for gap, n in tally.num_by_gap.items())
    return (f'<p class="note sandbox" data-group="{_e(group)}" data-without-full="{tally.num_without_full}" '
            f'data-results="{tally.num_results}"{counts}>{_e(note)}</p>')


def _section(anchor: str, title: str, body: str) -> str:
    return f'<section id="{anchor}"><h2>{_e(title)}</h2>{body}</section>'


def _figure(plot: str | _NoPlot, caption: str) -> str:
    """A plot and its caption; a plot with nothing to draw is a sentence saying why, not an empty frame."""
    if isinstance(plot, _NoPlot):
        return f'<p class="note no-plot" data-plot="{plot.name}">{_e(caption)}: {_e(plot.why)}.</p>'
    return f"<figure>{plot}<figcaption>{_e(caption)}</figcaption></figure>"


def _leaderboard_table(report: Report) -> str:
    if not report.groups:
        return '<p class="note">No candidate results in this selection (reference self-checks do not count).</p>'
    head = ("<tr><th>#</th><th>group</th><th>covers</th><th>problems</th><th>attempted</th><th>pass@1</th>"
            "<th>fast_1</th><th>fast_2</th><th>geomean speedup</th><th>median % roofline</th>"
            "<th>moves data itself</th><th>failures</th></tr>")
    rows = []
    for rank, (group, m) in enumerate(report.overall.items(), 1):
        rows.append(
            f"<tr><td>{rank}</td><td>{_e(group)}</td>"
            + _num(group, "covers", report.coverage[group].num_covered, report.coverage[group].text())
            + _num(group, "problems", m.denominator, str(m.denominator))
            + _num(group, "attempted", m.num_attempted, str(m.num_attempted))
            + _num(group, "pass@1", m.pass_at_k.get(1), percent(m.pass_at_k.get(1)))
            + _num(group, "fast_1", m.fast(), percent(m.fast()))
            + _num(group, "fast_2", m.fast(2.0), percent(m.fast(2.0)))
            + _num(group, "geomean_speedup", m.geomean_speedup, times(m.geomean_speedup))
            + _num(group, "median_roofline", m.roofline.quantiles.get("median"),
                   percent(m.roofline.quantiles.get("median")))
            + _num(group, "moves_data_itself", m.moves_data_itself, percent(m.moves_data_itself))
            + "<td>" + (", ".join(f'<span data-group="{_e(group)}" data-metric="failures.{s}" data-value="{n}">'
                                  f"{n} {_e(s)}</span>" for s, n in m.failures.items()) or "-") + "</td></tr>")
    more = _pass_at_k_table(report)
    return f"<table>{head}{''.join(rows)}</table>{more}"


def _pass_at_k_table(report: Report) -> str:
    ks = sorted({k for m in report.overall.values() for k in m.pass_at_k if k > 1})
    if not ks:
        return ""
    head = "<tr><th>group</th>" + "".join(f"<th>pass@{k}</th><th>fast_1@{k}</th>" for k in ks) + "</tr>"
    rows = "".join(
        f"<tr><td>{_e(g)}</td>" + "".join(
            _num(g, f"pass@{k}", m.pass_at_k.get(k), percent(m.pass_at_k.get(k)))
            + _num(g, f"fast_1@{k}", m.fast(1.0, k), percent(m.fast(1.0, k))) for k in ks)
        + "</tr>" for g, m in report.overall.items())
    return f"<table>{head}{rows}</table>"


def _strict_gap_table(report: Report) -> str:
    """Per group: the paper-correct samples that fail pkb's stricter cases, by the failing case's tags."""
    rows = strict_gap_rows(report)
    if not rows:
        return '<p class="note">No sample correct on the paper\'s protocol failed pkb\'s cases.</p>'
    head = "<tr>" + "".join(f"<th>{_e(c)}</th>" for c in (report.group_by, *STRICT_GAP_COLUMNS[1:])) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{_e(row[c])}</td>" for c in STRICT_GAP_COLUMNS) + "</tr>" for row in rows)
    legend = "".join(f"<li><b>{_e(reason)}</b>: {_e(meaning)}</li>" for reason, meaning in reason_meanings(report).items())
    return f"<table>{head}{body}</table><ul class=\"note\">{legend}</ul>"


def _covered_categories(report: Report) -> list[str]:
    """The categories some group has a result in: a partial set's plots and per-category table show those."""
    return [c for c in report.categories
            if any(report.category_coverage(group, c).num_covered for group in report.groups)]


def _partial_note(report: Report) -> str:
    """What a report of partial sets leaves out, and the command that reports only what was run."""
    partial = report.partial()
    if not partial:
        return ""
    from pkb.registry import selection_text

    covered = sorted({r.problem for r in report.records if not r.is_reference and r.group in report.groups})
    left_out = [c for c in report.categories if c not in _covered_categories(report)]
    said = f'<p class="note">{_e(", ".join(partial))} cover part of the {len(report.problems)} selected problems'
    if left_out:
        said += f"; categories without a result are left out of the plots and tables ({_e(', '.join(left_out))})"
    if covered:
        said += f". To report only what was run: <code>pkb report --problems {_e(selection_text(covered))} --html FILE</code>"
    return said + ".</p>"


def _category_table(report: Report) -> str:
    if not report.groups:
        return '<p class="note">No candidate results.</p>'
    head = ("<tr><th>category</th><th>group</th><th>covers</th><th>problems</th><th>attempted</th><th>pass@1 paper</th>"
            "<th>pass@1</th><th>fast_1</th><th>geomean speedup</th><th>median % roofline</th><th>failures</th></tr>")
    rows = []
    for category in _covered_categories(report):
        for group in report.groups:
            m = report.by_category[group][category]
            paper = report.paper_by_category[group][category]
            key = f"{category}."
            coverage = report.category_coverage(group, category)
            rows.append(
                f"<tr><td>{_e(category)}</td><td>{_e(group)}</td>"
                + _num(group, key + "covers", coverage.num_covered, coverage.text())
                + _num(group, key + "problems", m.denominator, str(m.denominator))
                + _num(group, key + "attempted", m.num_attempted, str(m.num_attempted))
                + _num(group, key + "paper.pass@1", paper.pass_at_k.get(1), percent(paper.pass_at_k.get(1)))
                + _num(group, key + "pass@1", m.pass_at_k.get(1), percent(m.pass_at_k.get(1)))
                + _num(group, key + "fast_1", m.fast(), percent(m.fast()))
                + _num(group, key + "geomean_speedup", m.geomean_speedup, times(m.geomean_speedup))
                + _num(group, key + "median_roofline", m.roofline.quantiles.get("median"),
                       percent(m.roofline.quantiles.get("median")))
                + f"<td>{_e(', '.join(f'{n} {s}' for s, n in m.failures.items()) or '-')}</td></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def _problems_with_results(report: Report) -> list[str]:
    present = {r.problem for r in report.records}
    return [p for p in report.problems if p in present]


def _problem_index(report: Report) -> str:
    rows = []
    for problem in _problems_with_results(report):
        records = [r for r in report.records if r.problem == problem and not r.is_reference]
        ok = sum(1 for r in records if r.status is Status.OK)
        rows.append(f'<tr><td><a href="#problem-{_e(problem)}">{_e(problem)}</a></td>'
                    f"<td>{_e(report.problems[problem])}</td><td class=num>{len(records)}</td><td class=num>{ok}</td></tr>")
    if not rows:
        return '<p class="note">No results for the selected problems.</p>'
    return ("<table><tr><th>problem</th><th>category</th><th>candidate results</th><th>ok</th></tr>"
            + "".join(rows) + "</table>")


def _problem_section(report: Report, problem: str) -> str:
    records = [r for r in report.records if r.problem == problem]
    head = ("<tr><th>group</th><th>solution</th><th>verdict</th><th>speedup</th><th>% roofline</th>"
            "<th>busbw</th><th>mode</th><th>ranks</th><th>message</th></tr>")
    rows = "".join(
        f'<tr><td>{_e(r.group)}</td><td><a href="#result-{r.key}">{_e(r.result.solution)}</a></td>'
        f"<td>{_status(r.status)}</td><td class=num>{_speedup_cell(r)}</td>"
        f"<td class=num>{_off_gpu_marked(r, percent(r.result.roofline_fraction))}</td>"
        f"<td class=num>{'-' if r.result.busbw_gbps is None else f'{r.result.busbw_gbps:.1f} GB/s'}</td>"
        f"<td>{_e(r.result.mode)}</td><td class=num>{r.result.world_size}</td>"
        f"<td>{_shortened(r.result.message, CELL_CHARS, f'#result-{r.key}')}</td></tr>"
        for r in records)
    return (f'<section class="problem" id="problem-{_e(problem)}"><h3>{_e(problem)} '
            f'<small class="note">({_e(report.problems[problem])})</small></h3><table>{head}{rows}</table>'
            + "".join(_result_details(r) for r in records if not r.is_reference) + "</section>")


def _speedup_cell(record: Record) -> str:
    """A result's speedup, marked where it was not timed on GPUs (``0.84x (cpu)``: not GPU performance)."""
    return _off_gpu_marked(record, times(record.result.speedup))


def _off_gpu_marked(record: Record, text: str) -> str:
    """``text`` (a number from the result's timing: its speedup, its share of the roofline), marked with the mode
    where it was not timed on GPUs (``24.0% (cpu)``: not GPU performance)."""
    if record.result.speedup is None or gpu_speedup(record) is not None:
        return _e(text)
    return f'{_e(text)} <span class="note" title="not GPU performance">({_e(record.result.mode)})</span>'



def _shortened(text: str, limit: int, whole_at: str | None = None) -> str:
    """``text`` shortened for a cell (pkb.console.shorten), the whole of it a link away (``whole_at``) and in the
    title; the text itself where it fits."""
    shown = shorten(text, limit)
    if shown == " ".join(text.split()):
        return _e(shown)
    link = f' href="{_e(whole_at)}"' if whole_at else ""
    return f'<a class="shortened"{link} title="{_e(text)}">{_e(shown)}</a>'


def _result_details(record: Record) -> str:
    result = record.result
    timings = ""
    if result.timings:
        timings = ("<table><tr><th>case</th><th>reference</th><th>candidate</th><th>speedup</th><th>busbw</th></tr>"
                   + "".join(f"<tr><td>{_e(t.case)}</td><td class=num>{t.reference_s * 1e6:.1f} us</td>"
                             f"<td class=num>{t.candidate_s * 1e6:.1f} us</td><td class=num>{t.speedup:.2f}x</td>"
                             f"<td class=num>{'-' if t.busbw_gbps is None else f'{t.busbw_gbps:.1f} GB/s'}</td></tr>"
                             for t in result.timings) + "</table>")
    found = result.details.to_dict()
    details = f"<pre>{_e(json.dumps(found, indent=1, default=str))}</pre>" if found else ""
    code = (f'<p class="note">code from {_e(record.code.origin)}</p><pre><code>{_e(record.code.text)}</code></pre>'
            if record.code.text is not None else f'<p class="note">code {_e(record.code.origin)}</p>')
    gpu_note = "" if result.times_are_gpu_performance or not result.timings else \
        f'<p class="note">times measured in {_e(result.mode)} mode: not GPU performance</p>'
    return (f'<details id="result-{record.key}"><summary>{_e(record.group)} / {_e(result.solution)}'
            + ("" if record.sample == result.solution else f" ({_e(record.sample)})")
            + f": {_status(record.status)} {_e(shorten(result.message, SUMMARY_CHARS))}</summary>"
            f"<p>{_e(result.message)}</p>{gpu_note}{timings}{details}{code}</details>")


def _transcripts(transcripts: list[Transcript] | tuple) -> str:
    """A section per generation run (``id="run-<run>"``), a collapsed block per conversation, a row per turn: the
    message sent (a prompt the run sent before is named, not repeated), the answer and the verdict, whole."""
    if not transcripts:
        return ('<p class="note">No generation or agent run among these results (`pkb generate` and `pkb agent` '
                "store their turns; `pkb transcripts RUN` prints them).</p>")
    by_run: dict[str, list[Transcript]] = {}
    for transcript in transcripts:
        by_run.setdefault(transcript.run, []).append(transcript)
    parts = []
    for run, conversations in by_run.items():
        sent_before: dict[str, str] = {}  # text -> the conversation that sent it first
        blocks = "".join(_conversation(t, sent_before) for t in conversations)
        parts.append(f'<section class="run" id="run-{_e(run)}" data-run="{_e(run)}"><h3>{_e(run)} '
                     f'<small class="note">({_e(conversations[0].model)}, {len(conversations)} conversations)</small>'
                     f"</h3>{blocks}</section>")
    return "".join(parts)


def _conversation(transcript: Transcript, sent_before: dict[str, str]) -> str:
    rows = []
    for turn in transcript.turns:
        if turn.sent in sent_before:
            sent = f'<p class="note">the same {turn.sent_kind} as {_e(sent_before[turn.sent])}</p>'
        else:
            sent_before[turn.sent] = f"{transcript.title}, turn {turn.step}"
            sent = f"<pre>{_e(turn.sent)}</pre>"
        answer = f"<pre>{_e(turn.answer)}</pre>" if turn.answer is not None else '<p class="note">no answer</p>'
        speed = f", speedup {_e(speed_text(turn))}" if turn.speedup else ""
        rows.append(f'<div class="turn" data-step="{turn.step}" data-status="{_e(turn.status)}">'
                    f"<h4>turn {turn.step}: {_e(turn.status)}{speed}</h4><p><b>sent ({turn.sent_kind})</b></p>{sent}"
                    f"<p><b>answer</b></p>{answer}<p><b>verdict</b>: {_e(turn.status)}: {_e(turn.message)}</p></div>")
    last = transcript.turns[-1] if transcript.turns else None
    summary = f"{transcript.title}: " + (f"{last.status} after {len(transcript.turns)} turn(s)" if last else "no turn")
    return f'<details class="transcript" data-problem="{_e(transcript.problem)}"><summary>{_e(summary)}</summary>' \
           f"{''.join(rows)}</details>"


# -- plots -------------------------------------------------------------------------------------------


def _svg(name: str, body: str, title: str, height: float = HEIGHT, top: float | None = None) -> str:
    """An SVG plot; ``top``: where its axis of shares ends (``data-top``), for a plot of shares."""
    scale = "" if top is None else f' data-top="{top}"'
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" data-plot="{name}"{scale} width="{WIDTH}" '
            f'height="{height:.0f}" viewBox="0 0 {WIDTH} {height:.0f}" role="img">'
            f"<title>{_e(title)}</title>{body}</svg>")


@dataclass(frozen=True)
class _NoPlot:
    """A plot with nothing to draw: ``_figure`` writes ``why`` as a sentence instead."""

    name: str
    why: str


def _label(name: str) -> str:
    """A category's or set's name on an x axis: whole up to ``LABEL_CHARS``, else shortened between words."""
    return shorten(name, LABEL_CHARS)


class _Frame:
    """The plotting area: maps data to pixels (y grows upward) and draws axes."""

    def __init__(self, x_range: tuple[float, float], y_range: tuple[float, float], log_x: bool = False,
                 names: list[str] | None = None):
        """``names``: an x axis of categories or sets, one per unit of ``x_range`` (``self.names`` are
        their ticks); turned when they would run into each other, the plot growing taller to hold them."""
        self.log_x = log_x
        self.x0, self.x1 = (math.log10(v) for v in x_range) if log_x else x_range
        self.y0, self.y1 = y_range
        self.left, self.right = MARGIN["left"], WIDTH - MARGIN["right"]
        self.top, self.bottom = MARGIN["top"], HEIGHT - MARGIN["bottom"]
        shown = [_label(name) for name in names or []]
        band = (self.right - self.left) / max(len(shown), 1)
        self.turn_x = any(len(name) * CHAR_WIDTH > band * 0.9 for name in shown)
        widest = max((len(name) * CHAR_WIDTH for name in shown), default=0)
        self.height = HEIGHT + (math.sin(math.radians(LABEL_ANGLE)) * widest if self.turn_x else 0)
        self.names = [(i + 0.5, name) for i, name in enumerate(shown)]

    def x(self, value: float) -> float:
        value = math.log10(value) if self.log_x else value
        return self.left + (value - self.x0) / ((self.x1 - self.x0) or 1) * (self.right - self.left)

    def y(self, value: float) -> float:
        return self.bottom - (value - self.y0) / ((self.y1 - self.y0) or 1) * (self.bottom - self.top)

    def axes(self, x_ticks: list[tuple[float, str]], y_ticks: list[tuple[float, str]], x_label: str,
             y_label: str) -> str:
        out = [f'<line x1="{self.left}" y1="{self.bottom}" x2="{self.right}" y2="{self.bottom}" stroke="#888"/>',
               f'<line x1="{self.left}" y1="{self.top}" x2="{self.left}" y2="{self.bottom}" stroke="#888"/>']
        for value, label in x_ticks:
            x = self.x(value)
            if self.turn_x:  # the label's end under its tick, running down to the left
                out.append(f'<text class="x-label" transform="translate({x + 3:.1f} {self.bottom + 12}) '
                           f'rotate(-{LABEL_ANGLE})" text-anchor="end">{_e(label)}</text>')
            else:
                out.append(f'<text class="x-label" x="{x:.1f}" y="{self.bottom + 14}" text-anchor="middle">'
                           f"{_e(label)}</text>")
        for value, label in y_ticks:
            y = self.y(value)
            out.append(f'<line x1="{self.left}" y1="{y:.1f}" x2="{self.right}" y2="{y:.1f}" stroke="#eee"/>'
                       f'<text x="{self.left - 6}" y="{y + 4:.1f}" text-anchor="end">{_e(label)}</text>')
        out.append(f'<text x="{(self.left + self.right) / 2}" y="{self.height - 6:.1f}" text-anchor="middle">'
                   f"{_e(x_label)}</text>")
        out.append(f'<text transform="translate(12 {(self.top + self.bottom) / 2}) rotate(-90)" '
                   f'text-anchor="middle">{_e(y_label)}</text>')
        return "".join(out)


def _legend(entries: list[tuple[str, str]]) -> str:
    x = WIDTH - MARGIN["right"] + 12
    return "".join(f'<rect x="{x}" y="{MARGIN["top"] + 16 * i}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{x + 14}" y="{MARGIN["top"] + 16 * i + 9}">{_e(shorten(label, LEGEND_CHARS))}</text>'
                   for i, (label, color) in enumerate(entries))


_PERCENT_TICKS = [(v / 100, f"{v}%") for v in (0, 25, 50, 75, 100)]


def _percent_axis(values) -> tuple[float, list[tuple[float, str]]]:
    """Where an axis of shares ends and its ticks: the smallest of ``PERCENT_TOPS`` that holds every value, in
    quarters, so that bars of 1-3 % are not drawn 1-3 % tall; e.g. values up to 9.2 % give an axis to 10 %."""
    top = next((t for t in PERCENT_TOPS if max(values, default=0.0) <= t), 1.0)
    return top, [(top * i / 4, f"{100 * top * i / 4:g}%") for i in range(5)]


def _leaderboard_bars(report: Report, colors: dict[str, str]) -> str:
    if not report.groups:
        return _NoPlot("leaderboard", "no candidate results")
    top, ticks = _percent_axis([v for m in report.overall.values() for v in (m.pass_at_k.get(1), m.fast()) if v])
    frame = _Frame((0, len(report.groups)), (0, top), names=list(report.groups))
    band = (frame.right - frame.left) / len(report.groups)
    bars = []
    for i, (group, m) in enumerate(report.overall.items()):
        for j, (metric, value, opacity) in enumerate((("pass@1", m.pass_at_k.get(1, 0.0), 1.0),
                                                      ("fast_1", m.fast(), 0.5))):
            if value is None:  # nothing timed on GPUs: no bar, as its cells say `-`
                continue
            x = frame.left + band * i + band * (0.15 + 0.35 * j)
            bars.append(f'<rect class="mark" data-group="{_e(group)}" data-metric="{metric}" data-value="{value}" '
                        f'x="{x:.1f}" y="{frame.y(value):.1f}" width="{band * 0.33:.1f}" '
                        f'height="{frame.bottom - frame.y(value):.1f}" fill="{colors[group]}" fill-opacity="{opacity}">'
                        f"<title>{_e(group)} {metric} {percent(value)}</title></rect>")
    legend = _legend([("pass@1 (solid)", "#555"), ("fast_1 (light)", "#bbb")])
    return _svg("leaderboard", frame.axes(frame.names, ticks, "group", "share of problems") + "".join(bars)
                + legend, "pass@1 and fast_1 per group", frame.height, top)


def _fast_p_curves(report: Report, colors: dict[str, str]) -> str:
    if not report.groups:
        return _NoPlot("fast-p", "no candidate results")
    if not any(m.timed for m in report.overall.values()):
        return _NoPlot("fast-p", "no result was timed, so fast_p for p > 0 says nothing (`pkb run --perf` times them)")
    timed = {group: m.fast_p[1] for group, m in report.overall.items() if m.timed and m.fast_p.get(1)}
    top, ticks = _percent_axis([v for values in timed.values() for v in values.values()])
    frame = _Frame((FAST_P_THRESHOLDS[0], FAST_P_THRESHOLDS[-1]), (0, top))
    out = []
    for group, values in timed.items():
        points = [(frame.x(p), frame.y(values[p])) for p in FAST_P_THRESHOLDS]
        out.append(f'<polyline fill="none" stroke="{colors[group]}" stroke-width="2" '
                   f'points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in points)}"/>')
        out += [f'<circle class="mark" data-group="{_e(group)}" data-p="{p}" data-value="{values[p]}" cx="{x:.1f}" '
                f'cy="{y:.1f}" r="4" fill="{colors[group]}"><title>{_e(group)} fast_{p:g} {percent(values[p])}</title>'
                f"</circle>" for p, (x, y) in zip(FAST_P_THRESHOLDS, points)]
    x_ticks = [(p, f"{p:g}") for p in FAST_P_THRESHOLDS]
    return _svg("fast-p", frame.axes(x_ticks, ticks, "speedup threshold p", "fast_p@1") + "".join(out)
                + _legend([(g, colors[g]) for g in timed]), "fast_p curves", top=top)


def _verdict_stacks(report: Report) -> str:
    if not report.groups:
        return _NoPlot("verdicts", "no candidate results")
    statuses = [s for s in Status if any(s.value in m.verdicts for m in report.overall.values())]
    most = max(sum(m.verdicts.values()) for m in report.overall.values()) or 1
    frame = _Frame((0, len(report.groups)), (0, most), names=list(report.groups))
    band = (frame.right - frame.left) / len(report.groups)
    out = []
    for i, (group, m) in enumerate(report.overall.items()):
        stacked = 0
        for status in statuses:
            count = m.verdicts.get(status.value, 0)
            if not count:
                continue
            top = frame.y(stacked + count)
            out.append(f'<rect class="mark" data-group="{_e(group)}" data-status="{status.value}" data-value="{count}" '
                       f'x="{frame.left + band * (i + 0.2):.1f}" y="{top:.1f}" width="{band * 0.6:.1f}" '
                       f'height="{frame.y(stacked) - top:.1f}" fill="{STATUS_COLORS[status]}">'
                       f"<title>{_e(group)}: {count} {status.value}</title></rect>")
            stacked += count
    step = max(1, math.ceil(most / 5))
    y_ticks = [(v, str(v)) for v in range(0, most + 1, step)]
    return _svg("verdicts", frame.axes(frame.names, y_ticks, "group", "results") + "".join(out)
                + _legend([(s.value, STATUS_COLORS[s]) for s in statuses]), "verdicts by group", frame.height)


def _scatter(report: Report, colors: dict[str, str]) -> str:
    points = [r for r in report.records if not r.is_reference and r.group in colors and r.status is Status.OK
              and gpu_speedup(r) and r.result.roofline_fraction is not None]
    if not points:
        return _NoPlot("scatter", "no correct result has both a speedup timed on GPUs and a % of roofline")
    speedups = [r.result.speedup for r in points]
    low = 10 ** math.floor(math.log10(min(min(speedups), 1.0)))
    high = 10 ** math.ceil(math.log10(max(max(speedups), 1.0) * 1.0001))
    top = max(1.0, max(r.result.roofline_fraction for r in points))
    frame = _Frame((low, high), (0, top), log_x=True)
    x_ticks, tick = [], low
    while tick <= high * 1.0001:
        x_ticks.append((tick, f"{tick:g}x"))
        tick *= 10
    marks = [f'<line x1="{frame.x(1.0):.1f}" y1="{frame.top}" x2="{frame.x(1.0):.1f}" y2="{frame.bottom}" '
             f'stroke="#aaa" stroke-dasharray="4 3"/>']
    marks += [f'<circle class="mark" data-group="{_e(r.group)}" data-problem="{_e(r.problem)}" '
              f'data-speedup="{r.result.speedup}" data-roofline="{r.result.roofline_fraction}" '
              f'cx="{frame.x(r.result.speedup):.1f}" cy="{frame.y(r.result.roofline_fraction):.1f}" r="5" '
              f'fill="{colors[r.group]}" fill-opacity="0.8"><title>{_e(r.group)} {_e(r.problem)}: '
              f"{times(r.result.speedup)}, {percent(r.result.roofline_fraction)} of roofline</title></circle>"
              for r in points]
    return _svg("scatter", frame.axes(x_ticks, _PERCENT_TICKS, "speedup over the reference", "% of roofline")
                + "".join(marks) + _legend([(g, colors[g]) for g in report.groups]), "speedup vs % of roofline")


def _strip(report: Report, colors: dict[str, str], name: str) -> str:
    """One column per set, a dot per correct sample (pkb's protocol): its speedup (log axis) or its % of
    roofline; a bar at the set's geometric mean speedup or median % of roofline."""
    speed = name == "speedup-by-set"
    value_of = (lambda r: gpu_speedup(r) if gpu_speedup(r) and gpu_speedup(r) > 0 else None) if speed else \
        (lambda r: r.result.roofline_fraction if gpu_speedup(r) is not None else None)
    points = {g: [(r, value_of(r)) for r in report.records if r.group == g and not r.is_reference
                  and r.status is Status.OK and value_of(r) is not None and r.problem in report.problems]
              for g in report.groups}
    values = [v for ps in points.values() for _, v in ps]
    if not values:
        return _NoPlot(name, "no correct result was timed on GPUs (`pkb run --perf --mode cuda` times them)" if speed
                       else "no correct result has a % of roofline (it needs a result timed on GPUs)")
    if speed:
        low = 10 ** math.floor(math.log10(min(min(values), 1.0)))
        high = 10 ** math.ceil(math.log10(max(max(values), 1.0) * 1.0001))
        frame = _Frame((0, len(report.groups)), (math.log10(low), math.log10(high)), names=list(report.groups))
        y_of = lambda v: frame.y(math.log10(v))  # noqa: E731
        y_ticks, tick = [], low
        while tick <= high * 1.0001:
            y_ticks.append((math.log10(tick), f"{tick:g}x"))
            tick *= 10
        out = [f'<line x1="{frame.left}" y1="{y_of(1.0):.1f}" x2="{frame.right}" y2="{y_of(1.0):.1f}" '
               'stroke="#aaa" stroke-dasharray="4 3"/>']
    else:
        frame = _Frame((0, len(report.groups)), (0, max(1.0, max(values))), names=list(report.groups))
        y_of, y_ticks, out = frame.y, _PERCENT_TICKS, []
    band = (frame.right - frame.left) / len(report.groups)
    for i, group in enumerate(report.groups):
        for j, (record, value) in enumerate(points[group]):
            x = frame.left + band * (i + 0.2 + 0.6 * ((j * 0.618034) % 1.0))
            label = times(value) if speed else percent(value)
            out.append(f'<circle class="mark" data-group="{_e(group)}" data-problem="{_e(record.problem)}" '
                       f'data-value="{value}" cx="{x:.1f}" cy="{y_of(value):.1f}" r="4" fill="{colors[group]}" '
                       f'fill-opacity="0.75"><title>{_e(group)} {_e(record.problem)}: {label}</title></circle>')
        m = report.overall[group]
        summary = m.geomean_speedup if speed else m.roofline.quantiles.get("median")
        if summary is not None:
            y, x0, x1 = y_of(summary), frame.left + band * (i + 0.1), frame.left + band * (i + 0.9)
            out.append(f'<line class="summary" data-group="{_e(group)}" data-value="{summary}" x1="{x0:.1f}" '
                       f'y1="{y:.1f}" x2="{x1:.1f}" y2="{y:.1f}" stroke="#222" stroke-width="2"/>')
    axis = "speedup over the reference" if speed else "% of roofline"
    return _svg(name, frame.axes(frame.names, y_ticks, report.group_by, axis) + "".join(out)
                + _legend([(g, colors[g]) for g in report.groups]), axis + " by set", frame.height)


def _protocol_bars(report: Report, colors: dict[str, str]) -> str:
    """Per category, per set: pass@1 on the paper's protocol (solid) beside pkb's (light)."""
    if not report.groups:
        return _NoPlot("protocols", "no candidate results")
    categories = _covered_categories(report)
    if not categories:
        return _NoPlot("protocols", "no category has a result")
    top, ticks = _percent_axis([report.on_category(protocol)[group][category].pass_at_k.get(1, 0.0)
                                for protocol in ("paper", "pkb") for group in report.groups for category in categories])
    frame = _Frame((0, len(categories)), (0, top), names=list(categories))
    band = (frame.right - frame.left) / len(categories)
    width = band * 0.8 / (2 * len(report.groups))
    out = []
    for i, category in enumerate(categories):
        for j, group in enumerate(report.groups):
            for k, (protocol, opacity) in enumerate((("paper", 1.0), ("pkb", 0.45))):
                value = report.on_category(protocol)[group][category].pass_at_k.get(1, 0.0)
                x = frame.left + band * (i + 0.1) + width * (2 * j + k)
                out.append(f'<rect class="mark" data-group="{_e(group)}" data-category="{_e(category)}" '
                           f'data-protocol="{protocol}" data-value="{value}" x="{x:.1f}" y="{frame.y(value):.1f}" '
                           f'width="{width * 0.95:.1f}" height="{frame.bottom - frame.y(value):.1f}" '
                           f'fill="{colors[group]}" fill-opacity="{opacity}"><title>{_e(group)} {_e(category)} '
                           f"pass@1 ({protocol}) {percent(value)}</title></rect>")
    legend = _legend([(g, colors[g]) for g in report.groups] + [("paper: solid", "#555"), ("pkb: light", "#bbb")])
    return _svg("protocols", frame.axes(frame.names, ticks, "category", "pass@1") + "".join(out) + legend,
                "correct on the upstream cases against correct on every case, per category", frame.height, top)


def _roofline_histogram(report: Report, colors: dict[str, str]) -> str:
    summaries = {g: m.roofline for g, m in report.overall.items() if m.roofline.count}
    if not summaries:
        return _NoPlot("roofline", "no correct result has a % of roofline")
    labels = [label for label, _ in next(iter(summaries.values())).histogram]
    most = max(n for s in summaries.values() for _, n in s.histogram) or 1
    frame = _Frame((0, len(labels)), (0, most))
    band = (frame.right - frame.left) / len(labels)
    width = band * 0.8 / len(summaries)
    out = []
    for j, (group, summary) in enumerate(summaries.items()):
        for i, (label, count) in enumerate(summary.histogram):
            if count:
                x = frame.left + band * (i + 0.1) + width * j
                out.append(f'<rect class="mark" data-group="{_e(group)}" data-bin="{label}" data-value="{count}" '
                           f'x="{x:.1f}" y="{frame.y(count):.1f}" width="{width:.1f}" '
                           f'height="{frame.bottom - frame.y(count):.1f}" fill="{colors[group]}">'
                           f"<title>{_e(group)} {label}: {count}</title></rect>")
    step = max(1, math.ceil(most / 5))
    x_ticks = [(i + 0.5, label.split("-")[0].rstrip("%")) for i, label in enumerate(labels)]
    return _svg("roofline", frame.axes(x_ticks, [(v, str(v)) for v in range(0, most + 1, step)],
                                       "% of roofline (bin start)", "correct results")
                + "".join(out) + _legend([(g, colors[g]) for g in summaries]), "% of roofline histogram")


# -- small helpers -------------------------------------------------------------------------------------


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _num(group: str, metric: str, value, text: str) -> str:
    data = "" if value is None else f' data-value="{value}"'
    return f'<td class="num" data-group="{_e(group)}" data-metric="{_e(metric)}"{data}>{_e(text)}</td>'


def _status(status: Status) -> str:
    return f'<span class="status" style="background:{STATUS_COLORS[status]}">{status.value}</span>'
