"""Evaluations across a Ray cluster (``--executor ray``): one warm pkb evaluator per slot, results back
to the driver as they finish.

A *slot* is what one evaluation needs on one node, held by one Ray actor: W GPUs in ``cuda`` mode (an
actor's GPUs are always on one node, and Ray sets ``CUDA_VISIBLE_DEVICES`` to them), one GPU in
``shared-gpu`` mode, W CPUs in ``cpu`` mode. A timed ``cuda`` evaluation (``--perf``) gets a whole node:
its slot is pinned to a node and holds all of its GPUs, so no other evaluation disturbs its times. The actor (``NodeEvaluator``) is a pkb parent process on
that node: it keeps a ``Session`` (the rank zygote and the reference ranks) warm across evaluations,
writes the candidate's source to a node-local file, runs ``pkb.evaluate.evaluator.evaluate`` there, and returns
the ``EvalResult``. Candidate code runs only in the rank processes the actor spawns, never in the
actor itself and never in the driver. The driver stores each result as it arrives.

Failures of the machine are not verdicts. A slot whose actor dies (its node lost, its process killed,
pkb missing or different on the node) is replaced, and its evaluation is retried on a fresh actor, on
another node if its node is gone, up to ``max_attempts`` times; then the evaluation's row is
``infra_error``: left out of pass@k and evaluated again by a rerun. A verdict is only what pkb's
evaluator decided on a node. Each node checks ``--sandbox`` for itself: a node that cannot honour
``required`` answers its evaluation with an ``infra_error`` row that carries its message (what is missing,
what to do) at once, without a retry (the node would refuse again).
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

from pkb import __version__
from pkb.console import UsageError
from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import new_result
from pkb.evaluate.result import EvalResult
from pkb.executor.base import Evaluation, Executor, InFlight, session_key
from pkb.options import Status
from pkb.problem import Problem
from pkb.runtime.modes import Mode

RAY_VERSION = "2.60.0"  # the version pkb's `ray` extra pins and its tests run
INSTALL_HINT = (f"--executor ray needs Ray on this machine and on every node of the cluster: "
                f"pip install 'pkb[ray]' (Ray {RAY_VERSION}), e.g. .venv/bin/pip install -e '.[ray]'")
DEFAULT_MAX_ATTEMPTS = 3


def import_ray():
    try:
        import ray
    except ImportError:
        raise UsageError(INSTALL_HINT) from None
    return ray


def slot_resources(config: EvalConfig) -> dict[str, float]:
    """What one evaluation holds on its node: ``num_cpus`` and ``num_gpus`` for the slot's actor."""
    world_size = config.world_size
    if config.mode is Mode.CUDA:
        return {"num_cpus": 1, "num_gpus": world_size}
    if config.mode is Mode.SHARED_GPU:
        return {"num_cpus": 1, "num_gpus": 1}
    return {"num_cpus": world_size, "num_gpus": 0}


def whole_node(config: EvalConfig) -> bool:
    """Timed ``cuda`` evaluations get a node to themselves: evaluations side by side on one node share its
    host CPUs, PCIe and NVSwitch, and would distort each other's times."""
    return config.mode is Mode.CUDA and config.perf


