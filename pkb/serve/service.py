"""The evaluation service's scheduler: requests in, verdicts out, one evaluation loop, one store writer.

``EvaluationService`` takes evaluation requests (what ``pkb eval`` takes, as a dict; pkb.options.EvaluationRequest) into a
bounded queue and answers ``Busy`` when it is full rather than growing without limit. One thread owns
everything that runs evaluations: it submits requests to pkb's evaluation loop (pkb.loop.EvaluationLoop,
the one ``pkb run`` and generation use), which hands them to an executor (pkb.executor: on this machine,
``LocalExecutor``, whose warm rank groups and shared build broker are reused across requests; or a Ray
cluster) and writes each verdict to the results database as it finishes, its only writer. Every request
is judged afresh (with its own secret seeds), never answered from an earlier row. The executor runs
correctness evaluations side by side up to its capacity and a timed one (``perf``) alone, with nothing
beside it (pkb.executor.local).

A finished evaluation is kept for ``keep_finished`` more (then only the database has it), so memory stays
flat over any number of requests. Each accepted request is a ``ServedEvaluation``: the request, where its
evaluation stands, and its result once done (what ``GET /v1/evaluations/{id}`` answers).
"""

from __future__ import annotations

import itertools
import re
import queue
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import OptionError, resolve
from pkb.executor import Evaluation, Executor
from pkb.loop import EvaluationLoop, StoredResult
from pkb.options import SERVED_EXPERIMENT, EvaluationRequest
from pkb.registry import get_problem
from pkb.store.db import ResultStore


class RequestError(ValueError):
    """A request pkb cannot run as asked; the message says what to change (HTTP 400)."""


class Busy(RuntimeError):
    """The queue is full (HTTP 429): retry later."""


@dataclass
class ServedEvaluation:
    """A request the service accepted, and where its evaluation stands (``state``, and ``result`` once done)."""

    id: str
    request: EvaluationRequest
    state: str = "queued"  # queued, running, done
    submitted: float = field(default_factory=time.time)
    result: dict | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def to_json(self) -> dict:
        return {"id": self.id, "state": self.state, "problem": self.request.problem, "name": self.request.name,
                "submitted": self.submitted, "result": self.result}


class EvaluationService:
    """Requests in, verdicts out (see the module docstring). ``sandbox``: every candidate's (pkb.runtime.sandbox);
    ``experiment``: the experiment of a request that names none (service traffic by default)."""

    def __init__(self, executor: Executor, db: str | Path, max_queue: int = 64, keep_finished: int = 10_000,
                 sandbox: str = "auto", experiment: str = SERVED_EXPERIMENT):
        ResultStore(db).close()  # a service that cannot store its verdicts refuses to start (StoreUnavailable)
        self.executor = executor
        self.experiment = experiment
        self.db = Path(db)
        self.max_queue = max_queue
        self.keep_finished = keep_finished
        self.sandbox = sandbox
        self._inbox: queue.Queue[tuple[ServedEvaluation, Evaluation] | None] = queue.Queue()
        self._served: OrderedDict[str, ServedEvaluation] = OrderedDict()
        self._waiting = 0  # accepted and not finished: what the queue bound counts
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._scratch = tempfile.TemporaryDirectory(prefix="pkb-serve-")
        self._loop = threading.Thread(target=self._run, name="pkb-serve-loop", daemon=True)
        self._loop.start()

    # -- what clients call -----------------------------------------------------------------------------

    def submit(self, request: EvaluationRequest) -> ServedEvaluation:
        """Queue ``request``: RequestError if it cannot run as asked, Busy if the queue is full."""
        evaluation = self._evaluation(request)
        with self._lock:
            if self._waiting >= self.max_queue:
                if evaluation.candidate.path is not None:
                    shutil.rmtree(evaluation.candidate.path.parent, ignore_errors=True)
                raise Busy(f"{self._waiting} evaluations are queued or running (the limit is {self.max_queue}): "
                           "retry later")
            served = ServedEvaluation(f"ev-{next(self._ids)}", request)
            self._waiting += 1
            self._served[served.id] = served
            while len(self._served) > self.keep_finished:
                oldest = next(iter(self._served.values()))
                if oldest.state != "done":
                    break
                self._served.popitem(last=False)
        self._inbox.put((served, replace(evaluation, tag=served)))
        return served

    def evaluation(self, evaluation_id: str) -> ServedEvaluation | None:
        with self._lock:
            return self._served.get(evaluation_id)

    def health(self) -> dict:
        with self._lock:
            waiting = self._waiting
        return {"ok": not self._stop.is_set(), "queued_or_running": waiting, "max_queue": self.max_queue,
                "executor": getattr(self.executor, "describe", lambda: self.executor.name)()}

    def close(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._loop.join(timeout=30)
        self.executor.close()
        self._scratch.cleanup()

    # -- the loop --------------------------------------------------------------------------------------

    def _evaluation(self, request: EvaluationRequest) -> Evaluation:
        """What ``request`` asks for, its settings from pkb.evaluate.config.resolve; RequestError
        (HTTP 400) where it cannot run as asked."""
        try:
            problem = get_problem(request.problem)
        except KeyError as exc:
            raise RequestError(str(exc.args[0])) from None
        try:
            config = resolve({**request.options(), "sandbox": self.sandbox}, problem, self.executor.gpus_per_node(),
                             on_ray=self.executor.name == "ray").config
        except OptionError as exc:
            raise RequestError(str(exc)) from None
        experiment = request.experiment or self.experiment
        if request.reference:
            return Evaluation(problem, Candidate.reference_of(problem), request.solution_set, config,
                              experiment=experiment)
        folder = Path(tempfile.mkdtemp(dir=self._scratch.name))
        # the file as the client named it (`pkb eval --server` sends its stem): a crash, a hang or a syntax error then
        # names the user's file and line, as a local evaluation does, not a copy named after the problem
        named = re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}", request.name) and not request.name.endswith(".")
        path = folder / f"{request.name if named else f'{problem.upstream_id or 0}_{problem.name}'}.py"
        path.write_text(request.source, encoding="utf-8")
        candidate = Candidate.from_file(path, name=request.name)
        return Evaluation(problem, candidate, request.solution_set, config, experiment=experiment)

    def _run(self) -> None:
        with ResultStore(self.db) as store:
            loop = EvaluationLoop(store, executor=self.executor, reuse="never", keep_paths=False)
            while not self._stop.is_set():
                self._take_new(loop, block=not loop.pending)
                finished = list(loop.finished(wait=False))
                for stored in finished:
                    self._finish(stored)
                if loop.pending and not finished:
                    time.sleep(0.02)

    def _take_new(self, loop: EvaluationLoop, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while item is not None:
                served, evaluation = item
                served.state = "running"
                loop.submit(evaluation)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _finish(self, stored: StoredResult) -> None:
        served: ServedEvaluation = stored.evaluation.tag
        if stored.evaluation.candidate.path is not None:  # the request's scratch copy (a reference has none)
            shutil.rmtree(stored.evaluation.candidate.path.parent, ignore_errors=True)
        served.result = stored.result.to_dict()
        served.state = "done"
        with self._lock:
            self._waiting -= 1
        served.done.set()
