"""The rank process: joins the process group once, then runs jobs from the parent until told to exit.

The jobs and replies are declared in pkb.runtime.messages: ``load`` (the problem and the candidate), ``run`` (a
case's inputs, the call, the outputs: pkb's values, upstream's, or on a reference rank the exact answer), the
timing steps (pkb.runtime.timed_loop.TimedLoop) and ``exit``. Replies carry plain data only (pkb.runtime.channel).
The worker never decides a verdict: it reports what happened, and the parent compares and judges.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback
import warnings
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from pkb.runtime.messages import (LoadJob, Ready, Reply, RunJob, TimeOutputsJob, TimePrepareJob, TimeRefreshJob,
                                  TimeStepJob)
from pkb.runtime.timed_loop import TimedLoop, input_bytes
from pkb.problem import make_generator, raised
from pkb.runtime import gloo_bridge
from pkb.runtime.channel import recv_job, send_reply, to_plain
from pkb.runtime.guards import HarnessImportBlocker, PeerMemoryFence, StockCallRecorder, snapshot_harness, tampered
from pkb.runtime.modes import Mode
from pkb.topology import Topology


# The most a rank's inputs may take raised to the exact answer's dtype; larger cases (upstream's 57 GB table of problem
# 68, model-sized benchmarks) get no exact answer, and the parent judges them against the reference by the tolerance.
EXACT_MAX_BYTES = 2 << 30


class Worker:
    def __init__(self, rank: int, world_size: int, mode: Mode, role: str):
        self.rank = rank
        self.world_size = world_size
        self.mode = mode
        self.role = role
        self.device = self._pick_device()
        self.problem = None
        self.solution = None
        self.timed = None  # the TimedLoop of the case being timed
        self.recorder = StockCallRecorder()
        self.boundary = _fence(role, mode, Topology.from_env() or Topology(world_size))
        self.import_blocker = HarnessImportBlocker()
        self.snapshot = None  # the harness's objects before the candidate was imported

    def _pick_device(self) -> torch.device:
        if self.mode is Mode.CPU:
            torch.set_num_threads(1)
            return torch.device("cpu")
        if os.environ.get("PKB_CPU_THREADS"):  # evaluations side by side: this rank's share of the cores
            torch.set_num_threads(int(os.environ["PKB_CPU_THREADS"]))
        index = self.rank % torch.cuda.device_count() if self.mode is Mode.SHARED_GPU else self.rank
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def join(self, store_port: int) -> None:
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=120))
        dist.init_process_group(self.mode.backend, store=store, rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=600))
        if self.mode.backend == "gloo":  # judge code written for NCCL as NCCL would run it
            gloo_bridge.install(stage_cuda=self.mode is Mode.SHARED_GPU)
        dist.barrier()

    # -- jobs ---------------------------------------------------------------------------------------

    def load(self, job: LoadJob) -> Reply:
        """Import the problem (``module`` or ``module:ATTR``, default attribute PROBLEM) and the candidate.

        In a candidate group, the stock collectives are wrapped first (to record which ones the
        solution calls), the harness's objects are snapshotted, and the harness's modules are made
        unimportable; then the candidate file is imported.
        """
        self.problem = load_problem(job["problem"])
        self.solution = None
        if self.role != "candidate":
            return Reply(status="ok")
        problem_module = sys.modules[self.problem.reference.__module__]
        self.recorder.install(problem_module if job.get("candidate") else None)
        if self.boundary is not None and self.snapshot is None:
            self.boundary.install(self.recorder)
        self.snapshot = snapshot_harness(sys.modules[__name__], fence=self.boundary is not None)
        self.import_blocker.install()
        if job.get("candidate") is None:  # the reference, run as a candidate (self-check)
            return Reply(status="ok")
        try:
            self.solution = _import_candidate(_candidate_copy(job), self.problem.argument_names)
        except CandidateError as exc:
            return self.guarded(Reply(status=exc.status, error=str(exc)))
        return self.guarded(Reply(status="ok"))

    def guarded(self, reply: Reply) -> Reply:
        """``reply``, unless the candidate has tampered with the harness since it was loaded."""
        if self.snapshot is None:
            return reply
        changed = tampered(self.snapshot) + [f"import {name}" for name in self.import_blocker.attempts]
        if changed:
            return Reply(status="tampered", error="the candidate changed or reached into the harness: " + ", ".join(changed))
        if self.boundary is not None and (self.boundary.refusals or self.boundary.unavailable):
            return self.fenced()
        return Reply(reply, collectives_used=sorted(self.recorder.used))

    def fenced(self) -> Reply:
        """The reply of a rank whose candidate asked for peer memory across nodes (``forbidden``), or for
        NVSHMEM where this mode cannot give it (``skipped``) (pkb.runtime.guards.PeerMemoryFence)."""
        if self.boundary.refusals:
            return Reply(status="forbidden", error=self.boundary.refusals[0])
        return Reply(status="skipped", error=self.boundary.unavailable[0])

    def failed(self, exc: Exception) -> Reply:
        """The reply of a job that raised ``exc``."""
        if self.boundary is not None and (self.boundary.refusals or self.boundary.unavailable):
            return self.fenced()
        return Reply(status="runtime_error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=-12))

    def call(self, inputs: tuple) -> tuple:
        """(outputs, the inputs as called): the candidate's (recorded), or the reference's. The reference
        runs where the candidate does: on the GPU in shared-gpu mode too, its collectives staged through
        host memory by the gloo bridge, so both round as upstream's GPU reference does."""
        if self.solution is not None:
            return self.recorder.run(self.solution, *inputs), inputs
        if self.role == "candidate":
            return self.recorder.run(self.problem.reference, *inputs), inputs
        return self.problem.reference(*inputs), inputs

    def make_inputs(self, case_name: str, seeds: tuple[int, int], precision: str, nodes: int | None = None) -> tuple:
        """The case's inputs in the run's precision, on its nodes, for this rank from (this rank's seed, the
        seed shared by all ranks)."""
        case = self.problem.find_case(case_name, precision, nodes)
        inputs = self.problem.make_inputs(case, self.rank, self.world_size, make_generator(*seeds, self.device))
        return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)

    def upstream_inputs(self, case_name: str, trial: int, precision: str) -> tuple:
        """Upstream's own values of an upstream case for this rank in ``trial`` (the paper's verdict)."""
        case = self.problem.find_case(case_name, precision)
        return self.problem.upstream_values(case, self.rank, self.world_size, trial, self.device)

    def run(self, job: RunJob) -> Reply:
        if job.get("trial") is not None:
            inputs = self.upstream_inputs(job["case"], job["trial"], job["precision"])
        else:
            inputs = self.make_inputs(job["case"], job["seeds"], job["precision"], job.get("nodes"))
        if job.get("exact"):
            if self.role != "reference" or self.problem.exact_dtype is None:
                raise ValueError(f"the exact answer is the trusted reference's, of a problem that has one ({self.role})")
            too_large = self._too_large_to_raise(inputs)
            if too_large:
                return Reply(status="ok", exact_unavailable=too_large)
            inputs = raised(inputs, self.problem.exact_dtype)
        outputs, inputs = self.call(inputs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier()
        sample_seed = job.get("sample_seed")
        return self.guarded(Reply(status="ok", outputs=to_plain(outputs, sample_seed=sample_seed),
                                  inputs_after=to_plain(list(inputs), sample_seed=sample_seed)))

    def _too_large_to_raise(self, inputs: tuple) -> str | None:
        """Why no rank computes the exact answer (every rank agrees: the largest rank's inputs decide), or None."""
        scale = self.problem.exact_dtype.itemsize / 2  # at most: bf16 raised to it
        size = int(input_bytes(inputs) * scale)
        largest = torch.tensor([size], dtype=torch.int64, device=self.device if self.mode.backend == "nccl" else "cpu")
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        if int(largest) <= EXACT_MAX_BYTES:
            return None
        return (f"the inputs raised to {str(self.problem.exact_dtype).removeprefix('torch.')} would take up to "
                f"{int(largest) / (1 << 30):.1f} GiB on a rank (more than {EXACT_MAX_BYTES >> 30} GiB)")

    def time_prepare(self, job: TimePrepareJob) -> Reply:
        case, precision, nodes = self.problem.find_case(job["case"]), job["precision"], job.get("nodes")
        fn = (lambda *inputs: self.call(inputs)[0])
        self.timed = TimedLoop(fn, lambda seeds: self.make_inputs(case.name, seeds, precision, nodes), job["seeds"],
                               self.device)
        return Reply(status="ok", **self.timed.prepare(**job["protocol"]))

    def time_refresh(self, job: TimeRefreshJob) -> Reply:
        if self.timed.graph is None:  # a captured graph keeps its inputs
            self.timed.refresh(job["round"])
        return Reply(status="ok")

    def time_repeat(self, job: TimeStepJob) -> Reply:
        return Reply(status="ok", **self.timed.repeat())

    def time_finish(self, job: TimeStepJob) -> Reply:
        return self.guarded(Reply(status="ok", **self.timed.finish()))

    def time_outputs(self, job: TimeOutputsJob) -> Reply:
        """The last output computed on each input copy, for the parent to check against the reference."""
        timed, self.timed = self.timed, None
        outputs = timed.outputs()
        return self.guarded(Reply(status="ok", outputs=to_plain(outputs, sample_seed=job["sample_seed"])))


def _fence(role: str, mode: Mode, topology: Topology) -> PeerMemoryFence | None:
    """A candidate's peer-memory fence where this run needs one (several nodes; NVSHMEM that the mode cannot
    give); the trusted reference needs none."""
    nvshmem_missing = ("shared-gpu mode runs the W ranks on one GPU, and NVSHMEM needs a GPU per rank"
                       if mode is Mode.SHARED_GPU else
                       "the nodes of this run are virtual: NVSHMEM's inter-node traffic would go over NVLink"
                       if topology.num_nodes > 1 else None)
    if role != "candidate" or (topology.num_nodes == 1 and nvshmem_missing is None):
        return None
    return PeerMemoryFence(topology, nvshmem_missing)


def load_problem(ref: str):
    """A Problem from ``package.module`` (its PROBLEM) or ``package.module:NAME``."""
    module_name, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module_name), attr or "PROBLEM")


