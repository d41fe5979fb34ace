"""The rank process: joins the process group once, then runs jobs from the parent until told to exit.

The jobs and replies are declared in pkb.runtime.messages: ``load`` (the problem and the candidate), ``run`` (a
case's inputs, the call, the outputs: pkb's values, upstream's, or on a reference rank the exact answer and its
sensitivity, pkb.runtime.exact), the timing steps (pkb.runtime.timed_loop.TimedLoop) and ``exit``. Replies carry
plain data only (pkb.runtime.channel). The worker never decides a verdict: it reports what happened, and the parent
compares and judges. A rank that runs candidate code says what that code did, and nothing it says is taken on trust.

A rank's Python stack goes to its log when it gets SIGUSR1 (``faulthandler``): what the parent shows of a rank that
hung, before it kills it.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import importlib
import importlib.util
import inspect
import os
import signal
import sys
import threading
import traceback
import warnings
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Callable

import torch
import torch.distributed as dist

from pkb.runtime.messages import (LoadJob, Ready, RunJob, StockCallNote, TimeCheckJob, TimeCopiesJob, TimeExactJob,
                                  TimePrepareJob, TimeRefreshJob, TimeRepeatJob, TimeStepJob)
from pkb.runtime.timed_loop import OutputRefused, TimedLoop, apply_change, donor_pair, instance_seeds
from pkb.problem import make_generator, raised
from pkb.runtime import gloo_bridge
from pkb.runtime.channel import recv_job, send_reply, tensor_bytes, to_plain
from pkb.runtime.exact import exact_arithmetic, perturbed, sensitivity
from pkb.runtime.guards import HarnessImportBlocker, PeerMemoryFence, StockCallRecorder, snapshot_harness, tampered
from pkb.runtime.modes import Mode
from pkb.topology import Topology


# The most a rank's inputs may take raised to fp64; larger cases (upstream's 57 GB table of problem 68, model-sized
# benchmarks) get no exact answer, and the parent judges them against the reference's output (pkb.evaluate.accuracy).
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
        self.protocol: dict = {}  # its timing protocol (pkb.evaluate.config.TimingProtocol's fields)
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

    def load(self, job: LoadJob) -> dict:
        """Import the problem (``module`` or ``module:ATTR``, default attribute PROBLEM) and the candidate.

        The stock collectives are wrapped first, in every group (to record which ones a candidate calls; the
        reference's group pays the wrappers' cost too, so that timings compare like with like). In a candidate group
        the harness's objects are then snapshotted and the harness's modules made unimportable; then the candidate
        file is imported.
        """
        self.problem = load_problem(job["problem"])
        self.solution = None
        problem_module = sys.modules[self.problem.reference.__module__]
        self.recorder.install(problem_module if job.get("candidate") else None)
        if self.role != "candidate":
            return {"status": "ok"}
        if self.boundary is not None and self.snapshot is None:
            self.boundary.install(self.recorder)
        self.snapshot = snapshot_harness(sys.modules[__name__], self.recorder, fence=self.boundary is not None)
        self.import_blocker.install()
        if job.get("candidate") is None:  # the reference, run as a candidate (self-check)
            self.recorder.go_live()
            return {"status": "ok"}
        try:
            self.solution = _import_candidate(_candidate_copy(job), self.problem.argument_names)
        except CandidateError as exc:
            return self.guarded({"status": exc.status, "error": str(exc)})
        self.recorder.go_live()  # its own threads are recorded from now on, whenever they call
        return self.guarded({"status": "ok"})

    def guarded(self, reply: dict) -> dict:
        """``reply``, unless the candidate has tampered with the harness since it was loaded."""
        if self.snapshot is None:
            return reply
        changed = tampered(self.snapshot) + [f"import {name}" for name in self.import_blocker.attempts]
        if changed:
            return {"status": "tampered", "error": "the candidate changed or reached into the harness: " + ", ".join(changed)}
        if self.boundary is not None and (self.boundary.refusals or self.boundary.unavailable):
            return self.fenced()
        return {**reply, "collectives_used": sorted(self.recorder.used)}

    def fenced(self) -> dict:
        """The reply of a rank whose candidate asked for peer memory across nodes (``forbidden``), or for
        NVSHMEM where this mode cannot give it (``unavailable``: the parent decides what that earns from its own
        reading of the candidate's source) (pkb.runtime.guards.PeerMemoryFence)."""
        if self.boundary.refusals:
            return {"status": "forbidden", "error": self.boundary.refusals[0]}
        return {"status": "unavailable", "error": self.boundary.unavailable[0]}

    def failed(self, exc: Exception) -> dict:
        """The reply of a job that raised ``exc``."""
        if self.boundary is not None and (self.boundary.refusals or self.boundary.unavailable):
            return self.fenced()
        return {"status": "runtime_error", "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=-12)}

    def call(self, inputs: tuple, window: bool = True) -> tuple:
        """(outputs, the inputs as called): the candidate's, or the reference's. In a candidate group each call opens
        the recorder's window (``window``; a timed repeat opens one for all its calls instead). The reference runs
        where the candidate does: on the GPU in shared-gpu mode too, its collectives staged through host memory by
        the gloo bridge, so both round as upstream's GPU reference does."""
        function = self.solution if self.solution is not None else self.problem.reference
        if self.role == "candidate" and window:
            return self.recorder.run(function, *inputs), inputs
        if self.role == "candidate":
            self.recorder.begin_call()
        return function(*inputs), inputs

    def recorded(self):
        """A window of the recorder around harness code that may run candidate code unseen (a lazy output's methods
        while it is read into plain tensors, a patched torch function while inputs are made): the stock calls made
        there are recorded as the candidate's (pkb.runtime.guards). Nothing of the harness's own runs inside."""
        return self.recorder.window() if self.role == "candidate" else contextlib.nullcontext()

    def make_inputs(self, case_name: str, seeds: tuple[int, int], precision: str, nodes: int | None = None) -> tuple:
        """The case's inputs in the run's precision, on its nodes, for this rank from (this rank's seed, the
        seed shared by all ranks)."""
        case = self.problem.find_case(case_name, precision, nodes)
        with self.recorded():
            inputs = self.problem.make_inputs(case, self.rank, self.world_size, make_generator(*seeds, self.device))
        return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)

    def upstream_inputs(self, case_name: str, trial: int, precision: str) -> tuple:
        """Upstream's own values of an upstream case for this rank in ``trial`` (the paper's verdict)."""
        case = self.problem.find_case(case_name, precision)
        with self.recorded():
            return self.problem.upstream_values(case, self.rank, self.world_size, trial, self.device)

    def run(self, job: RunJob) -> dict:
        if job.get("exact"):
            return self.exact(job)
        if job.get("trial") is not None:
            inputs = self.upstream_inputs(job["case"], job["trial"], job["precision"])
        else:
            inputs = self.make_inputs(job["case"], job["seeds"], job["precision"], job.get("nodes"))
        outputs, inputs = self._called(inputs)
        with self.recorded():  # a lazy output does its work here
            plain = {"outputs": to_plain(outputs), "inputs_after": to_plain(list(inputs))}
        return self.guarded({"status": "ok", **plain})

    def _called(self, inputs: tuple) -> tuple:
        outputs, inputs = self.call(inputs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier()
        return outputs, inputs

    def exact(self, job: RunJob, make: Callable[[], tuple] | None = None) -> dict:
        """The exact answer (a trusted reference rank only): the reference in fp64 arithmetic on the case's inputs
        raised to fp64, and its sensitivity over ``perturbations`` perturbed copies of them (pkb.runtime.exact).
        ``make``: what builds the inputs, where not the job's seeds (a timed call's: ``time_exact``)."""
        if self.role != "reference" or self.problem.exact_dtype is None:
            raise ValueError(f"the exact answer is the trusted reference's, of a problem that has one ({self.role})")
        make = make or (lambda: self.make_inputs(job["case"], job["seeds"], job["precision"], job.get("nodes")))
        too_large = self._too_large_to_raise(make())
        if too_large:
            return {"status": "ok", "unavailable": too_large}
        def exactly(inputs: tuple) -> list:  # the inputs are made outside: their draws are the run's
            with exact_arithmetic():
                return to_plain(list(self._called(inputs)))

        answer = exactly(raised(make(), torch.float64))
        moved = (exactly(perturbed(make(), job["precision"], job["perturbation_seed"] + k))
                 for k in range(job.get("perturbations", 0)))  # one perturbed answer in memory at a time
        return {"status": "ok", "outputs": answer[0], "inputs_after": answer[1], "sensitivity": sensitivity(answer, moved)}

    def _too_large_to_raise(self, inputs: tuple) -> str | None:
        """Why no rank computes the exact answer (every rank agrees: the largest rank's inputs decide), or None."""
        size = int(tensor_bytes(inputs) * 4)  # at most: bf16 raised to fp64
        largest = torch.tensor([size], dtype=torch.int64, device=self.device if self.mode.backend == "nccl" else "cpu")
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        if int(largest) <= EXACT_MAX_BYTES:
            return None
        return (f"the inputs raised to fp64 would take up to {int(largest) / (1 << 30):.1f} GiB on a rank (more than "
                f"{EXACT_MAX_BYTES >> 30} GiB)")

    def time_prepare(self, job: TimePrepareJob) -> dict:
        case, precision, nodes = self.problem.find_case(job["case"]), job["precision"], job.get("nodes")
        window = self.recorder.window if self.role == "candidate" else contextlib.nullcontext
        self.timed = TimedLoop(lambda *inputs: self.call(inputs, window=False)[0],
                               lambda seeds: self.make_inputs(case.name, seeds, precision, nodes), job["seeds"],
                               self.device, window=window)
        self.protocol = job["protocol"]
        return _refused_or(lambda: {"status": "ok", **self.timed.prepare(**job["protocol"])})

    def time_copies(self, job: TimeCopiesJob) -> dict:
        cuda_graph = bool(self.protocol.get("cuda_graph"))
        return _refused_or(lambda: self.timed.make_copies(job["num_copies"], cuda_graph=cuda_graph) or {"status": "ok"})

    def time_refresh(self, job: TimeRefreshJob) -> dict:
        self.timed.refresh(job["round"], job["entropy"])
        return {"status": "ok"}

    def time_repeat(self, job: TimeRepeatJob) -> dict:
        return _refused_or(lambda: {"status": "ok", **self.timed.repeat(job["num_calls"], job["entropy"])})

    def time_check(self, job: TimeCheckJob) -> dict:
        """Every slot's output summaries, and the full outputs of the slots the parent names (taken first: nothing
        runs between the repeat's end and their copy but the harness)."""
        def checked() -> dict:
            with self.recorded():  # a lazy output does its work here
                outputs = [to_plain(output) for output in self.timed.outputs_of(job.get("full", []))]
            return {"status": "ok", "summaries": self.timed.check(job["seed"], job["num_projections"]),
                    "outputs": outputs}
        return _refused_or(checked)

    def time_finish(self, job: TimeStepJob) -> dict:
        return self.guarded({"status": "ok", **self.timed.finish()})

    def time_outputs(self, job: TimeStepJob) -> dict:
        """The last output computed on each input slot, for the parent to check against the reference."""
        timed, self.timed = self.timed, None
        with self.recorded():  # a lazy output does its work here
            outputs = to_plain(timed.outputs())
        del timed
        if self.device.type == "cuda":  # the copies' memory back to the device, for the other group's timing
            torch.cuda.empty_cache()
        return self.guarded({"status": "ok", "outputs": outputs})

    def time_exact(self, job: TimeExactJob) -> dict:
        """The exact answer (a trusted reference rank only) to one timed call: its slot's inputs in one refresh round,
        changed from the slot's donor as the loop changed them just before the call (pkb.runtime.timed_loop:
        ``instance_seeds``, ``donor_pair``, ``apply_change``, from the same numbers)."""
        seed, case, precision, nodes = tuple(job["seeds"]), job["case"], job["precision"], job.get("nodes")

        def make() -> tuple:
            inputs = self.make_inputs(case, instance_seeds(seed, job["round"], job["entropy"], 0), precision, nodes)
            donor = self.make_inputs(case, instance_seeds(seed, -1, 0, 1), precision, nodes)
            apply_change(donor_pair(inputs, donor), job["repeat_entropy"], job["call"])
            return inputs

        return self.exact({"op": "run", "case": case, "precision": precision, "nodes": nodes, "seeds": seed,
                           "exact": True, "perturbations": job["perturbations"],
                           "perturbation_seed": job["perturbation_seed"]}, make)


def _refused_or(step: Callable[[], dict]) -> dict:
    """``step``'s reply, or ``tampered`` where a call's output was not plain data (pkb.runtime.timed_loop.refusal)."""
    try:
        return step()
    except OutputRefused as exc:
        return {"status": "tampered", "error": str(exc)}


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


def _return_free_memory() -> None:
    """Give the memory a job freed back to the system (glibc keeps freed chunks under its growing mmap threshold in
    the heap): the session's reference ranks live for a whole run, and an exact answer's fp64 runs on a large case
    left each at its peak, some 3 GB, which took a 24 GiB machine's memory from the evaluations beside them."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


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
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank's stack, to its log (the module's docstring)
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
    sending = threading.Lock()  # a candidate's thread may note a stock call while this one sends a reply

    def reply_with(message: dict) -> None:
        with sending:
            send_reply(conn, message)

    if role == "candidate":  # each stock route goes to the parent the moment it is taken (pkb.runtime.guards)
        worker.recorder.sink = lambda labels: reply_with(StockCallNote(stock_calls=labels))
    handlers = {"load": worker.load, "run": worker.run, "time_prepare": worker.time_prepare,
                "time_copies": worker.time_copies, "time_refresh": worker.time_refresh, "time_repeat": worker.time_repeat,
                "time_check": worker.time_check, "time_finish": worker.time_finish, "time_outputs": worker.time_outputs,
                "time_exact": worker.time_exact}
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
        reply_with(reply)
        if role == "reference" and job["op"] in ("load", "run"):  # never between timed jobs: the parent's clock runs
            reply = None
            _return_free_memory()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: nothing of the candidate's runs after the last reply


