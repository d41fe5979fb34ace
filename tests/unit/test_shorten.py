"""Text pkb shortens for display is never cut inside a word or a number, always ends (or starts) with a visible
ellipsis, and the whole of it is one step away (issue 54: the "results that need a look" block of `pkb run` ended
at `(expected 1.24219, g`, HTML cells stopped mid-sentence). One helper, pkb.console.shorten, used by `pkb run`
(tests/unit/test_usage_errors.py), the verdict's rank output, the HTML report's cells and labels, `pkb
generate`/`pkb agent` and `pkb transcripts`."""

from __future__ import annotations

import re

from pkb.console import ELLIPSIS, shorten
from pkb.evaluate.result import Details

MESSAGE = ("fails pkb's rule and upstream's: rank 0, case upstream, trial 0: out: 1012477 of 1048576 elements off "
           "(atol=0.0625, rtol=0.015625); largest abs error 8.598 at [337, 806] (expected 1.24219, got 0.535156); "
           "largest rel error -1.5e-05 at openai-gpt-5/sample_0")
# every word and number of MESSAGE: a cut may fall between them, never inside one
TOKENS = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|\w+")


def test_a_cut_falls_between_words_and_numbers_and_says_so():
    whole = {(m.start(), m.end()) for m in TOKENS.finditer(MESSAGE)}
    for limit in range(8, len(MESSAGE)):
        shown = shorten(MESSAGE, limit)
        assert len(shown) <= limit and shown.endswith(ELLIPSIS)
        kept = shown[:-1]
        assert MESSAGE.startswith(kept)
        assert not any(start < len(kept) < end for start, end in whole), (limit, shown)  # no token cut in two
    assert shorten(MESSAGE, len(MESSAGE)) == MESSAGE  # whole where it fits


def test_the_examples_of_the_issue_and_the_tail_of_a_log():
    assert shorten("largest abs error 8.598 at [337, 806] (expected 1.24219, got 0.535156)", 60) == \
        "largest abs error 8.598 at [337, 806] (expected 1.24219" + ELLIPSIS
    assert shorten("a message\nover two lines", 40) == "a message over two lines"  # fits: whole, lines joined
    log = "\n".join(f"rank {r}: line {i} of its output" for r in range(2) for i in range(30))
    tail = shorten(log, 200, keep="end", one_line=False)
    assert tail.startswith(ELLIPSIS + "rank 1: line") and log.endswith(tail[1:]) and len(tail) <= 200
    assert tail[1:].splitlines()[0] in log.splitlines()  # it starts at a whole line
    assert shorten("x" * 50, 10) == "x" * 9 + ELLIPSIS  # one token longer than the room: the only cut inside


def test_an_html_cell_is_shortened_with_the_whole_message_one_click_away(tmp_path):
    from pkb.options import Status
    from pkb.report import html as report_html
    from helpers.reports import build, make_result, write_db

    row = make_result("allreduce", "mine/allreduce", Status.MISMATCH, upstream_ok=False)
    row.message = MESSAGE
    page = report_html.render(build(write_db(tmp_path / "r.sqlite", [row])))
    (cell,) = re.findall(r'<a class="shortened" href="#result-(\d+)" title="([^"]*)">([^<]*)</a>', page)
    result_id, title, shown = cell
    assert shown == shorten(MESSAGE, report_html.CELL_CHARS).replace("'", "&#x27;") and shown.endswith(ELLIPSIS)
    assert title == MESSAGE.replace("'", "&#x27;")
    details = re.search(rf'<details id="result-{result_id}">.*?</details>', page, re.S).group(0)
    assert f"<p>{title}</p>" in details  # the row's details hold it whole


def test_a_verdicts_rank_output_keeps_its_last_whole_lines(capsys):
    from types import SimpleNamespace

    from pkb.cli import LOG_TAIL_CHARS, print_verdict

    log = "\n".join(f"[rank 1] step {i}: waiting for 1.24219 ms" for i in range(200))
    result = SimpleNamespace(problem="allreduce", solution="hang", status=SimpleNamespace(value="timeout"), mode="cpu",
                             world_size=2, wall_s=10.0, message="rank 1 timed out", details=Details(log_tail=log),
                             timings=[], times_are_gpu_performance=False)
    print_verdict(result)
    shown = capsys.readouterr().out.split("rank output (tail):\n")[1].splitlines()
    assert shown[0] == "    " + ELLIPSIS + "[rank 1] step " + shown[0].split("step ")[1]
    assert shown[-1] == "    [rank 1] step 199: waiting for 1.24219 ms"
    assert all(line.strip(" " + ELLIPSIS) in log.splitlines() for line in shown)
    assert sum(len(line) - 4 for line in shown) <= LOG_TAIL_CHARS
