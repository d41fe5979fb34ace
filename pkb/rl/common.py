"""What pkb's RL environments share, whichever framework runs them (pkb.rl.verifiers_env,
pkb.rl.inspect_task): the service's address, the choice of problems, one judged answer, its rewards and
the next message of a multi-turn conversation. The standard library and pkb's torch-free parts only.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace
from typing import Any, Sequence

from pkb.client import Client, result_view
from pkb.generate.extract import extract_solution
from pkb.generate.prompt import feedback
from pkb.serve.cli import TOKEN_ENV

SERVER_URL_ENV = "PKB_SERVE_URL"
REWARDS = ("correctness", "upstream_ok", "fast_1", "log_speedup", "roofline_fraction")
NO_CODE = "no_code"  # the answer held no file: nothing was sent to the service
NO_VERDICT = ("harness_error", "infra_error")  # pkb or the machine failed, not the candidate


class NoVerdict(RuntimeError):
    """The service gave no verdict on the file (pkb or its machine failed): the rollout or sample fails,
    rather than scoring 0, so that a trainer's retry takes it again."""


def client(server_url: str | None) -> Client:
    """A client of the ``pkb serve`` at ``server_url`` (default ``$PKB_SERVE_URL``; its token, if it wants one,
    from ``$PKB_SERVE_TOKEN``, never an argument that a framework would write to its logs)."""
    url = server_url or os.environ.get(SERVER_URL_ENV)
    if not url:
        raise ValueError(f"no pkb serve to judge answers: start one (`pkb serve --url-file url.txt`) and pass its "
                         f"URL as server_url, or set ${SERVER_URL_ENV}")
    return Client(url, token=os.environ.get(TOKEN_ENV) or None)


def names(value: str | int | Sequence[str | int] | None) -> list[str] | None:
    """``"1,2,allgather"`` or ``[1, 2, "allgather"]`` as ``["1", "2", "allgather"]``; None for all."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else [value] if isinstance(value, int) else value
    return [str(item).strip() for item in items if str(item).strip()] or None


def choose_problems(summaries: list[dict], problems: list[str] | None, categories: list[str] | None,
                    world_size: int, dtype: str) -> list[dict]:
    """The service's problem summaries (``GET /v1/problems``) asked for (slugs or numbers, categories; None:
    all) that run at ``world_size`` in ``dtype``; ValueError listing the valid choices for an unknown name or
    category, or naming the problems asked for by name that cannot run so."""
    by_name = {s["name"]: s for s in summaries} | {str(s["number"]): s for s in summaries if s["number"]}
    known_categories = sorted({s["category"] for s in summaries})
    unknown = [c for c in categories or [] if c not in known_categories]
    if unknown:
        raise ValueError(f"unknown categories {unknown}; the suite's: {', '.join(known_categories)}")
    unknown = [p for p in problems or [] if p not in by_name]
    if unknown:
        raise ValueError(f"unknown problems {unknown}; give slugs or numbers: {', '.join(s['name'] for s in summaries)}")
    runs = [s for s in summaries if world_size in s["world_sizes"] and dtype in s["precisions"]]
    if problems:
        named = [by_name[p] for p in problems]
        cannot = [s["name"] for s in named if s not in runs]
        if cannot:
            raise ValueError(f"{cannot} do not run at world size {world_size} in {dtype} (see GET /v1/problems)")
        runs = list({s["name"]: s for s in named}.values())
    chosen = [s for s in runs if categories is None or s["category"] in categories]
    if not chosen:
        raise ValueError(f"no problem of {categories or 'the suite'} runs at world size {world_size} in {dtype}")
    return chosen


def judge(service: Client, problem: str, answer: str, **options: Any) -> dict:
    """The verdict (the JSON of ``pkb eval --json``) on the file in a model's ``answer``: ``status`` no_code,
    without asking the service, when the answer holds none; NoVerdict when pkb or its machine failed."""
    extraction = extract_solution(answer)
    if extraction is None:
        return {"status": NO_CODE, "message": "the answer had no ```python block defining `solution`",
                "upstream_ok": None, "speedup": None, "roofline_fraction": None}
    verdict = service.evaluate(problem, extraction.code, **options)
    if verdict["status"] in NO_VERDICT:
        raise NoVerdict(f"{problem}: no verdict on the file ({verdict['status']}): {verdict.get('message', '')}")
    return {**verdict, "code": extraction.code}


def next_message(arguments: Sequence[str], step: int, verdict: dict) -> str:
    """The user message after the answer of ``step`` (from 0) was judged: the one ``pkb agent`` sends."""
    return feedback(SimpleNamespace(argument_names=list(arguments)), step,
                    None if verdict["status"] == NO_CODE else result_view(verdict))


def rewards(verdict: dict | None, log_speedup_cap: float = 3.0) -> dict[str, float]:
    """Each in [0, 1]; all 0 when the file is not ok by pkb's strict verdict, except ``upstream_ok``.

    - ``correctness``: ``status == "ok"`` (every case pkb checks, on every rank);
    - ``upstream_ok``: the paper's verdict (upstream's trials on its cases; docs/paper-protocol.md), 0 when
      no upstream case was checked (``cases="tests"``);
    - ``fast_1``: correct and faster than the reference (needs ``perf``);
    - ``log_speedup``: clip(log2(speedup), 0, log_speedup_cap) / log_speedup_cap (needs ``perf``);
    - ``roofline_fraction``: the fraction of the hardware roofline reached, clipped to [0, 1] (needs ``perf``).

        >>> rewards({"status": "ok", "upstream_ok": True, "speedup": 2.0, "roofline_fraction": 0.4}, 2.0)
        {'correctness': 1.0, 'upstream_ok': 1.0, 'fast_1': 1.0, 'log_speedup': 0.5, 'roofline_fraction': 0.4}
    """
    verdict = verdict or {}
    correct = verdict.get("status") == "ok"
    speedup = verdict.get("speedup") if correct else None
    timed = speedup is not None and math.isfinite(speedup) and speedup > 0
    roofline = verdict.get("roofline_fraction") if correct else None
    return {"correctness": float(correct),
            "upstream_ok": float(verdict.get("upstream_ok") is True),
            "fast_1": float(timed and speedup > 1.0),
            "log_speedup": min(max(math.log2(speedup), 0.0), log_speedup_cap) / log_speedup_cap if timed else 0.0,
            "roofline_fraction": min(max(float(roofline), 0.0), 1.0) if roofline is not None else 0.0}
