"""What a model did, turn by turn: an agent's or a generation run's transcripts, read back from the results database.

Every model call of ``pkb generate`` and ``pkb agent`` is a ``generations`` row (pkb.store.db): the message sent
(``prompt``: the problem's prompt for a sample and for an agent's step 0, the feedback on the previous step's file
for every later step), the model's answer (``response``), the file extracted from it, and its status (the verdict
once judged; ``no_code``, ``api_error`` or ``generated`` before or instead of one), linked to the verdict's result
row (``result_id``), whose message says why. A ``Transcript`` is one conversation: a generated sample (one turn) or
an agent's refinement of one problem (a turn per step). ``pkb transcripts RUN [--problem P]`` prints them
(``transcript_text``: long texts shortened, whole with ``--full`` or ``--json``), and the HTML report has a section
per run whose results it shows (pkb.report.html).

Of several rows for one step (a call that failed, then its retry), the latest is the turn.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pkb.console import shorten
from pkb.store.db import ResultStore

SENT_CHARS, ANSWER_CHARS, MESSAGE_CHARS = 600, 1200, 400  # what the terminal shows of each without --full


@dataclass(frozen=True)
class Turn:
    """One model call and its verdict."""

    step: int
    sent: str  # the message sent: the problem's prompt (step 0) or the feedback on the previous step's file
    answer: str | None  # the model's answer; None where the call failed (``message`` says why)
    status: str  # the verdict on its file, or no_code, api_error, generated
    message: str  # the verdict's message, or why there is none
    speedup: float | None = None
    mode: str | None = None  # the mode the verdict was reached in (its speedup is GPU performance in cuda only)
    result_id: int | None = None

    @property
    def sent_kind(self) -> str:
        return "prompt" if self.step == 0 else "feedback"


@dataclass(frozen=True)
class Transcript:
    """One conversation of ``run``: a generated sample, or an agent's steps on one problem."""

    run: str
    kind: str  # "sample" (pkb generate) or "agent" (pkb agent)
    model: str
    problem: str
    sample: int
    system: str  # the system prompt every turn was sent with
    turns: tuple[Turn, ...]

    @property
    def title(self) -> str:
        """e.g. ``allreduce, sample 2`` or ``allreduce (agent, 3 turns)``."""
        if self.kind == "agent":
            return f"{self.problem} (agent, {len(self.turns)} turn{'s' * (len(self.turns) != 1)})"
        return f"{self.problem}, sample {self.sample}"

    def to_dict(self) -> dict:
        return asdict(self)


def runs(store: ResultStore) -> list[str]:
    """The generation runs in ``store``, the latest first."""
    return [run for (run,) in store.conn.execute("SELECT run FROM generations GROUP BY run ORDER BY MAX(id) DESC")]


def load(store: ResultStore, run: str, problem: str | None = None) -> list[Transcript]:
    """Every conversation of ``run`` (of one ``problem``, where given), by problem and sample, each turn's verdict
    read from the result row its generation links to."""
    latest: dict[tuple[str, int, int], dict] = {}
    for row in store.generations(run=run, problem=problem):
        latest[(row["problem"], row["sample"], row["step"])] = row  # oldest first: a retry replaces its failed call
    conversations: dict[tuple[str, int], list[dict]] = {}
    for (name, sample, _), row in sorted(latest.items()):
        conversations.setdefault((name, sample), []).append(row)
    return [Transcript(run=run, kind=rows[0]["kind"], model=rows[0]["model"], problem=name, sample=sample,
                       system=rows[0]["system"], turns=tuple(_turn(store, row) for row in rows))
            for (name, sample), rows in conversations.items()]


def _turn(store: ResultStore, row: dict) -> Turn:
    result = store.result_by_id(row["result_id"]) if row["result_id"] is not None else None
    if result is None:
        return Turn(row["step"], row["prompt"], row["response"], row["status"],
                    row["error"] or _unjudged(row["status"]))
    return Turn(row["step"], row["prompt"], row["response"], result.status.value, result.message, result.speedup,
                result.mode, row["result_id"])


def _unjudged(status: str) -> str:
    return {"generated": "not evaluated yet (generated with --no-eval; a rerun without it evaluates it)",
            "no_code": "the answer held no code block defining `solution`"}.get(status, "")


def transcript_text(transcript: Transcript, full: bool = False) -> str:
    """``transcript`` for the terminal: a heading, then each turn's message sent, answer and verdict, indented;
    long texts shortened (``pkb.console.shorten``) unless ``full``, with their length so that the reader knows."""
    def block(label: str, text: str | None, limit: int) -> list[str]:
        if text is None:
            return [f"  {label}: none"]
        shown = text if full else shorten(text, limit, one_line=False)
        size = "" if shown == text else f" ({len(text):,} characters; --full shows them all)"
        return [f"  {label}{size}:", *("    " + line for line in shown.splitlines())]

    lines = [f"== {transcript.run}: {transcript.title}, model {transcript.model}"]
    for turn in transcript.turns:
        lines.append(f"-- turn {turn.step}")
        lines += block(f"sent ({turn.sent_kind})", turn.sent, SENT_CHARS)
        lines += block("answer", turn.answer, ANSWER_CHARS)
        message = turn.message if full else shorten(turn.message, MESSAGE_CHARS)
        lines.append(f"  verdict: {turn.status}" + (f", speedup {speed_text(turn)}" if turn.speedup else "")
                     + (f": {message}" if message else ""))
    return "\n".join(lines)


def speed_text(turn: Turn) -> str:
    """A turn's speedup, labelled where it is not GPU performance, e.g. ``1.30x`` or ``0.84x (cpu mode: not GPU
    performance)``."""
    return f"{turn.speedup:.2f}x" + ("" if turn.mode == "cuda" else f" ({turn.mode} mode: not GPU performance)")
