"""``pkb serve``'s HTTP + JSON API (Starlette on uvicorn) over an ``EvaluationService``; docs/serve.md.

    POST /v1/evaluations[?wait=S]        an EvaluationRequest (pkb.options: the options of ``pkb eval``, the candidate as text):
                                         200 with the verdict when it finishes within S seconds, else 202
                                         with the evaluation's id; 400 for a request that cannot run as asked
                                         (a body that is not UTF-8 JSON, an option out of range); 429 when the
                                         queue is full
    GET  /v1/evaluations/{id}[?wait=S]   the evaluation: state (queued, running, done) and, when done, the
                                         result (the JSON of ``pkb eval --json``)
    GET  /v1/problems                    every problem: name, number, category, world sizes, precisions
    GET  /v1/problems/{id}               one problem: its reference, cases (with tags) and cost per case
    GET  /v1/problems/{id}/prompt        what ``pkb prompt`` builds (?backend=&world_size=&nodes=&dtype=&hardware=)
    GET  /v1/health                      queue depth and the executor

With a token, every request must carry ``Authorization: Bearer <token>`` (401 otherwise). Bodies over
``MAX_BODY_BYTES`` are refused (413).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import inspect
import json
import time
import traceback

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.routing import Route

from pkb.options import EvaluationRequest
from pkb.serve.service import Busy, EvaluationService, RequestError

MAX_BODY_BYTES = 2 << 20
MAX_WAIT_S = 600.0


def create_app(service: EvaluationService, token: str | None = None) -> Starlette:
    def guarded(handler):
        async def endpoint(http: HttpRequest) -> Response:
            if token is not None:
                given = http.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                    return _json({"error": "missing or wrong token: send `Authorization: Bearer <token>`"}, 401)
            try:
                return await handler(http)
            except RequestError as exc:
                return _json({"error": str(exc)}, 400)
            except Busy as exc:
                return _json({"error": str(exc)}, 429, {"Retry-After": "1"})
            except Exception as exc:  # pkb's own failure: said so to the client, its traceback in the server's log
                traceback.print_exc()
                return _json({"error": f"pkb serve failed: {type(exc).__name__}: {exc} (its traceback is in the "
                                       "server's log)"}, 500)
        return endpoint

    async def submit(http: HttpRequest) -> Response:
        declared = http.headers.get("content-length")
        if declared is not None and not declared.strip().isdigit():
            raise RequestError(f"Content-Length {declared!r} is not a number of bytes")
        if declared is not None and int(declared) > MAX_BODY_BYTES:
            return _json({"error": f"the body is over {MAX_BODY_BYTES} bytes"}, 413)
        body = bytearray()
        async for chunk in http.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                return _json({"error": f"the body is over {MAX_BODY_BYTES} bytes"}, 413)
        try:
            payload = json.loads(bytes(body).decode("utf-8") if body else "null")
        except UnicodeDecodeError as exc:
            raise RequestError(f"the body is not UTF-8 text (byte {exc.start}): send JSON encoded as UTF-8") from None
        except json.JSONDecodeError as exc:
            raise RequestError(f"the body is not JSON: {exc}") from None
        try:
            request = EvaluationRequest.from_json(payload)
        except (TypeError, ValueError) as exc:
            raise RequestError(str(exc)) from None
        served = await asyncio.to_thread(service.submit, request)
        return await _answer(served, _wait_s(http))

    async def get_evaluation(http: HttpRequest) -> Response:
        served = service.evaluation(http.path_params["evaluation_id"])
        if served is None:
            return _json({"error": "no such evaluation (finished evaluations are kept for a while; the results "
                                   "database keeps every verdict)"}, 404)
        return await _answer(served, _wait_s(http))

    async def problems(http: HttpRequest) -> Response:
        from pkb.registry import all_problems

        return _json([_summary(p) for p in all_problems().values()])

    async def problem(http: HttpRequest) -> Response:
        found = _problem(http.path_params["problem"])
        cases = []
        for kind in ("upstream", "tests", "benchmarks"):
            for case in getattr(found, kind):
                world_size = next((w for w in found.world_sizes if case.runs_at(w)), None)
                cost = dataclasses.asdict(found.cost(case.at_precision("bf16"), world_size)) if world_size else None
                cases.append({"name": case.name, "kind": kind, "params": dict(case.params), "tags": list(case.tags),
                              "world_sizes": list(case.world_sizes or found.world_sizes), "note": case.note,
                              "cost_at": world_size, "cost": cost})
        return _json({**_summary(found), "source": found.source, "arguments": list(found.argument_names),
                      "reference": inspect.getsource(found.reference), "cases": cases,
                      "local_answer": found.local_answer})

    async def prompt(http: HttpRequest) -> Response:
        from pkb.generate.prompt import PromptError, load_profile
        from pkb.generate.upstream_prompt import prompt_for

        found = _problem(http.path_params["problem"])
        query = http.query_params
        try:
            world_size = int(query["world_size"]) if "world_size" in query else None
            built = prompt_for(found, query.get("backend", "cuda"), load_profile(query.get("hardware")), world_size,
                               precision=query.get("dtype"), nodes=int(query["nodes"]) if "nodes" in query else None)
        except (PromptError, ValueError, KeyError) as exc:
            raise RequestError(str(exc)) from None
        return _json({"system": built.system, "user": built.user, "problem": built.problem, "case": built.case,
                      "world_size": built.world_size, "backend": built.backend, "precision": built.precision})

    async def health(http: HttpRequest) -> Response:
        return _json(service.health())

    routes = [
        Route("/v1/evaluations", guarded(submit), methods=["POST"]),
        Route("/v1/evaluations/{evaluation_id}", guarded(get_evaluation), methods=["GET"]),
        Route("/v1/problems", guarded(problems), methods=["GET"]),
        Route("/v1/problems/{problem}", guarded(problem), methods=["GET"]),
        Route("/v1/problems/{problem}/prompt", guarded(prompt), methods=["GET"]),
        Route("/v1/health", guarded(health), methods=["GET"]),
    ]
    return Starlette(routes=routes)


async def _answer(served, wait_s: float) -> Response:
    deadline = time.monotonic() + wait_s
    while not served.done.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    return _json(served.to_json(), 200 if served.done.is_set() else 202)


def _wait_s(http: HttpRequest) -> float:
    try:
        return min(max(float(http.query_params.get("wait", 0)), 0.0), MAX_WAIT_S)
    except ValueError:
        raise RequestError("`wait` is a number of seconds") from None


def _problem(name: str):
    from pkb.registry import get_problem

    try:
        return get_problem(name)
    except KeyError as exc:
        raise RequestError(str(exc.args[0])) from None


def _summary(problem) -> dict:
    return {"name": problem.name, "number": problem.upstream_id, "category": problem.category,
            "world_sizes": list(problem.world_sizes), "precisions": list(problem.precisions)}


def _json(value, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json.dumps(value, default=str), status, headers, media_type="application/json")
