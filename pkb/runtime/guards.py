"""Inside a candidate's rank process: record the stock collectives it calls, and notice tampering.

``StockCallRecorder`` wraps the data-moving entry points of the stock stack before the candidate is
imported — ``torch.distributed`` collectives (module functions and ProcessGroup methods), the
functional collectives, ``torch.ops.symm_mem`` fused operators, and the problem's own reference —
and records which ones run *while the candidate's solution runs*. The harness's own barriers and
reductions are bound before this and are not recorded.

``tampered()`` compares the harness's clocks, synchronisation, channel and worker entry points
with the objects they were at start: a candidate that patched any of them is reported.

Both are in-process checks, so a determined candidate can defeat them; the verdict does not depend
on them alone: times come from the parent's clock and outputs are compared in the parent
(docs/threat-model.md).
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

# Entry points that move data (recorded and, under --policy forbid-collectives, forbidden).
DIST_FUNCTIONS = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "reduce", "scatter", "gather", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "all_reduce_coalesced", "all_gather_coalesced",
)
PROCESS_GROUP_METHODS = (
    "allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_into_tensor_coalesced",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base",
    "broadcast", "reduce", "scatter", "gather", "send", "recv",
)
FUNCTIONAL_FUNCTIONS = (
    "all_reduce", "all_gather_tensor", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast", "all_reduce_coalesced",
    "permute_tensor",
)
SYMM_MEM_FUSED_OPS = (
    "one_shot_all_reduce", "one_shot_all_reduce_out", "two_shot_all_reduce_", "two_shot_all_reduce_out",
    "multimem_all_reduce_", "multimem_one_shot_all_reduce", "multimem_all_gather_out", "fused_all_gather_matmul",
    "fused_all_gather_scaled_matmul", "fused_matmul_reduce_scatter", "fused_scaled_matmul_reduce_scatter",
    "reduce_scatter_out", "all_to_all_vdev", "all_to_all_vdev_2d", "memset32_", "stream_write_value32_",
)
# Synchronisation only: recorded, never forbidden.
SYNC_ONLY = frozenset({"dist.barrier", "dist.monitored_barrier"})


class StockCallRecorder:
    """Wraps stock entry points to record their use, without changing what torch sees.

    One wrapper per original function, set on every owner that binds it (``torch.distributed`` and
    ``distributed_c10d`` both bind ``isend``): torch compares function identities (``P2POp`` accepts
    only ``op in [isend, irecv]`` as bound in c10d, ``batch_isend_irecv`` tests ``op.op is isend``),
    so a candidate's ``dist.isend`` must be the very object c10d holds. ``functools.wraps`` keeps
    names, docstrings and signatures; the wrapper returns what the original returns.
    """

    def __init__(self):
        self.active = False
        self.used: set[str] = set()
        self._wrappers: dict[int, Callable] = {}  # id(original) -> its one wrapper
        self.checks: list[Callable] = []  # (label, args, kwargs) -> None or raise, before every recorded call

    def _wrap(self, original: Callable, label: str) -> Callable:
        recorder = self
        if isinstance(original, torch._ops.OpOverloadPacket):
            return _recorded_packet(original, recorder, label)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            if recorder.active:
                recorder.used.add(label)
            for check in recorder.checks:
                check(label, args, kwargs)
            return original(*args, **kwargs)

        recorded.__pkb_original__ = original
        return recorded

    def _patch(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name, None)
        if original is None or getattr(original, "__pkb_original__", None) is not None:
            return
        wrapper = self._wrappers.get(id(original))
        if wrapper is None:
            wrapper = self._wrappers[id(original)] = self._wrap(original, label)
        try:
            setattr(owner, name, wrapper)
        except (AttributeError, TypeError):  # a read-only binding: nothing to record there
            pass

    def install(self, problem_module: Any = None) -> None:
        import torch.distributed.distributed_c10d as c10d

        for name in (*DIST_FUNCTIONS, "barrier", "monitored_barrier"):
            for owner in (dist, c10d):
                self._patch(owner, name, f"dist.{name}")
        for name in PROCESS_GROUP_METHODS:
            self._patch(dist.ProcessGroup, name, f"ProcessGroup.{name}")
        try:
            import torch.distributed._functional_collectives as functional
        except ImportError:
            functional = None
        for name in FUNCTIONAL_FUNCTIONS if functional else ():
            self._patch(functional, name, f"functional.{name}")
        try:
            namespace = torch.ops.symm_mem
            for name in SYMM_MEM_FUSED_OPS:
                if hasattr(namespace, name):
                    self._patch(namespace, name, f"symm_mem.{name}")
        except (AttributeError, RuntimeError):
            pass
        if problem_module is not None:
            self._patch(problem_module, "reference", "reference")

    def run(self, fn: Callable, *args):
        """Call ``fn`` with recording on."""
        self.active = True
        try:
            return fn(*args)
        finally:
            self.active = False


class CrossNodePeerMemory(RuntimeError):
    """A candidate asked for peer memory between ranks on different (virtual) nodes: refused, ``forbidden``."""


class NvshmemUnavailable(RuntimeError):
    """A candidate asked for NVSHMEM where this mode cannot give it faithfully: ``skipped``, not failed."""


class PeerMemoryFence:
    """What a candidate's peer memory may reach in this run. On several nodes (pkb.topology) NVLink stays
    inside a node: symmetric memory rendezvous and the fused symmetric-memory ops over a group that spans
    nodes raise CrossNodePeerMemory (a real cluster has no NVLink between nodes; on one machine nothing
    else would stop it). Where NVSHMEM cannot run faithfully (``nvshmem_missing``: W ranks on one GPU, or
    virtual nodes, where its inter-node traffic would go over NVLink), choosing it raises
    NvshmemUnavailable. ``refusals`` and ``unavailable``: what it refused, for the verdict (``forbidden``,
    ``skipped``) even where the candidate caught the error."""

    def __init__(self, topology, nvshmem_missing: str | None = None):
        self.topology = topology
        self.nvshmem_missing = nvshmem_missing
        self.refusals: list[str] = []
        self.unavailable: list[str] = []

    def install(self, recorder: StockCallRecorder) -> None:
        recorder.checks.append(self._check_fused_op)
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError:  # a torch without symmetric memory: nothing of it to fence
            return
        boundary = self
        rendezvous = symm_mem.rendezvous

        @functools.wraps(rendezvous)
        def rendezvous_within_a_node(tensor, group=None, *args, **kwargs):
            boundary.check_group(group if group is not None else dist.group.WORLD, "symmetric memory rendezvous")
            return rendezvous(tensor, group, *args, **kwargs)

        rendezvous_within_a_node.__pkb_original__ = rendezvous
        symm_mem.rendezvous = rendezvous_within_a_node
        set_backend = getattr(symm_mem, "set_backend", None)
        if set_backend is not None:
            @functools.wraps(set_backend)
            def no_nvshmem_on_virtual_nodes(name, *args, **kwargs):
                if str(name).upper() == "NVSHMEM" and boundary.nvshmem_missing:
                    message = f"pkb: NVSHMEM is not available here: {boundary.nvshmem_missing} (docs/topology.md)"
                    boundary.unavailable.append(message)
                    raise NvshmemUnavailable(message)
                return set_backend(name, *args, **kwargs)

            no_nvshmem_on_virtual_nodes.__pkb_original__ = set_backend
            symm_mem.set_backend = no_nvshmem_on_virtual_nodes

    def _check_fused_op(self, label: str, args: tuple, kwargs: dict) -> None:
        if not label.startswith("symm_mem."):
            return
        for value in (*args, *kwargs.values()):
            if isinstance(value, str):
                group = _group_named(value)
                if group is not None:
                    self.check_group(group, label)

    def check_group(self, group, what: str) -> None:
        if self.topology.num_nodes == 1:
            return
        if isinstance(group, str):
            group = _group_named(group)
        if group is None:
            return
        ranks = dist.get_process_group_ranks(group)
        if not self.topology.same_node(ranks):
            nodes = sorted({self.topology.node_of(rank) for rank in ranks})
            self.refuse(f"{what} over ranks {ranks}, on nodes {nodes}: peer memory works within a node only "
                        f"({self.topology.gpus_per_node} GPUs; rank r is on node r // {self.topology.gpus_per_node}); "
                        "move data between nodes through torch.distributed")

    def refuse(self, why: str) -> None:
        message = f"pkb: {why} (this run has {self.topology.num_nodes} nodes; docs/topology.md)"
        self.refusals.append(message)
        raise CrossNodePeerMemory(message)


def _group_named(name: str):
    """The process group called ``name``, or None where no group has that name."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(name)
    except Exception:  # not a group's name (a reduce op, a mode string)
        return None


