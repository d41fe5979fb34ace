"""What a model did, read back (issue 54: an agent run's turns were reachable only by SQL): each conversation's
turns with the message sent (the prompt, then the feedback), the answer and the verdict, from the generations
table and the results it links to, in the terminal and in the HTML report. The commands end to end, on a replayed
agent run: tests/integration/test_generate.py."""

from __future__ import annotations

import re

from pkb.console import ELLIPSIS
from pkb.options import Status
from pkb.report import html as report_html
from pkb.report import metrics, records, transcripts
from pkb.store.db import ResultStore, generated_set
from helpers.reports import SELECTION, make_result

PROMPT = "Write `solution(tensor)`: an all-reduce over every rank.\n" + "Details of the problem. " * 60
FEEDBACK = "Your file (step 0) was evaluated: **mismatch**: rank 0, case upstream: 3 of 8 elements off"


def agent_row(step: int, prompt: str, response: str | None, status: str, result_id: int | None, **more) -> dict:
    return dict(run="refined", kind="agent", model="replay:answers", provider="replay", problem="allreduce",
                problem_version=1, sample=0, step=step, backend="cuda", hardware="h100", world_size=2,
                case_name="upstream", max_tokens=100, system="You write kernels.", prompt=prompt, response=response,
                status=status, attempts=1, result_id=result_id, **more)


def agent_db(path):
    """An agent's three steps on allreduce (a mismatch, a call that failed and was retried, then ok) and one
    generated sample of another run."""
    with ResultStore(path) as store:
        agents = generated_set("replay:answers", "refined")  # the set an agent stores its verdicts under
        wrong = store.add(make_result("allreduce", "refined/step_0", Status.MISMATCH, upstream_ok=False,
                                      solution_set=agents), "k0")
        right = store.add(make_result("allreduce", "refined/step_1", Status.OK, 1.3, upstream_ok=True, mode="cpu",
                                      solution_set=agents), "k1")
        store.add_generation(agent_row(0, PROMPT, "```python\n# wrong\n```", "mismatch", wrong))
        store.add_generation(agent_row(1, FEEDBACK, None, "api_error", None, error="HTTP 500: try again"))
        store.add_generation(agent_row(1, FEEDBACK, "```python\n# right\n```", "ok", right))
        store.add_generation({**agent_row(0, "another prompt", "no code here", "no_code", None), "run": "other",
                              "kind": "sample"})
    return path


def test_a_transcript_is_each_turns_message_sent_answer_and_verdict(tmp_path):
    with ResultStore(agent_db(tmp_path / "r.sqlite")) as store:
        assert transcripts.runs(store) == ["other", "refined"]
        [transcript] = transcripts.load(store, "refined")
        [sample] = transcripts.load(store, "other", "allreduce")
    assert transcript.title == "allreduce (agent, 2 turns)" and transcript.system == "You write kernels."
    first, second = transcript.turns
    assert (first.sent_kind, first.sent, first.status) == ("prompt", PROMPT, "mismatch")
    assert first.message == "mismatch: allreduce by refined/step_0"  # the verdict's own message
    assert (second.sent_kind, second.sent, second.answer) == ("feedback", FEEDBACK, "```python\n# right\n```")
    assert (second.status, second.speedup, second.mode) == ("ok", 1.3, "cpu")  # the retry, not the failed call
    assert sample.title == "allreduce, sample 0" and sample.turns[0].status == "no_code"
    assert sample.turns[0].message == "the answer held no code block defining `solution`"

    text = transcripts.transcript_text(transcript)
    assert text.startswith("== refined: allreduce (agent, 2 turns), model replay:answers\n-- turn 0\n")
    assert f"  sent (prompt) ({len(PROMPT):,} characters; --full shows them all):" in text
    assert ELLIPSIS in text and PROMPT not in text
    assert "  sent (feedback):\n    " + FEEDBACK in text
    assert "  verdict: ok, speedup 1.30x (cpu mode: not GPU performance): ok: allreduce by refined/step_1" in text
    full = transcripts.transcript_text(transcript, full=True)
    assert "    " + PROMPT.splitlines()[1] in full and ELLIPSIS not in full


def test_the_html_report_has_a_section_per_run_with_every_turn_whole(tmp_path):
    path = agent_db(tmp_path / "r.sqlite")
    loaded = records.load(path, "set", records.Filter(problems=frozenset(SELECTION)), SELECTION)
    assert {r.run for r in loaded.records} == {"refined"}
    report = metrics.build_report(loaded.records, SELECTION, "set", (1,))
    with ResultStore(path) as store:
        shown = transcripts.load(store, "refined")
    page = report_html.render(report, transcripts=shown)
    section = re.search(r'<section class="run" id="run-refined".*?</section>', page, re.S).group(0)
    assert re.findall(r'data-step="(\d)" data-status="(\w+)"', section) == [("0", "mismatch"), ("1", "ok")]
    assert "Details of the problem. " * 60 in section and "# right" in section  # whole, in the page
    assert '<a href="#transcripts">transcripts</a>' in page
    assert "No generation or agent run" in report_html.render(report)
