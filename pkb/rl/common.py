"""What pkb's RL environments share, whichever framework runs them (pkb.rl.verifiers_env,
pkb.rl.inspect_task): the service's address, the choice of problems, one judged answer, its rewards and
the next message of a multi-turn conversation. The standard library and pkb's torch-free parts only.
"""

from __future__ import annotations

import difflib
import math
import os
from types import SimpleNamespace
from typing import Any, Sequence

from pkb.client import Client, result_view
from pkb.generate.extract import extract_solution
from pkb.generate.prompt import feedback
from pkb.options import rl_experiment
from pkb.serve.cli import TOKEN_ENV

SERVER_URL_ENV = "PKB_SERVE_URL"
REWARDS = ("correctness", "upstream_ok", "fast_1", "log_speedup", "roofline_fraction")
NO_CODE = "no_code"  # the answer held no file: nothing was sent to the service
NO_VERDICT = ("harness_error", "infra_error")  # pkb or its executor saw itself fail: the only statuses evaluated again
NO_VERDICT_RETRIES = 2  # evaluations again of a file that got no verdict, before it scores 0
# The paper's verdict was not reached because of the answer (no file, a file that declares what the run lacks) or
# pkb never gave one: counted as failed, as every reward counts them.
UNJUDGED = (NO_CODE, "skipped", *NO_VERDICT)


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
        close = [match for name in unknown for match in difflib.get_close_matches(name, list(by_name), n=1)]
        guess = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown problems {unknown}{guess} (give slugs or numbers: "
                         f"{', '.join(s['name'] for s in summaries)})")
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


def judge(service: Client, problem: str, answer: str, no_verdict_retries: int = NO_VERDICT_RETRIES,
          **options: Any) -> dict:
    """The verdict (the JSON of ``pkb eval --json``) on the file in a model's ``answer``: ``status`` no_code,
    without asking the service, when the answer holds none; a file that gets no verdict is evaluated again, up to
    ``no_verdict_retries`` times (``evaluate``). The service stores it in an RL experiment (``rl``, or ``rl:NAME``
    for an ``experiment`` in ``options``: RL traffic, which no report shows unless asked for, and whose turns are
    never samples of a set; docs/reports.md, "Experiments")."""
    extraction = extract_solution(answer)
    if extraction is None:
        return {"status": NO_CODE, "message": "the answer had no ```python block defining `solution`",
                "upstream_ok": None, "speedup": None, "roofline_fraction": None}
    options = {**options, "experiment": rl_experiment(options.get("experiment"))}
    verdict = evaluate(service, problem, extraction.code, no_verdict_retries, **options)
    return {**verdict, "code": extraction.code}


def evaluate(service: Client, problem: str, code: str, no_verdict_retries: int, **options: Any) -> dict:
    """The service's verdict on ``code``, with ``attempts``: how many evaluations it took. Only a verdict that is none
    on the file, ``harness_error`` or ``infra_error`` (pkb's own code or its executor saw itself fail), is asked for
    again, up to ``no_verdict_retries`` times, each stored as ``<name>/retry<n>``; still none after that, it stays
    that status, which scores 0 like any failure (a candidate may be what makes pkb fail, and a retry without end
    would be an escape from every penalty), its message saying so. Every other status is the file's verdict."""
    name = options.pop("name", "candidate")
    verdict, attempts = service.evaluate(problem, code, name=name, **options), 1
    while verdict["status"] in NO_VERDICT and attempts <= no_verdict_retries:
        verdict = service.evaluate(problem, code, name=f"{name}/retry{attempts}", **options)
        attempts += 1
    if verdict["status"] in NO_VERDICT:
        verdict = {**verdict, "message": f"no verdict on the file after {attempts} evaluations (pkb or its machine "
                                         f"failed each time), so it scores 0; the last: {verdict.get('message', '')}"}
    return {**verdict, "attempts": attempts}


def next_message(arguments: Sequence[str], step: int, verdict: dict) -> str:
    """The user message after the answer of ``step`` (from 0) was judged: the one ``pkb agent`` sends."""
    return feedback(SimpleNamespace(argument_names=list(arguments)), step,
                    None if verdict["status"] == NO_CODE else result_view(verdict))


def rewards(verdict: dict | None, log_speedup_cap: float = 3.0) -> dict[str, float]:
    """Each in [0, 1]; all 0 when the file is not ok by pkb's strict verdict, except ``upstream_ok``.
    ``verdict`` None: the answer held no file. No status a candidate can cause scores more than failing.

    - ``correctness``: ``status == "ok"`` (every case pkb checks, on every rank);
    - ``upstream_ok``: the paper's verdict (upstream's trials on its cases; docs/paper-protocol.md); left out
      where it was not checked on a file pkb judged (a run without upstream cases, ``cases="tests"``, or a
      problem without one), and 0 where pkb judged no file (``UNJUDGED``: no file, ``skipped``, no verdict);
    - ``fast_1``: correct and faster than the reference (needs ``perf``, and GPUs in cuda mode: a time measured in
      cpu or shared-gpu mode is not GPU performance and rewards nothing);
    - ``log_speedup``: clip(log2(speedup), 0, log_speedup_cap) / log_speedup_cap (the same);
    - ``roofline_fraction``: the fraction of the hardware roofline reached, clipped to [0, 1] (the same).

        >>> rewards({"status": "ok", "upstream_ok": True, "speedup": 2.0, "roofline_fraction": 0.4,
        ...          "times_are_gpu_performance": True}, 2.0)
        {'correctness': 1.0, 'upstream_ok': 1.0, 'fast_1': 1.0, 'log_speedup': 0.5, 'roofline_fraction': 0.4}
        >>> rewards({"status": "ok", "upstream_ok": None})  # cases="tests": the paper's verdict not checked
        {'correctness': 1.0, 'fast_1': 0.0, 'log_speedup': 0.0, 'roofline_fraction': 0.0}
    """
    verdict = verdict or {"status": NO_CODE}
    correct = verdict.get("status") == "ok"
    on_gpus = correct and verdict.get("times_are_gpu_performance") is True  # cpu and shared-gpu times are no speed
    speedup = verdict.get("speedup") if on_gpus else None
    timed = speedup is not None and math.isfinite(speedup) and speedup > 0
    roofline = verdict.get("roofline_fraction") if on_gpus else None
    paper = verdict.get("upstream_ok")
    checked = paper is not None or verdict.get("status") in UNJUDGED
    return {"correctness": float(correct),
            **({"upstream_ok": float(paper is True)} if checked else {}),
            "fast_1": float(timed and speedup > 1.0),
            "log_speedup": min(max(math.log2(speedup), 0.0), log_speedup_cap) / log_speedup_cap if timed else 0.0,
            "roofline_fraction": min(max(float(roofline), 0.0), 1.0) if roofline is not None else 0.0}
