"""An Inspect AI task on ``pkb serve``: the suite's prompts as samples, pkb's verdict as the score.

    pkb serve --url-file url.txt &
    export PKB_SERVE_URL="$(cat url.txt)"
    inspect eval pkb/pkb_kernels --model openai/gpt-4o -T categories=collectives -T max_turns=3

One sample per problem: its prompt as ``pkb prompt`` builds it (system and user message, fetched from the
service through ``pkb.client``, so this process never imports torch), for the problems that run at
``world_size`` in ``dtype``, chosen by name or number (``problems``) and by category (``categories``).
The solver asks the model, takes the file out of its answer (``pkb.generate.extract.extract_solution``)
and has the service judge it; with ``max_turns`` > 1 the verdict goes back as the next user message,
the one ``pkb agent`` sends (``pkb.generate.prompt.feedback``), until a file is ok or the turns run out.
The last verdict is the score: a dict of rewards in [0, 1] (``rewards``), each averaged over the samples
as a metric, with the verdict's JSON (what ``pkb eval --json`` prints) in the score's metadata. The
rewards are those of the ``verifiers`` environment (pkb.rl.verifiers_env), plus ``upstream_ok``.

Only what pkb or its executor saw itself fail (``harness_error``, ``infra_error``: no verdict on the file) is
evaluated again, up to ``no_verdict_retries`` times; after that the sample scores 0, the reason in its
explanation. Every status a candidate can cause (``skipped`` too) scores as a failure. Where the paper's verdict
was not checked, ``upstream_ok`` is NaN, Inspect's "unscored": left out of its mean, not a 0.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import anyio
from inspect_ai import Task, task
from inspect_ai.dataset import MemoryDataset, Sample
from inspect_ai.model import ChatMessageSystem, ChatMessageUser
from inspect_ai.scorer import Score, Target, mean, scorer
from inspect_ai.solver import Generate, TaskState, solver

from pkb.client import Client
from pkb.options import request_options
from pkb.protocol import DEFAULT_PRECISION
from pkb.rl.common import (NO_CODE, NO_VERDICT_RETRIES, REWARDS, choose_problems, client, judge, names, next_message,
                            rewards)

VERDICTS = "pkb_verdicts"  # the sample store's key: one verdict per turn (None: the answer had no code)
CODE = "pkb_code"  # the sample store's key: the last file extracted


@task
def pkb_kernels(server_url: str | None = None, problems: str | int | Sequence[str | int] | None = None,
                categories: str | Sequence[str] | None = None, world_size: int = 2, backend: str = "cuda",
                dtype: str = DEFAULT_PRECISION, mode: str = "cpu", max_turns: int = 1, perf: bool = False,
                cases: str | None = None, trials: int | None = None, upstream_trials: int | None = None,
                policy: str | None = None, timeout: float | None = None, hardware: str | None = None,
                log_speedup_cap: float = 3.0, solution_set: str = "rl",
                no_verdict_retries: int = NO_VERDICT_RETRIES) -> Task:
    """The suite's problems as an Inspect task judged by the ``pkb serve`` at ``server_url`` (default
    $PKB_SERVE_URL; its token, if it wants one, from $PKB_SERVE_TOKEN: never a task argument, which
    Inspect writes to its log).

    ``problems``: slugs or numbers (a list, or one string ``"1,2,allgather_gemm"``); ``categories``: the
    suite's (``collectives``, ...); both default to all. ``hardware``: the profile the prompt describes.
    ``mode`` to ``timeout`` and ``solution_set`` are ``pkb eval``'s options (None: the service's default);
    each file is stored as ``<problem>/<epoch>/<turn>``. ``log_speedup`` reaches 1 at 2**``log_speedup_cap``
    times the reference's speed. ``no_verdict_retries``: evaluations again of a file that got no verdict
    (``harness_error``, ``infra_error``) before it scores 0.
    """
    if max_turns < 1:
        raise ValueError("max_turns must be at least 1")
    if no_verdict_retries < 0:
        raise ValueError("no_verdict_retries must be 0 or more")
    options = request_options(world_size=world_size, mode=mode, dtype=dtype, perf=perf, cases=cases, trials=trials,
                              upstream_trials=upstream_trials, policy=policy, timeout=timeout, solution_set=solution_set)
    query = {"backend": backend, "world_size": world_size, "dtype": dtype}
    if hardware:
        query["hardware"] = hardware
    samples = pkb_samples(client(server_url), names(problems), names(categories), query)
    return Task(dataset=MemoryDataset(samples, name="pkb"),
                solver=judged_turns(server_url, options, max_turns, no_verdict_retries),
                scorer=pkb_verdict(log_speedup_cap), name="pkb_kernels",
                metadata={"server_url": server_url, **query, **options, "max_turns": max_turns,
                          "no_verdict_retries": no_verdict_retries})


def pkb_samples(client: Client, problems: list[str] | None, categories: list[str] | None, query: dict) -> list[Sample]:
    """One sample per chosen problem: its prompt as ``query`` asks (``GET /v1/problems/{id}/prompt``:
    backend, world_size, dtype, hardware)."""
    samples = []
    world_size, dtype = query["world_size"], query["dtype"]
    for summary in choose_problems(client.problems(), problems, categories, world_size, dtype):
        prompt = client.prompt(summary["name"], **query)
        samples.append(Sample(
            input=[ChatMessageSystem(content=prompt["system"]), ChatMessageUser(content=prompt["user"])],
            id=summary["name"],
            metadata={"problem": summary["name"], "number": summary["number"], "category": summary["category"],
                      "world_size": world_size, "backend": query["backend"], "dtype": dtype, "case": prompt["case"]}))
    return samples


@solver
def judged_turns(server_url: str, options: dict, max_turns: int = 1, no_verdict_retries: int = NO_VERDICT_RETRIES):
    """Generate, extract the file, have the ``pkb serve`` at ``server_url`` judge it with ``options``
    (``pkb eval``'s); with ``max_turns`` > 1, send the verdict back (``pkb agent``'s message) and ask again
    until a file is ok; a file that got no verdict is evaluated again up to ``no_verdict_retries`` times
    (pkb.rl.common.judge). Each turn's verdict goes to the sample's store under ``VERDICTS`` (None for an
    answer without code), the last file under ``CODE``."""
    service = client(server_url)
    arguments = functools.lru_cache(maxsize=None)(lambda name: tuple(service.problem(name)["arguments"]))

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        problem = state.metadata["problem"]
        verdicts: list[dict | None] = []
        for turn in range(max_turns):
            state = await generate(state)
            verdict = await anyio.to_thread.run_sync(functools.partial(
                judge, service, problem, state.output.completion, no_verdict_retries,
                name=f"{state.sample_id}/{state.epoch}/{turn}", **options))
            if verdict["status"] != NO_CODE:
                state.store.set(CODE, verdict.pop("code"))
            verdicts.append(None if verdict["status"] == NO_CODE else verdict)
            state.store.set(VERDICTS, verdicts)
            if verdict["status"] == "ok" or turn + 1 == max_turns or state.completed:
                break
            names_of = await anyio.to_thread.run_sync(arguments, problem)
            state.messages.append(ChatMessageUser(content=next_message(names_of, turn, verdict)))
        return state

    return solve


@scorer(metrics={name: [mean()] for name in REWARDS})
def pkb_verdict(log_speedup_cap: float = 3.0):
    """The rewards of the sample's last verdict (``rewards``), that verdict in the metadata; a reward the verdict
    does not give (``upstream_ok`` where the paper's verdict was not checked) is NaN, which Inspect counts as
    unscored: left out of the reward's mean (an ``EvalScore``'s ``unscored_samples``), not averaged in as a 0."""

    async def score(state: TaskState, target: Target) -> Score:
        verdicts = state.store.get(VERDICTS, [])
        verdict = verdicts[-1] if verdicts else None
        statuses = [v["status"] if v else "no_code" for v in verdicts]
        given = rewards(verdict, log_speedup_cap)
        return Score(value={name: given.get(name, math.nan) for name in REWARDS}, answer=state.store.get(CODE),
                     explanation=f"{statuses[-1] if statuses else 'no_code'}: "
                                 f"{verdict.get('message', '') if verdict else 'the answer had no code'}",
                     metadata={"verdict": verdict, "turns": len(verdicts), "statuses": statuses})

    return score