def _recorded_packet(packet: "torch._ops.OpOverloadPacket", recorder: StockCallRecorder, label: str):
    """A copy of an op's packet (``torch.ops.symm_mem.one_shot_all_reduce``) whose calls are recorded. It
    stays an ``OpOverloadPacket`` in every other respect: torch walks each namespace's ops and reads them as
    packets (``torch.compile`` collects their decompositions), and a plain function there broke it."""
    base = type(packet)

    class RecordedPacket(base):
        def __call__(self, *args, **kwargs):
            if recorder.active:
                recorder.used.add(label)
            for check in recorder.checks:
                check(label, args, kwargs)
            return base.__call__(self, *args, **kwargs)

    recorded = RecordedPacket.__new__(RecordedPacket)
    recorded.__dict__.update(packet.__dict__)
    recorded.__pkb_original__ = packet
    return recorded


def _watched(modules: dict[str, Any]) -> dict[str, Any]:
    timing, channel, worker = modules["timing"], modules["channel"], modules["worker"]
    import torch.distributed.distributed_c10d as c10d

    watched = {
        "time.perf_counter": time.perf_counter, "time.monotonic": time.monotonic, "time.time": time.time,
        "torch.cuda.synchronize": torch.cuda.synchronize, "torch.cuda.Event": torch.cuda.Event,
        "torch.cuda.Event.record": torch.cuda.Event.record,
        "torch.cuda.Event.elapsed_time": torch.cuda.Event.elapsed_time,
        "channel.send_reply": channel.send_reply, "channel.to_plain": channel.to_plain,
        "channel.recv_job": channel.recv_job, "worker.to_plain": worker.to_plain,
        "worker.send_reply": worker.send_reply, "worker.recv_job": worker.recv_job,
    }
    for name in ("run", "call", "guarded", "make_inputs", "time_prepare", "time_refresh", "time_repeat", "time_finish",
                 "time_outputs"):
        watched[f"Worker.{name}"] = getattr(worker.Worker, name)
    for name in ("prepare", "refresh", "repeat", "finish", "outputs", "call_next"):
        watched[f"TimedLoop.{name}"] = getattr(timing.TimedLoop, name)
    for name in ("sync", "aligned_start", "largest_over_ranks"):
        watched[f"timing.{name}"] = getattr(timing, name)
    for name in (*DIST_FUNCTIONS, "barrier"):  # the recorder's wrappers, once installed
        watched[f"dist.{name}"] = getattr(dist, name, None)
        watched[f"c10d.{name}"] = getattr(c10d, name, None)
    if "symm_mem" in modules:  # the peer-memory fence's wrappers (PeerMemoryFence)
        for name in ("rendezvous", "set_backend"):
            watched[f"symm_mem.{name}"] = getattr(modules["symm_mem"], name, None)
    return watched