class CandidateError(Exception):
    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


def _install_upstream_alias() -> None:
    """Let upstream solution files ``from utils.cuda_helpers import compile_cuda_extension`` unchanged."""
    import types

    from pkb.kernels import compile_cuda_extension

    if "utils.cuda_helpers" not in sys.modules:
        utils = sys.modules.get("utils") or types.ModuleType("utils")
        helpers = types.ModuleType("utils.cuda_helpers")
        helpers.compile_cuda_extension = compile_cuda_extension
        utils.cuda_helpers = helpers
        sys.modules.setdefault("utils", utils)
        sys.modules["utils.cuda_helpers"] = helpers


def _candidate_copy(job: dict) -> str:
    """Where to import the candidate from: in a sandbox, a copy in its scratch directory (the file's own
    folder, perhaps the checkout beside the results database, is not readable there)."""
    folder = os.environ.get("PKB_CANDIDATE_DIR")
    if not folder or job.get("source") is None:
        return job["candidate"]
    folder = os.path.join(folder, f"rank{dist.get_rank()}")  # each rank its own: no rank reads another's half-written copy
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, os.path.basename(job["candidate"]))
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(job["source"])
    return path


def _import_candidate(path: str, argument_names: tuple[str, ...]):
    """Import the candidate file and return its ``solution``, checked against the reference's arguments."""
    _install_upstream_alias()
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    spec = importlib.util.spec_from_file_location("pkb_candidate", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["pkb_candidate"] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError:
        raise CandidateError("compile_error", traceback.format_exc(limit=0)) from None
    except Exception as exc:
        status = "compile_error" if _looks_like_build_failure(exc) else "import_error"
        raise CandidateError(status, traceback.format_exc(limit=-8)) from None
    solution = getattr(module, "solution", None)
    if not callable(solution):
        raise CandidateError("signature_error", "the file defines no callable `solution`")
    try:
        inspect.signature(solution).bind(*argument_names)
    except TypeError as exc:
        raise CandidateError("signature_error", f"solution{inspect.signature(solution)} cannot be called as "
                                                f"solution({', '.join(argument_names)}): {exc}") from None
    except ValueError:  # builtins without a signature: accept and let the call decide
        pass
    return solution


def _looks_like_build_failure(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return any(marker in text for marker in ("BuildError", "Error building extension", "CompilationError"))


def worker_main(conn: Connection, rank: int, world_size: int, mode: str, store_port: int, role: str,
                log_path: str, env_updates: dict[str, str], log_fd: int | None = None,
                sandbox: dict | None = None) -> None:
    """Entry point of a rank process (forked by the zygote, or in a sandbox by its keeper with the log
    already open as ``log_fd`` and what the sandbox enforces as ``sandbox``; not for use by hand)."""
    os.setsid()  # its own session: the parent can kill it and everything it starts at once
    if log_fd is None:
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.environ.update(env_updates)
    if sandbox is not None:  # CUDA extensions come from the parent's build broker, read-only
        from pkb.kernels import build
        from pkb.runtime.build_client import BrokerClient

        build.BROKER = BrokerClient(conn, os.environ["PKB_BUILD_CACHE"])
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        worker = Worker(rank, world_size, Mode(mode), role)
        worker.join(store_port)
    except Exception:
        send_reply(conn, Ready(ready=False, error=traceback.format_exc(limit=-4)))
        return
    send_reply(conn, Ready(ready=True, device=str(worker.device), pid=os.getpid(), sandbox=sandbox))
    handlers = {"load": worker.load, "run": worker.run, "time_prepare": worker.time_prepare,
                "time_refresh": worker.time_refresh, "time_repeat": worker.time_repeat, "time_finish": worker.time_finish,
                "time_outputs": worker.time_outputs}
    while True:
        try:
            job = recv_job(conn)
        except EOFError:
            break
        if job["op"] == "exit":
            break
        try:
            reply = handlers[job["op"]](job)
        except Exception as exc:
            reply = worker.failed(exc)
        send_reply(conn, reply)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: nothing of the candidate's runs after the last reply