def slots_on(nodes: list[dict], need: dict[str, float], whole: bool = False) -> int:
    """How many slots of ``need`` the alive ``nodes`` (``ray.nodes()`` rows) hold at once (``whole``: at
    most one per node)."""
    total = 0
    for node in nodes:
        if not node.get("Alive"):
            continue
        resources = node.get("Resources", {})
        if whole:
            total += int(resources.get("GPU", 0) >= need["num_gpus"] and resources.get("CPU", 0) >= need["num_cpus"])
            continue
        fits = [int(resources.get("CPU", 0) // need["num_cpus"])] if need["num_cpus"] else []
        if need["num_gpus"]:
            fits.append(int(resources.get("GPU", 0) // need["num_gpus"]))
        total += min(fits) if fits else 0
    return total


class NodeMismatch(RuntimeError):
    """The node's pkb is not the driver's: its verdicts would not be the driver's either."""


class NodeEvaluator:
    """One slot's pkb parent process, on a node of the cluster (created by RayExecutor as a Ray actor)."""

    def __init__(self, driver_version: str):
        if driver_version != __version__:
            raise NodeMismatch(f"node {socket.gethostname()} runs pkb {__version__}, the driver pkb {driver_version}: "
                               "install the same pkb on every node")
        self._sessions: dict = {}
        self._stage = Path(tempfile.mkdtemp(prefix="pkb-ray-"))

    def where(self) -> dict[str, Any]:
        """This slot's node, process and GPUs (for the driver's notes and for tests)."""
        import ray

        return {"node": socket.gethostname(), "pid": os.getpid(), "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def evaluate(self, problem_name: str, problem_version: int, candidate: Candidate, config: EvalConfig) -> EvalResult:
        from pkb.evaluate.evaluator import evaluate
        from pkb.evaluate.session import Session
        from pkb.registry import get_problem
        from pkb.runtime.sandbox import SandboxUnavailable

        problem = get_problem(problem_name)
        if problem.version != problem_version:
            raise NodeMismatch(f"node {socket.gethostname()} has {problem_name} version {problem.version}, the "
                               f"driver version {problem_version}: install the same pkb on every node")
        driver_path = candidate.path
        if candidate.is_reference:
            if Candidate.reference_of(problem).sha256 != candidate.sha256:
                raise NodeMismatch(f"node {socket.gethostname()} has another reference for {problem_name} than the "
                                   "driver: install the same pkb on every node")
        else:  # the file lives on the driver's machine: the node gets its source, under the same file name
            path = self._stage / candidate.sha256[:16] / driver_path.name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(candidate.source, encoding="utf-8")
            candidate = replace(candidate, path=path)
        key = session_key(config)
        try:
            if key not in self._sessions:
                mode, world_size, sandbox, nodes = key
                self._sessions[key] = Session(mode, world_size, sandbox, nodes=nodes)
            result = evaluate(problem, candidate, config, self._sessions[key])
        except SandboxUnavailable as exc:  # this node cannot confine candidates as asked: no verdict
            result = sandbox_unavailable(problem, candidate, config, exc)
        result.details.solution_path = str(driver_path) if driver_path else None
        result.details.node = socket.gethostname()
        return result

    def close(self) -> None:
        for session in self._sessions.values():
            session.close()
        self._sessions.clear()


@dataclass
class _Attempt:
    evaluation: Evaluation
    number: int = 1
    errors: list[str] = field(default_factory=list)
    started: float = 0.0  # time.monotonic() when it was sent to a slot


class RayExecutor(Executor):
    """Evaluations on the slots of a Ray cluster, as many at a time as it has slots (or ``parallel``).

    ``address``: None (Ray's default: ``RAY_ADDRESS`` if set, else a new local cluster), ``local`` (a new
    local cluster), ``auto`` (the cluster this machine belongs to) or ``ray://HOST:PORT``. ``init``: more
    ``ray.init`` arguments for a new local cluster (tests give ``num_cpus``).
    """

    name = "ray"

    def __init__(self, address: str | None = None, parallel: int | None = None,
                 max_attempts: int = DEFAULT_MAX_ATTEMPTS, init: dict | None = None):
        if parallel is not None and parallel < 1:
            raise UsageError("--parallel must be at least 1")
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.ray = import_ray()
        self.parallel, self.max_attempts = parallel, max_attempts
        self._started = False
        if not self.ray.is_initialized():
            self._started = True
            kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
            if address in (None, "local") and not (address is None and os.environ.get("RAY_ADDRESS")):
                kwargs.update(include_dashboard=False, **(init or {}))
            try:
                self.ray.init(address=address, **kwargs)
            except ConnectionError as exc:
                raise UsageError(f"no Ray cluster at {address or os.environ.get('RAY_ADDRESS')}: {exc}. Start one "
                                 "with `ray start --head` (docs/cluster.md), or leave --address out for a local one") from None
        self._actor_class = self.ray.remote(NodeEvaluator)
        self._queue: deque[_Attempt] = deque()
        self._running: dict[Any, tuple[Any, _Attempt]] = {}  # ObjectRef -> (slot actor, attempt)
        self._idle: dict[tuple, list] = {}  # slot resources -> idle actors
        self._slots: dict[tuple, int] = {}  # slot resources -> live actors
        self._done: deque[tuple[_Attempt, EvalResult]] = deque()  # finished without running (infra_error)
        self._nodes_seen: tuple[float, list[dict]] | None = None
        self._slot_nodes: dict = {}  # whole-node slot actor -> its node's id

    # -- the cluster ---------------------------------------------------------------------------------

    NODES_TTL_S = 5.0  # how long the driver trusts its view of the nodes (asking is O(nodes) per dispatch)

    def _nodes(self, fresh: bool = False) -> list[dict]:
        now = time.monotonic()
        if fresh or self._nodes_seen is None or now - self._nodes_seen[0] > self.NODES_TTL_S:
            self._nodes_seen = (now, [node for node in self.ray.nodes() if node.get("Alive")])
        return self._nodes_seen[1]

    def gpus_per_node(self) -> int | None:
        return max((int(node.get("Resources", {}).get("GPU", 0)) for node in self._nodes()), default=0)

    def describe(self) -> str:
        nodes = self._nodes()
        cpus = sum(int(n.get("Resources", {}).get("CPU", 0)) for n in nodes)
        gpus = sum(int(n.get("Resources", {}).get("GPU", 0)) for n in nodes)
        return f"ray: {len(nodes)} node(s), {cpus} CPUs, {gpus} GPUs"

    def in_flight(self) -> list[InFlight]:
        return [InFlight(attempt.evaluation, attempt.started) for _, attempt in list(self._running.values())]

    def capacity(self, config: EvalConfig) -> int:
        """Evaluations of ``config`` that can run at once (``parallel`` caps it)."""
        need = slot_resources(config)
        slots = slots_on(self._nodes(), need, whole_node(config))
        if slots == 0:
            what = (f"{need['num_gpus']:g} GPU(s) and " if need["num_gpus"] else "") + f"{need['num_cpus']:g} CPU(s)"
            raise UsageError(f"no node of the Ray cluster has {what} for one {config.mode}-mode evaluation at world "
                             f"size {config.world_size} ({self.describe()}); add such a node or pick another --mode")
        return min(slots, self.parallel) if self.parallel else slots

    # -- evaluations ---------------------------------------------------------------------------------

    def submit(self, evaluation: Evaluation) -> None:
        self.capacity(evaluation.config)  # a cluster that cannot run it at all says so now, not never
        self._queue.append(_Attempt(evaluation))
        self._dispatch()

    @property
    def pending(self) -> int:
        return len(self._queue) + len(self._running) + len(self._done)

    def _dispatch(self) -> None:
        held = deque()
        while self._queue:
            attempt = self._queue.popleft()
            try:
                slot = self._free_slot(attempt.evaluation.config)
            except UsageError as exc:  # the cluster lost every node that could run it
                if any(a.evaluation.config == attempt.evaluation.config for _, a in self._running.values()):
                    held.append(attempt)  # a running one will free a slot
                else:
                    self._done.append((attempt, infra_error(attempt.evaluation, attempt.errors + [str(exc)])))
                continue
            if slot is None:
                held.append(attempt)
                continue
            evaluation = attempt.evaluation
            ref = slot.evaluate.remote(evaluation.problem.name, evaluation.problem.version, evaluation.candidate,
                                       evaluation.config)
            attempt.started = time.monotonic()
            self._running[ref] = (slot, attempt)
        self._queue = held

    def _free_slot(self, config: EvalConfig):
        need = slot_resources(config)
        key = _slot_key(config)
        idle = self._idle.setdefault(key, [])
        if idle:
            return idle.pop()
        if self._slots.get(key, 0) >= self.capacity(config):
            return None
        options = dict(need, max_restarts=0, max_concurrency=1)
        if whole_node(config):  # pinned to a node no other slot of ours holds, with all of its GPUs
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            taken = set(self._slot_nodes.values())
            node = next((n for n in self._nodes(fresh=True) if n["NodeID"] not in taken
                         and n.get("Resources", {}).get("GPU", 0) >= need["num_gpus"]), None)
            if node is None:
                return None
            options.update(num_gpus=int(node["Resources"]["GPU"]),
                           scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
        self._slots[key] = self._slots.get(key, 0) + 1
        slot = self._actor_class.options(**options).remote(__version__)
        if whole_node(config):
            self._slot_nodes[slot] = node["NodeID"]
        return slot

    def finished(self, wait: bool = True) -> Iterator[tuple[Evaluation, EvalResult]]:
        self._dispatch()
        while self._running or self._done or self._queue:
            if self._queue and not self._running:
                self._dispatch()
                while self._queue and not self._running:  # no slot could start: said, not waited on forever
                    attempt = self._queue.popleft()
                    failed = infra_error(attempt.evaluation, attempt.errors + ["no slot could be started"])
                    self._done.append((attempt, failed))
            if self._done:
                attempt, result = self._done.popleft()
                yield attempt.evaluation, self._noted(result, attempt)
                continue
            # short waits, so that Ctrl-C reaches the driver promptly while evaluations run
            ready, _ = self.ray.wait(list(self._running), num_returns=1, timeout=1.0 if wait else 0)
            if not ready:
                if wait:
                    continue
                return
            ref = ready[0]
            slot, attempt = self._running.pop(ref)
            key = _slot_key(attempt.evaluation.config)
            try:
                result = self.ray.get(ref)
            except self.ray.exceptions.RayError as exc:  # the machine failed, or pkb on it: not a verdict
                self._retire(slot, key)
                attempt.errors.append(_first_line(exc))
                if attempt.number < self.max_attempts:
                    self._queue.appendleft(_Attempt(attempt.evaluation, attempt.number + 1, attempt.errors))
                    self._dispatch()
                    continue
                result = infra_error(attempt.evaluation, attempt.errors)
            else:
                self._idle.setdefault(key, []).append(slot)
            self._dispatch()
            yield attempt.evaluation, self._noted(result, attempt)

    @staticmethod
    def _noted(result: EvalResult, attempt: _Attempt) -> EvalResult:
        result.details.attempts = attempt.number
        if attempt.errors:
            result.details.infra_errors = list(attempt.errors)
        return result

    def slots(self) -> list:
        """The live slot actors, idle and busy (for tests that kill one)."""
        return [slot for slots in self._idle.values() for slot in slots] + [slot for slot, _ in self._running.values()]

    def _retire(self, slot, key: tuple) -> None:
        self._slots[key] = self._slots.get(key, 1) - 1
        self._slot_nodes.pop(slot, None)
        self._nodes_seen = None  # a node may be gone: look again
        try:
            self.ray.kill(slot, no_restart=True)
        except Exception:  # already gone with its node
            pass

    def close(self) -> None:
        if not self.ray.is_initialized():
            return
        for slot in self.slots():
            try:
                self.ray.kill(slot, no_restart=True)
            except Exception:
                pass
        self._idle.clear()
        self._running.clear()
        self._slots.clear()
        self._slot_nodes.clear()
        if self._started:
            self.ray.shutdown()


def _slot_key(config: EvalConfig) -> tuple:
    """Slots are shared by the evaluations whose configs need the same slot (and the same sandbox level)."""
    return (*sorted(slot_resources(config).items()), whole_node(config), config.sandbox)


def infra_error(evaluation: Evaluation, errors: list[str]) -> EvalResult:
    """The row of a evaluation whose every attempt failed for the machine's reasons: no verdict on the candidate."""
    result = new_result(evaluation.problem, evaluation.candidate, evaluation.config, Status.INFRA_ERROR)
    result.message = (f"the cluster failed {len(errors)} time(s), no verdict on the candidate (a rerun evaluates it "
                      f"again): {errors[-1]}")
    return result


def sandbox_unavailable(problem: Problem, candidate: Candidate, config: EvalConfig, exc: Exception) -> EvalResult:
    """The row of a evaluation on a node that cannot give ``--sandbox required``: ``infra_error``, with the
    node's message (what is missing and what to do), decided without running the candidate."""
    result = new_result(problem, candidate, config, Status.INFRA_ERROR)
    result.message = (f"node {socket.gethostname()} cannot run candidates with --sandbox {config.sandbox}, no verdict "
                      f"on the candidate (a rerun evaluates it again): {exc}")
    return result


def _first_line(exc: Exception) -> str:
    """A Ray error in one line: its kind and the cause's last words (Ray's messages run to pages)."""
    cause = getattr(exc, "cause", None)
    if cause is not None and not isinstance(cause, type(exc)):
        lines = [line for line in str(cause).strip().splitlines() if line.strip()]
        return f"{type(exc).__name__}: {type(cause).__name__}: {(lines[-1] if lines else '')[:300]}"
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' '.join(lines[:2])[:300]}"