def snapshot_harness(worker: Any, fence: bool = False) -> dict[str, Any]:
    """The objects the harness relies on, as they are now (call after the recorder, and any peer-memory fence,
    is installed and before the candidate is imported). ``worker`` is the rank's worker module (passed in:
    this module sits below it). Keeps the modules, so later checks need no import."""
    import pkb.runtime.timed_loop as timing
    import pkb.runtime.channel as channel

    modules = {"timing": timing, "channel": channel, "worker": worker}
    if fence:
        import torch.distributed._symmetric_memory as symm_mem

        modules["symm_mem"] = symm_mem
    return {"__modules__": modules, **_watched(modules)}


def tampered(snapshot: dict[str, Any]) -> list[str]:
    """Names of the watched objects that are no longer what they were at ``snapshot`` time."""
    now = _watched(snapshot["__modules__"])
    return sorted(name for name, original in snapshot.items() if name != "__modules__" and now.get(name) is not original)


BLOCKED_PACKAGES = ("pkb.evaluate", "pkb.runtime", "pkb.store", "pkb.loop", "pkb.solution_files", "pkb.cli",
                    "pkb.commands", "pkb.registry", "pkb.generate", "pkb.report", "pkb.hardware", "pkb.measure")


def _blocked(name: str) -> bool:
    return any(name == package or name.startswith(package + ".") for package in BLOCKED_PACKAGES)


class HarnessImportBlocker(importlib.abc.MetaPathFinder):
    """Makes pkb's harness modules unimportable for the candidate and remembers who tried.

    The worker has bound everything it needs already; the modules leave ``sys.modules`` (so
    ``sys.modules["pkb.runtime.worker"]`` finds nothing either) and an import of one fails.
    The problem's reference module and ``pkb.kernels`` stay importable.
    """

    def __init__(self):
        self.attempts: list[str] = []
        self.hidden: dict[str, Any] = {}

    def install(self) -> None:
        for name in [n for n in sys.modules if _blocked(n)]:
            self.hidden[name] = sys.modules.pop(name)
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def find_spec(self, fullname, path=None, target=None):
        if _blocked(fullname):
            self.attempts.append(fullname)
            raise ImportError(f"{fullname} is pkb's harness: a candidate may not import it")
        return None
