"""A small client of ``pkb serve`` for trainers and scripts: the standard library only, no torch.

    from pkb.client import Client
    client = Client("http://127.0.0.1:PORT")           # the URL ``pkb serve`` printed
    result = client.evaluate("allgather", source)       # the JSON of ``pkb eval --json``
    result["status"], result["upstream_ok"]

``evaluate`` waits for the verdict (polling a long one); ``submit`` and ``evaluation`` leave the waiting to
the caller. A full queue (HTTP 429) is retried after the server's ``Retry-After`` until ``busy_timeout_s``.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from types import SimpleNamespace
from typing import Any

from pkb.options import request_options


class ServerError(RuntimeError):
    """The server refused the request or could not be reached; ``status`` is the HTTP status (0: none)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


class Client:
    def __init__(self, url: str, token: str | None = None, timeout_s: float = 660.0, busy_timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.busy_timeout_s = busy_timeout_s

    def evaluate(self, problem: str | int, source: str | None = None, wait_s: float = 3600.0, **options: Any) -> dict:
        """The verdict on ``source`` for ``problem`` (``source=None, reference=True``: the problem's reference
        against itself): ``options`` are those of ``pkb eval`` (world_size, mode, cases, trials,
        upstream_trials, dtype, perf, policy, timeout) plus ``name``, ``solution_set`` and ``experiment`` (default:
        the server's, service traffic). Waits up to ``wait_s``; ServerError if it has not finished by then."""
        deadline = time.monotonic() + wait_s
        served = self.submit(problem, source, wait_s=min(wait_s, 60.0), **options)
        while served["state"] != "done":
            if time.monotonic() > deadline:
                raise ServerError(f"evaluation {served['id']} has not finished after {wait_s:.0f} s")
            served = self.evaluation(served["id"], wait_s=min(60.0, max(deadline - time.monotonic(), 0.0)))
        return served["result"]

    def submit(self, problem: str | int, source: str | None = None, wait_s: float = 0.0, **options: Any) -> dict:
        """Queue an evaluation; where it stands (``id``, ``state``, and ``result`` once done) after ``wait_s``."""
        body = {"problem": str(problem), **({"source": source} if source is not None else {}),
                **request_options(**{k: v for k, v in options.items() if k != "reference"})}
        if options.get("reference"):
            body["reference"] = True
        started = time.monotonic()
        while True:
            try:
                return self._call("POST", f"/v1/evaluations?wait={wait_s}", body)
            except ServerError as exc:
                if exc.status != 429 or time.monotonic() - started > self.busy_timeout_s:
                    raise
                time.sleep(1.0)

    def evaluation(self, evaluation_id: str, wait_s: float = 0.0) -> dict:
        """Where the evaluation ``evaluation_id`` (``submit``'s ``id``) stands, after up to ``wait_s``."""
        return self._call("GET", f"/v1/evaluations/{urllib.parse.quote(evaluation_id)}?wait={wait_s}")

    def problems(self) -> list[dict]:
        return self._call("GET", "/v1/problems")

    def problem(self, problem: str | int) -> dict:
        return self._call("GET", f"/v1/problems/{urllib.parse.quote(str(problem))}")

    def prompt(self, problem: str | int, **query: Any) -> dict:
        """What ``pkb prompt`` builds: ``query`` takes backend, world_size, dtype and hardware."""
        suffix = ("?" + urllib.parse.urlencode(query)) if query else ""
        return self._call("GET", f"/v1/problems/{urllib.parse.quote(str(problem))}/prompt{suffix}")

    def health(self) -> dict:
        return self._call("GET", "/v1/health")

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", exc.reason)
            except (ValueError, AttributeError):
                message = exc.reason
            raise ServerError(f"{self.url}: HTTP {exc.code}: {message}", exc.code) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ServerError(f"{self.url}: cannot reach the server ({getattr(exc, 'reason', exc)}); is `pkb serve` "
                              "running there?") from None


def result_view(result: dict) -> SimpleNamespace:
    """A verdict's JSON (``pkb eval --json``, an evaluation's ``result``) with the attributes of the EvalResult it
    was made from that pkb's printers and messages read (``status.value``, ``ok``, ``timings[i].speedup``,
    ...), without importing torch as ``EvalResult.from_dict`` would."""
    from pkb.details import Details

    return SimpleNamespace(**{**result, "ok": result["status"] == "ok",
                              "status": SimpleNamespace(value=result["status"]),
                              "details": Details.from_dict(result.get("details")),
                              "timings": [SimpleNamespace(**timing) for timing in result.get("timings") or []]})
