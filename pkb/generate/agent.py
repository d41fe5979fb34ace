"""``pkb agent``: multi-turn refinement of one problem's solution.

Step 0 sends the prompt; every later step sends the verdict of the model's last file (the
compiler's errors, the rank, case and elements of a mismatch, a timeout's rank log, the speedup per
case and the % of roofline when known) in the same conversation, and the model answers with a new
file. Each file is written to ``<out>/<run>/<problem>/step_<k>.py`` and evaluated; the best file
(correct, then fastest; the earlier on a tie) is copied to ``best.py``. Every step is a
``generations`` row (kind ``agent``) holding the message sent and the answer, so the transcript is
the rows in step order, and a rerun continues the conversation where it stopped.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from pkb.generate.prompt import Prompt, feedback
from pkb.generate.upstream_prompt import prompt_for
from pkb.generate.providers import CallContext, Message, Provider, ProviderError
from pkb.generate.sampler import (UNANSWERED, GenStatus, RunSettings, VerdictQueue, generation_row, prompt_world_size,
                                  write_code)
from pkb.problem import Problem
from pkb.store.db import generated_set

KIND = "agent"


@dataclass(frozen=True)
class AgentSettings(RunSettings):
    num_steps: int = 10


@dataclass(frozen=True)
class AgentStep:
    step: int
    status: str
    code_path: str | None
    speedup: float | None
    message: str
    tokens_in: int | None
    tokens_out: int | None
    cost_usd: float | None
    resumed: bool = False


@dataclass(frozen=True)
class AgentOutcome:
    problem: str
    run: str
    steps: tuple[AgentStep, ...]
    best_step: int | None  # None: no correct file yet
    best_path: str | None
    best_speedup: float | None
    stopped_by: str = ""  # why the loop ended before num_steps (a provider error), else ""

    @property
    def cost_usd(self) -> float | None:
        costs = [s.cost_usd for s in self.steps if s.status not in UNANSWERED]
        return None if not costs or None in costs else sum(costs)

    def to_dict(self) -> dict:
        return {**asdict(self), "cost_usd": self.cost_usd}


@dataclass
class _Conversation:
    """The messages so far, the next message to send, and the best file."""

    messages: list[Message]
    next_message: str
    best: AgentStep | None = None

    def add(self, sent: str, answer: str, reply: str) -> None:
        self.messages += [Message("user", sent), Message("assistant", answer)]
        self.next_message = reply

    def consider(self, step: AgentStep) -> None:
        if step.status != "ok":
            return
        if self.best is None or _speed(step) > _speed(self.best):
            self.best = step


def run_agent(problem: Problem, provider: Provider, settings: AgentSettings, store, profile, eval_config,
              on_step: Callable[[AgentStep], None] = lambda step: None, executor=None) -> AgentOutcome:
    """Refine ``problem``'s solution for up to ``settings.num_steps`` steps (resuming a stored run); each
    step's file is evaluated on ``executor`` (pkb.executor; default: this machine) before the next step."""
    prompt = prompt_for(problem, settings.backend, profile, prompt_world_size(problem, settings, eval_config),
                        settings.prompt, settings.upstream_dir, precision=settings.precision)
    verdicts = VerdictQueue(store, eval_config, executor, settings.experiment)
    steps: list[AgentStep] = []
    stopped_by = ""
    try:
        conversation = _resume(problem, prompt, settings, store, verdicts, steps, on_step)
        for step in range(len(steps), settings.num_steps):
            sent = conversation.next_message
            try:
                answer = provider.complete(prompt.system, conversation.messages + [Message("user", sent)],
                                           settings.max_tokens, settings.temperature,
                                           CallContext(problem.name, problem.upstream_id, step=step, kind="step"))
            except ProviderError as exc:
                store.add_generation(generation_row(problem, prompt, provider, settings, KIND, 0, step, exc, sent))
                if exc.fatal:
                    raise
                stopped_by = f"step {step}: {exc} (run again to continue)"
                break
            row = generation_row(problem, prompt, provider, settings, KIND, 0, step, answer, sent)
            agent_step, result = _judge(problem, row, settings, store, verdicts, resumed=False)
            conversation.add(sent, answer.text, feedback(problem, step, result))
            conversation.consider(agent_step)
            steps.append(agent_step)
            on_step(agent_step)
    finally:
        verdicts.close()
    best = conversation.best
    best_path = None
    if best is not None:
        best_path = str(write_code(settings.run_dir / problem.name / "best.py", Path(best.code_path).read_text()))
    return AgentOutcome(problem.name, settings.run, tuple(steps), best.step if best else None, best_path,
                        best.speedup if best else None, stopped_by)


def _resume(problem: Problem, prompt: Prompt, settings: AgentSettings, store, verdicts: VerdictQueue,
            steps: list[AgentStep], on_step: Callable) -> _Conversation:
    """Rebuild the conversation from the stored steps of this run (a step judged late is judged now)."""
    conversation = _Conversation([], prompt.user)
    stored = {}
    for row in store.generations(run=settings.run, problem=problem.name):
        if row["kind"] == KIND and row["problem_version"] == problem.version and row["status"] not in UNANSWERED:
            stored[row["step"]] = row
    for step in range(len(stored)):
        row = stored.get(step)
        if row is None or step >= settings.num_steps:
            break
        agent_step, result = _judge(problem, row, settings, store, verdicts, resumed=True)
        conversation.add(row["prompt"], row["response"] or "", feedback(problem, step, result))
        conversation.consider(agent_step)
        steps.append(agent_step)
        on_step(agent_step)
    return conversation


def _judge(problem: Problem, row: dict, settings: AgentSettings, store, verdicts: VerdictQueue, resumed: bool):
    """Write, store and evaluate one step's file; the AgentStep and its EvalResult (None without code)."""
    path = settings.run_dir / problem.name / f"step_{row['step']}.py"
    if row["code"] is not None:
        row["code_path"] = str(write_code(path, row["code"]))
    if row.get("id") is None:
        row["id"] = store.add_generation(row)
    result = None
    if row["code"] is not None:
        if row["status"] == GenStatus.GENERATED or row.get("result_id") is None:
            result, result_id, key = verdicts.verdict_of(problem, Path(row["code_path"]), f"{settings.run}/{path.stem}",
                                                         generated_set(row["model"], settings.run))
            store.set_generation_verdict(row["id"], result.status.value, result_id, key, result.speedup)
        else:
            result = store.result_by_id(row["result_id"])
    step = AgentStep(step=row["step"], status=result.status.value if result else row["status"],
                     code_path=row["code_path"], speedup=result.speedup if result else None,
                     message=result.message if result else (row.get("error") or ""), tokens_in=row.get("tokens_in"),
                     tokens_out=row.get("tokens_out"), cost_usd=row.get("cost_usd"), resumed=resumed)
    return step, result


def _speed(step: AgentStep) -> float:
    return step.speedup if step.speedup is not None and math.isfinite(step.speedup) else 0.0
