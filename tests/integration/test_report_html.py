"""The HTML report opened in headless Chromium: it renders, the headline and the plots (the per-set ones
too) are drawn, the numbers are the database's.

Chromium comes from the system (scripts/ci-system-deps.sh installs Debian's ``chromium``); without it
these tests skip and say so. The headline's sandbox note is read from the rendered page without it
(tests/unit/test_report_html_notes.py).
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from pkb.options import Status
from pkb.report import html as report_html
from helpers.reports import EXPECTED, KNOWN_ROWS, SELECTION, Page, build, make_result, write_db

CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(name)), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH: install it with "
                                                             "`bash scripts/ci-system-deps.sh` (apt package chromium)")


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={tmp_path / 'chromium-profile'}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("html")
    source = "def solution(tensor):\n    return tensor.clone()  # <kept & escaped>\n"
    solution_file = tmp_path / "alpha_scatter.py"
    solution_file.write_text(source)
    rows = KNOWN_ROWS + [make_result("scatter", "alpha/scatter", Status.MISMATCH, source=source, upstream_ok=False,
                                     details={"solution_path": str(solution_file), "rank": 1})]
    report = build(write_db(tmp_path / "r.sqlite", rows), selection={**SELECTION, "scatter": "collectives"})
    page = report_html.write(report, tmp_path / "report.html", source="r.sqlite")
    return tmp_path, page, report, source


@needs_chromium
def test_report_renders_in_chromium_with_plots_and_the_database_numbers(rendered):
    tmp_path, page, report, source = rendered
    dom = chromium(tmp_path, "--dump-dom", page.as_uri())
    assert dom.returncode == 0 and "<svg" in dom.stdout, dom.stderr[-2000:]
    parsed = Page()
    parsed.feed(dom.stdout)

    assert parsed.plots == ["leaderboard", "speedup-by-set", "roofline-by-set", "protocols", "fast-p", "verdicts",
                            "scatter", "roofline"]
    assert parsed.marks[("leaderboard", "rect")] == 2 * 2  # pass@1 and fast_1 per group
    assert parsed.marks[("fast-p", "circle")] == 2 * 6  # six thresholds per group
    # alpha: ok, mismatch, skipped; beta: ok, compile_error, timeout (its runtime_error was rerun)
    assert parsed.marks[("verdicts", "rect")] == 6
    assert parsed.marks[("scatter", "circle")] == 4  # correct results with a speedup and a % of roofline
    stacks = {(a["data-group"], a["data-status"]): int(a["data-value"]) for p, a in parsed.mark_attrs if p == "verdicts"}
    assert stacks[("alpha", "mismatch")] == 2 and stacks[("beta", "timeout")] == 1

    # 6 problems now (scatter added, a second alpha mismatch): numbers recomputed by hand
    alpha_pass = 3 / 5
    assert parsed.cells[("alpha", "pass@1")] == (str(alpha_pass), "60.0%")
    assert parsed.cells[("beta", "pass@1")] == (str(1 / 6), "16.7%")
    assert parsed.cells[("alpha", "fast_1")] == (str(2 / 5), "40.0%")
    assert float(parsed.cells[("alpha", "geomean_speedup")][0]) == pytest.approx(EXPECTED["alpha"]["geomean_speedup"])
    assert parsed.cells[("alpha", "geomean_speedup")][1] == "1.34x"
    assert parsed.cells[("beta", "median_roofline")][1] == "90.0%"
    assert parsed.cells[("beta", "failures.compile_error")][0] == "1"
    assert parsed.cells[("alpha", "tensor_parallel.pass@1")][1] == "100.0%"
    assert parsed.cells[("alpha", "collectives.problems")][1] == "4"  # reduce was only skipped

    # the headline: the self-check, then each set on both protocols (alpha's broadcast is ok on the upstream cases)
    assert parsed.cells[("reference", "self_check.ok")] == ("1", "1")
    assert parsed.cells[("reference", "self_check.checked")] == ("1", "1")
    assert parsed.cells[("alpha", "headline.paper.pass@1")] == (str(4 / 5), "80.0%")
    assert parsed.cells[("alpha", "headline.pkb.pass@1")] == (str(alpha_pass), "60.0%")
    assert parsed.cells[("beta", "headline.paper.pass@1")] == (str(1 / 6), "16.7%")
    assert parsed.cells[("alpha", "headline.covers")][1] == "6 of 6, 1 left out"  # reduce was only skipped
    assert parsed.cells[("alpha", "collectives.paper.pass@1")][1] == "75.0%"

    for problem in ("allreduce", "allgather", "broadcast", "reduce", "layernorm_backward", "scatter"):
        assert f"problem-{problem}" in parsed.ids
    commands = [code for code in parsed.codes if code.startswith("pkb report ")]  # the partial sets' note says one
    assert commands == ["pkb report --problems 1-5,9 --html FILE"]
    # the one stored, unchanged solution file, escaped and read back intact
    assert [code for code in parsed.codes if code not in commands] == [source]
    assert dom.stdout.count("code unavailable: the result row records no path") == 8


@needs_chromium
def test_the_per_set_plots_hold_every_correct_sample_and_both_protocols_per_category(rendered):
    tmp_path, page, report, _ = rendered
    dom = chromium(tmp_path, "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    parsed = Page()
    parsed.feed(dom.stdout)
    marks = lambda plot: [a for p, a in parsed.mark_attrs if p == plot]  # noqa: E731
    # correct, timed samples of each set (the rows of KNOWN_ROWS with an ok verdict)
    assert sorted((a["data-group"], float(a["data-value"])) for a in marks("speedup-by-set")) == [
        ("alpha", 0.8), ("alpha", 1.2), ("alpha", 2.5), ("beta", 1.6)]
    assert sorted((a["data-group"], float(a["data-value"])) for a in marks("roofline-by-set")) == [
        ("alpha", 0.3), ("alpha", 0.55), ("alpha", 0.8), ("beta", 0.9)]
    assert dom.stdout.count('class="summary"') == 4  # a geomean and a median bar per set
    bars = {(a["data-group"], a["data-category"], a["data-protocol"]): float(a["data-value"])
            for a in marks("protocols")}
    assert len(bars) == 2 * 2 * 2  # groups x categories x protocols
    # collectives: alpha has allreduce, allgather ok; broadcast ok on the upstream cases only; reduce only skipped
    assert bars[("alpha", "collectives", "paper")] == pytest.approx(3 / 4)
    assert bars[("alpha", "collectives", "pkb")] == pytest.approx(2 / 4)
    assert bars[("beta", "collectives", "paper")] == pytest.approx(1 / 5) == bars[("beta", "collectives", "pkb")]
    assert bars[("alpha", "tensor_parallel", "paper")] == 1.0 and bars[("beta", "tensor_parallel", "pkb")] == 0.0


@needs_chromium
def test_report_screenshot_shows_the_plots(rendered):
    image_module = pytest.importorskip("PIL.Image", reason="pip install 'pkb[test]' (pillow) to read the screenshot")
    tmp_path, page, report, _ = rendered
    shot = tmp_path / "shot.png"
    done = chromium(tmp_path, f"--screenshot={shot}", "--window-size=1400,3000", page.as_uri())
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = image_module.open(shot).convert("RGB")
    assert image.size == (1400, 3000)
    colors = Counter({color: count for count, color in image.getcolors(maxcolors=image.width * image.height)})
    assert len(colors) > 50, "the screenshot is (nearly) blank"

    def pixels_near(hex_color: str, tolerance: int = 6) -> int:
        target = tuple(int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
        return sum(n for color, n in colors.items() if all(abs(a - b) <= tolerance for a, b in zip(color, target)))

    # filled bars of each group's colour and of the verdict colours are on screen, not just in the DOM
    group_colors = report_html.PALETTE[:2]
    assert all(pixels_near(color) > 2000 for color in group_colors)
    assert pixels_near(report_html.STATUS_COLORS[Status.OK]) > 2000
    assert pixels_near(report_html.STATUS_COLORS[Status.TIMEOUT]) > 1000

    def over_white(hex_color: str, opacity: float) -> str:
        return "#" + "".join(f"{round(255 - opacity * (255 - int(hex_color[i:i + 2], 16))):02x}" for i in (1, 3, 5))

    # the per-category protocol bars: pkb's (light, at that plot's opacity alone) are on screen for both sets
    assert all(pixels_near(over_white(color, 0.45), tolerance=3) > 1000 for color in group_colors)
