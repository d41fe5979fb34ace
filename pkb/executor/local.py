"""Evaluations on this machine: one at a time, or several side by side (``pkb run --parallel N``).

Side by side, each evaluation runs in a thread of this process with warm rank groups of its own (a
``Session`` per slot), so the verdicts are decided here exactly as one at a time; only their order of
arrival changes. The slots share one build broker per sandbox level: a source that two evaluations
build at once is built once. A timed evaluation (``perf``) never runs beside another: timings need an
otherwise idle machine. The executor runs the untimed ones first, side by side, then each timed one
alone, with nothing else in flight.

The verdicts are those of one at a time (docs/architecture.md, "Invariance"): on GPUs an evaluation starts beside
others only where the memory it is measured to need is free (pkb.executor.memory), and a result that
may be the shared machine's doing (``resource_failure``: out of memory, a time-out, a dead rank, pkb
failing) is not counted when it happened beside other evaluations: that evaluation runs again alone, and
its result says so (``details.rerun_alone``: why, and what the first run ended in).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Iterator

from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import evaluate
from pkb.evaluate.session import Session, new_broker
from pkb.evaluate.result import EvalResult
from pkb.executor.base import Evaluation, Executor, InFlight, resource_failure, session_key
from pkb.executor.memory import GpuAdmission
from pkb.runtime.gpu_memory import GIB, NvmlReader, usage_of
from pkb.runtime.group import RankGroup, StartFailure
from pkb.runtime.modes import Mode
from pkb.runtime.proctree import children_by_parent, descendants

MAX_AUTO_PARALLEL = 16
RANK_RAM_GIB = 0.75  # one rank process: torch imported, a case's inputs and outputs
RANK_GPU_GIB = 2.0  # one rank's CUDA context and a correctness case's tensors, where the driver cannot be asked
GROUPS_PER_SLOT = 3  # the reference group, the candidate's, and the spare started beside it


@dataclass(frozen=True)
class Parallelism:
    """How many evaluations run at once, and why (said to the user)."""

    slots: int
    reason: str


def default_parallel(mode: Mode, world_size: int, rank_gpu_bytes: float | None = None) -> Parallelism:
    """Evaluations side by side that this machine holds in ``mode`` at ``world_size``: by its cores (in
    cpu mode every rank computes, so W cores per evaluation; on GPUs the ranks mostly wait and a build
    takes a core or two), its memory (three rank groups per slot) and its GPUs' memory: three groups of
    rank processes, each process ``rank_gpu_bytes`` (measured: ``LocalExecutor.capacity``; else
    ``RANK_GPU_GIB``). On GPUs the slots are an upper bound: an evaluation starts only where the memory
    it is measured to need is free (pkb.executor.memory)."""
    cores = os.cpu_count() or 1
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    limits = {"cores": max(1, cores // (world_size if mode is Mode.CPU else 2)),
              "memory": max(1, int(ram_gib // (GROUPS_PER_SLOT * world_size * RANK_RAM_GIB)))}
    if mode is not Mode.CPU:
        gpu_gib = _smallest_gpu_bytes() / GIB
        per_rank_gib = rank_gpu_bytes / GIB if rank_gpu_bytes else RANK_GPU_GIB
        limits["GPU memory"] = max(1, int(gpu_gib // (GROUPS_PER_SLOT * _ranks_per_gpu(mode, world_size) * per_rank_gib)))
    binding = min(limits, key=limits.get)
    slots = min(limits[binding], MAX_AUTO_PARALLEL)
    machine = f"{cores} cores, {ram_gib:.0f} GiB memory" + (f", {gpu_gib:.0f} GiB per GPU" if mode is not Mode.CPU else "")
    reason = f"{machine}; {mode} mode, W = {world_size}: " + (
        f"as many as its {binding} holds" if slots < MAX_AUTO_PARALLEL else f"at most {MAX_AUTO_PARALLEL} by default")
    return Parallelism(slots, reason)


def _ranks_per_gpu(mode: Mode, world_size: int) -> int:
    return world_size if mode is Mode.SHARED_GPU else 1


def _smallest_gpu_bytes() -> float:
    reader = NvmlReader.open()
    if reader is not None and reader.num_devices:
        return min(reader.total_bytes().values())
    import torch

    return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))


def fills_a_gpu(evaluation: Evaluation) -> bool:
    """Its inputs fill most of a GPU (``Problem.fills_a_gpu``) and it runs on GPUs."""
    return bool(evaluation.problem.fills_a_gpu and evaluation.config.mode.uses_gpu)


def runs_alone(evaluation: Evaluation) -> bool:
    """A timed evaluation (timings need an otherwise idle node), or one that fills a GPU."""
    return evaluation.config.perf or fills_a_gpu(evaluation)


class LocalExecutor(Executor):
    """Evaluations on this machine. ``parallel``: at most this many at once (1, the default: one after
    another in the calling thread, in the order submitted; None: as many as ``default_parallel`` says
    for the first evaluation's mode and world size). Rank groups stay warm for the executor's life, per slot
    and (mode, world size, sandbox level) (``session_key``)."""

    name = "local"

    def __init__(self, parallel: int | None = 1):
        if parallel is not None and parallel < 1:
            raise ValueError("parallel must be at least 1")
        self.parallel = parallel
        self.parallel_reason = "asked for" if parallel is not None else ""
        self._decided = False
        self._queue: deque[Evaluation] = deque()
        self._slots: list[dict[tuple, Session]] = [{}]  # each slot's sessions; a slot runs one evaluation at a time
        self._free: list[int] = [0]
        self._brokers: dict[str, object] = {}  # sandbox level -> the build broker every slot shares
        self._running: dict[Future, tuple[Evaluation, int]] = {}
        self._in_flight: dict[int, InFlight] = {}  # id(evaluation) -> what it is and since when
        self._beside: set[int] = set()  # id(evaluation) of running evaluations that another ran beside at some point
        # id(evaluation) -> its first result, and why it runs again alone
        self._reruns: dict[int, tuple[EvalResult, str]] = {}
        self._memory: GpuAdmission | None = None  # on GPUs, with a driver to ask: admission by measured memory
        # at most this many at once once pkb's limits failed one beside others (None: ``parallel``): half as many as
        # ran then, down to one, so that no more are admitted than start reliably (``_admit_fewer``)
        self._admitted: int | None = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def capacity(self, config: EvalConfig) -> int:
        if self._decided:
            return self.parallel
        self._decided = True
        try:
            rank_bytes = self._measure_rank_memory(config) if config.mode.uses_gpu and self.parallel != 1 else None
        except StartFailure as exc:  # pkb's own trouble: the run goes on, safely, one evaluation at a time
            self._memory = None
            self.parallel, self.parallel_reason = 1, (
                f"one at a time: the GPU memory of W = {config.world_size} ranks could not be measured ({exc}; "
                f"last log lines: {' | '.join((exc.log_tail or '').strip().splitlines()[-3:])})")
            return self.parallel
        if self.parallel is None:  # decided once, by the first configuration asked about
            chosen = default_parallel(config.mode, config.world_size, rank_bytes)
            self.parallel, self.parallel_reason = chosen.slots, chosen.reason
        elif rank_bytes and self.parallel > 1:
            fits = default_parallel(config.mode, config.world_size, rank_bytes).slots
            if fits < self.parallel:
                self.parallel_reason = (
                    f"asked for; at most {fits} fit in the GPUs' memory at W = {config.world_size} in {config.mode} mode "
                    f"(each holds {GROUPS_PER_SLOT} groups of rank processes, {rank_bytes / GIB:.2f} GiB each as measured "
                    "at start, before any data): evaluations start as the memory they are measured to need is free")
        if rank_bytes:
            self.parallel_reason += "; admitted by measured GPU memory"
        return self.parallel

    def _measure_rank_memory(self, config: EvalConfig) -> float | None:
        """One rank process's GPU memory at start (its CUDA context), measured on a group of W ranks started
        for it; None without a driver to ask. Starts the admission by measured memory."""
        reader = NvmlReader.open()
        if reader is None:
            return None
        self._memory = GpuAdmission(reader)
        with RankGroup(config.mode, config.world_size, "reference") as group:
            group.wait_ready()
            usage = usage_of(descendants(group.root_pids(), children_by_parent()), reader.used_by_process())
        return sum(usage.by_device.values()) / config.world_size or None

    def submit(self, evaluation: Evaluation) -> None:
        self.capacity(evaluation.config)
        self._queue.append(evaluation)

    @property
    def pending(self) -> int:
        return len(self._queue) + len(self._running)

    def in_flight(self) -> list[InFlight]:
        with self._lock:
            return list(self._in_flight.values())

    def describe(self) -> str:
        slots = self.parallel or "auto"
        return f"local, {slots} evaluation{'s' if slots != 1 else ''} at once" + (
            f" ({self.parallel_reason})" if self.parallel_reason else "")

    def finished(self, wait: bool = True) -> Iterator[tuple[Evaluation, EvalResult]]:
        if (self.parallel or 1) == 1:
            while self._queue:
                evaluation = self._queue.popleft()
                yield evaluation, self._evaluate(evaluation, 0)
            return
        yield from self._side_by_side(wait)

    def _side_by_side(self, block: bool) -> Iterator[tuple[Evaluation, EvalResult]]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.parallel, thread_name_prefix="pkb-eval")
        self._queue = deque(sorted(self._queue, key=lambda queued: queued.config.perf))  # untimed first (a stable sort)
        while self._queue or self._running:
            self._dispatch()
            done, _ = wait(self._running, timeout=None if block else 0, return_when=FIRST_COMPLETED)
            if not done:
                return
            for future in done:
                evaluation, slot = self._running.pop(future)
                self._free.append(slot)
                result = self._counted(evaluation, future.result())
                if result is not None:
                    yield evaluation, result

    def _counted(self, evaluation: Evaluation, result: EvalResult) -> EvalResult | None:
        """``result`` as it counts; None where it is judged again alone first (``resource_failure``)."""
        beside = id(evaluation) in self._beside
        self._beside.discard(id(evaluation))
        if id(evaluation) in self._reruns:
            first, why = self._reruns.pop(id(evaluation))
            result.details.rerun_alone = {"why": why, "first": {"status": first.status.value, "message": first.message}}
            return result
        why = resource_failure(result) if beside else None
        if why is None:
            return result
        self._admit_fewer(why)
        self._reruns[id(evaluation)] = (result, why)
        self._queue.appendleft(evaluation)
        return None

    def _admit_fewer(self, why: str) -> None:
        """After a failure of pkb's own limits beside other evaluations (ranks that would not start, memory, a
        time-out): from now on, at most half as many at once as were running then (at least one). Seen on one H200
        in shared-gpu mode at W = 8: with 6 evaluations at once most first attempts ended "8 of 8 ranks failed to
        start" and ran again alone; fewer at once start, and the run ends sooner."""
        admitted = max(1, (len(self._running) + 1) // 2)
        if admitted < (self._admitted or self.parallel):
            self._admitted = admitted
            self.parallel_reason += f"; then at most {admitted} at once ({why})"

    def _alone(self, evaluation: Evaluation) -> bool:
        return runs_alone(evaluation) or id(evaluation) in self._reruns

    def _dispatch(self) -> None:
        """Start queued evaluations in free slots; one that runs alone (``_alone``) only when nothing runs, and
        nothing beside it; on GPUs, one beside others only where its measured need is free."""
        while self._queue:
            if any(self._alone(evaluation) for evaluation, _ in self._running.values()):
                return
            evaluation = self._queue[0]
            if self._alone(evaluation) and self._running:
                return
            if self._admitted is not None and len(self._running) >= self._admitted:
                return
            if not self._free:
                if len(self._slots) >= self.parallel:
                    return
                self._slots.append({})
                self._free.append(len(self._slots) - 1)
            slot = self._free[-1]
            if self._running and self._memory is not None and evaluation.config.mode.uses_gpu:
                held = self._slots[slot][session_key(evaluation.config)].root_pids() \
                    if session_key(evaluation.config) in self._slots[slot] else []
                if not self._memory.admits(evaluation, held)[0]:
                    return
            self._queue.popleft()
            self._free.pop()
            if self._memory is not None and evaluation.config.mode.uses_gpu:  # from now on its need counts as taken
                self._memory.watch(evaluation, functools.partial(self._slot_pids, slot, session_key(evaluation.config)))
            if self._running:  # side by side from now on: it and every running one
                self._beside.add(id(evaluation))
                self._beside.update(id(other) for other, _ in self._running.values())
            self._running[self._pool.submit(self._evaluate, evaluation, slot)] = (evaluation, slot)

    def _evaluate(self, evaluation: Evaluation, slot: int) -> EvalResult:
        if fills_a_gpu(evaluation) or id(evaluation) in self._reruns:  # it runs alone: the idle slots' warm rank
            for other, idle in enumerate(self._slots):          # groups give it their memory
                if other != slot:
                    for session in idle.values():
                        session.close()
                    idle.clear()
        sessions = self._slots[slot]
        key = session_key(evaluation.config)
        if key not in sessions:
            sessions[key] = self._session(evaluation.config)
        with self._lock:
            self._in_flight[id(evaluation)] = InFlight(evaluation, time.monotonic())
        try:
            result = evaluate(evaluation.problem, evaluation.candidate, evaluation.config, sessions[key])
        finally:
            peak = self._memory.finished(evaluation) if self._memory is not None else None
            with self._lock:
                self._in_flight.pop(id(evaluation), None)
        if peak is not None:
            result.details.gpu_memory_peak_gib = {str(d): round(b / GIB, 3) for d, b in peak.by_device.items() if b}
        return result

    def _slot_pids(self, slot: int, key: tuple) -> list[int]:
        """The processes at the top of a slot's rank groups for ``key`` (none before its session exists)."""
        session = self._slots[slot].get(key) if slot < len(self._slots) else None
        return session.root_pids() if session is not None else []

    def _session(self, config: EvalConfig) -> Session:
        threads = self._cpu_threads(config)
        if config.sandbox == "off":
            return Session(config.mode, config.world_size, "off", cpu_threads=threads, nodes=config.nodes)
        with self._lock:
            if config.sandbox not in self._brokers:
                self._brokers[config.sandbox] = new_broker(config.sandbox, max_parallel=max(4, self.parallel or 1))
        return Session(config.mode, config.world_size, config.sandbox, self._brokers[config.sandbox], threads,
                       nodes=config.nodes)

    def _cpu_threads(self, config: EvalConfig) -> int | None:
        """Each rank's CPU threads side by side: the cores shared by the reference and candidate ranks of
        every slot (torch would give each rank all of them: hundreds of threads fighting over the cores)."""
        if (self.parallel or 1) == 1:
            return None
        return max(1, (os.cpu_count() or 1) // (self.parallel * 2 * config.world_size))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        for sessions in self._slots:
            for session in sessions.values():
                session.close()
        self._slots, self._free = [{}], [0]
        for broker in self._brokers.values():
            broker.close()
        self._brokers.clear()
        if self._memory is not None:
            self._memory.close()
