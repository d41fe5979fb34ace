"""Inside a candidate's rank process: record the stock collectives it calls, and notice tampering.

``StockCallRecorder`` wraps the data-moving entry points of the stock stack before the candidate is
imported — ``torch.distributed`` collectives (module functions and ProcessGroup methods), the
functional collectives, ``torch.ops.symm_mem`` fused operators, and the problem's own reference —
and records which ones run *while the candidate's solution runs*. The harness's own barriers and
reductions are bound before this and are not recorded.

On several nodes each label says how far the call reaches (``span_label``): ``dist.isend@network`` connects
only ranks on different nodes (the network leg, the only way between real nodes), ``dist.all_reduce@mixed``
spans nodes and also joins ranks of one node, a bare label stays inside one node. ``moved_inside_a_node``
is what ``--policy forbid-collectives`` forbids.

``tampered()`` compares the harness's clocks, synchronisation, channel and worker entry points
with the objects they were at start: a candidate that patched any of them is reported.

Both are in-process checks, so a determined candidate can defeat them; the verdict does not depend
on them alone: times come from the parent's clock and outputs are compared in the parent
(docs/threat-model.md).
"""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from pkb.topology import Topology

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
)  # the ones this torch's namespace lacks are left out; every other op of the namespace is recorded too
# Synchronisation only: recorded, never forbidden.
SYNC_ONLY = frozenset({"dist.barrier", "dist.monitored_barrier"})
NETWORK, MIXED = "@network", "@mixed"  # a call's reach on several nodes (``span_label``)
P2P = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}  # dist's point-to-point: the peer argument
PG_P2P = {"send": 1, "recv": 1}  # ProcessGroup.send(tensors, dstRank, tag): the peer's position (a group rank)


def moved_inside_a_node(labels) -> list[str]:
    """The labels of stock calls (``collectives_used``) that moved data inside a node: what ``--policy
    forbid-collectives`` forbids. Synchronisation and the network leg between nodes (``@network``: calls that
    connect only ranks on different nodes, where a real cluster has nothing but the network) are allowed; a
    call over a group with several ranks on one node (``@mixed``) moves data inside that node too."""
    return [label for label in labels if label.split("@")[0] not in SYNC_ONLY and not label.endswith(NETWORK)]


class StockCallRecorder:
    """Wraps stock entry points to record their use, without changing what torch sees.

    One wrapper per original function, set on every owner that binds it (``torch.distributed`` and
    ``distributed_c10d`` both bind ``isend``): torch compares function identities (``P2POp`` accepts
    only ``op in [isend, irecv]`` as bound in c10d, ``batch_isend_irecv`` tests ``op.op is isend``),
    so a candidate's ``dist.isend`` must be the very object c10d holds. ``functools.wraps`` keeps
    names, docstrings and signatures; the wrapper returns what the original returns.
    """

    def __init__(self, topology: Topology | None = None):
        self.active = False
        self.used: set[str] = set()
        self.topology = topology or Topology.from_env()  # the run's nodes: each label says how far its call reaches
        self._wrappers: dict[int, Callable] = {}  # id(original) -> its one wrapper
        self._wrapper_ids: set[int] = set()
        self.checks: list[Callable] = []  # (label, args, kwargs) -> None or raise, before every recorded call

    def record(self, label: str, original: Callable, args: tuple, kwargs: dict) -> None:
        if self.active:
            self.used.add(span_label(label, original, args, kwargs, self.topology))

    def _wrap(self, original: Callable, label: str) -> Callable:
        recorder = self
        if isinstance(original, torch._ops.OpOverloadPacket):
            return _recorded_packet(original, recorder, label)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            recorder.record(label, original, args, kwargs)
            for check in recorder.checks:
                check(label, args, kwargs)
            return original(*args, **kwargs)

        _hide_original(recorded, original)
        return recorded

    def _patch(self, owner: Any, name: str, label: str) -> None:
        try:
            original = getattr(owner, name, None)
        except (AttributeError, RuntimeError):  # an op whose schema this build cannot resolve
            return
        if original is None or id(original) in self._wrapper_ids:
            return
        wrapper = self._wrappers.get(id(original))
        if wrapper is None:
            wrapper = self._wrappers[id(original)] = self._wrap(original, label)
            self._wrapper_ids.add(id(wrapper))
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
        for name in symm_mem_ops():
            self._patch(torch.ops.symm_mem, name, f"symm_mem.{name}")
        if problem_module is not None:
            self._patch(problem_module, "reference", "reference")

    def run(self, fn: Callable, *args):
        """Call ``fn`` with recording on."""
        self.active = True
        try:
            return fn(*args)
        finally:
            self.active = False


def symm_mem_ops() -> list[str]:
    """Every operator of torch's ``symm_mem`` namespace (its C++ ops and those torch.distributed._symmetric_memory
    defines in Python, imported first), the listed fused ops first."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (defines some of the namespace's ops)
    except ImportError:
        pass
    registered = sorted(name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
                        if name.startswith("symm_mem::"))
    return [*SYMM_MEM_FUSED_OPS, *(name for name in registered if name not in SYMM_MEM_FUSED_OPS)]


def _hide_original(wrapper: Callable, original: Callable) -> None:
    """No attribute of ``wrapper`` hands out ``original`` (``functools.wraps`` sets ``__wrapped__``, a way around
    the wrapper); ``inspect.signature`` still shows the original's."""
    try:
        wrapper.__signature__ = inspect.signature(original)
    except (TypeError, ValueError):
        pass
    wrapper.__dict__.pop("__wrapped__", None)


_SIGNATURES: dict[int, inspect.Signature | None] = {}
# bound before any candidate is imported: a candidate that patches torch.distributed's helpers changes no label
_rank, _world_size, _global_rank, _group_ranks_of = (dist.get_rank, dist.get_world_size, dist.get_global_rank,
                                                     dist.get_process_group_ranks)


def _arguments(original: Callable, args: tuple, kwargs: dict) -> dict:
    """``args`` and ``kwargs`` by parameter name (those given only), or {} where ``original`` has no signature."""
    key = id(original)
    if key not in _SIGNATURES:
        try:
            _SIGNATURES[key] = inspect.signature(original)
        except (TypeError, ValueError):
            _SIGNATURES[key] = None
    signature = _SIGNATURES[key]
    if signature is None:
        return {}
    try:
        return signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return {}


def span_label(label: str, original: Callable, args: tuple, kwargs: dict, topology: Topology | None) -> str:
    """``label`` with how far its call reaches on ``topology``'s nodes: ``@network`` (it connects only ranks on
    different nodes), ``@mixed`` (it spans nodes and joins ranks of one node too), nothing (inside one node, on
    one node, or where the call's ranks cannot be told: counted as inside)."""
    if (topology is None or topology.num_nodes == 1 or label in SYNC_ONLY
            or label.split(".")[0] not in ("dist", "ProcessGroup", "functional")):
        return label
    try:
        ranks = _ranks_reached(label, original, args, kwargs)
    except Exception:  # a call torch itself will refuse; its reach is unknown
        ranks = None
    if not ranks or topology.same_node(ranks):
        return label
    nodes = [topology.node_of(rank) for rank in ranks]
    return label + (NETWORK if len(set(nodes)) == len(nodes) else MIXED)


def _ranks_reached(label: str, original: Callable, args: tuple, kwargs: dict) -> list[int] | None:
    """The global ranks a stock call connects (this rank and its peers), or None where they cannot be told."""
    kind, name = label.split(".", 1)
    if kind == "ProcessGroup":
        group = args[0] if args else None
        if name in PG_P2P:
            if len(args) <= PG_P2P[name] + 1:
                return None
            return sorted({_rank(), _global_rank(group, int(args[PG_P2P[name] + 1]))})
        return _group_ranks_of(group)
    arguments = _arguments(original, args, kwargs)
    if name == "batch_isend_irecv":
        peers = {op.peer if op.peer is not None else _global_rank(op.group or dist.group.WORLD, op.group_peer)
                 for op in arguments.get("p2p_op_list") or ()}
        return sorted(peers | {_rank()})
    if kind == "dist" and name in P2P:
        group = arguments.get("group")
        peer = arguments.get(P2P[name])
        if peer is None and arguments.get(f"group_{P2P[name]}") is not None:
            peer = _global_rank(group or dist.group.WORLD, arguments[f"group_{P2P[name]}"])
        return None if peer is None else sorted({_rank(), int(peer)})
    return _group_ranks(arguments.get("group"))


def _group_ranks(group) -> list[int] | None:
    """The global ranks of ``group`` as torch's calls take it: None (the world), a ProcessGroup, a group's name,
    or (functional collectives) a list of global ranks; None for what cannot be told (a device mesh)."""
    if group is None:
        return list(range(_world_size()))
    if isinstance(group, str):
        group = _group_named(group)
    if isinstance(group, dist.ProcessGroup):
        return _group_ranks_of(group)
    if isinstance(group, (list, tuple)) and group and all(isinstance(rank, int) for rank in group):
        return list(group)
    return None


class CrossNodePeerMemory(RuntimeError):
    """A candidate asked for peer memory between ranks on different (virtual) nodes: refused, ``forbidden``."""


class NvshmemUnavailable(RuntimeError):
    """A candidate asked for NVSHMEM where this mode cannot give it faithfully: ``skipped``, not failed."""


class PeerMemoryFence:
    """What a candidate's peer memory may reach in this run. On several nodes (pkb.topology) NVLink stays
    inside a node: symmetric memory over a group that spans nodes raises CrossNodePeerMemory, whichever of
    torch's ways the candidate asks by: ``symm_mem.rendezvous``, ``get_symm_mem_workspace``, the C++
    ``_SymmetricMemory.rendezvous`` and ``empty_strided_p2p``, and every op of ``torch.ops.symm_mem`` (packet
    or overload) given such a group's name. Where NVSHMEM cannot run faithfully (``nvshmem_missing``: W
    ranks on one GPU, or virtual nodes, where its inter-node traffic would go over NVLink), choosing it raises
    NvshmemUnavailable. ``refusals`` and ``unavailable``: what it refused, for the verdict (``forbidden``,
    ``skipped``) even where the candidate caught the error.

    The fence is a label, not the boundary: a candidate can reach torch's originals (through the
    interpreter's objects, or its own extension). The boundary is the sandbox, where each virtual node is a
    domain of its own (pkb.runtime.sandbox, ``NODE_PROTECTIONS``): there a way around the fence fails as it
    would between real nodes. The fence gives the calls it knows a clear ``forbidden``."""

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
        self._fence(symm_mem, "rendezvous", lambda tensor, group=None, *_, **__: (
            group if group is not None else dist.group.WORLD), "symmetric memory rendezvous")
        self._fence(symm_mem, "get_symm_mem_workspace", lambda group_name=None, *_, **__: group_name,
                    "symmetric memory workspace")
        cpp = getattr(symm_mem, "_SymmetricMemory", None)
        if cpp is not None:
            self._fence(cpp, "rendezvous", lambda tensor=None, group_name=None, *_, **__: group_name,
                        "symmetric memory rendezvous (_SymmetricMemory)", static=True)
            self._fence(cpp, "empty_strided_p2p", lambda *args, group_name=None, **__: (
                args[4] if len(args) > 4 else group_name), "symmetric memory allocation (_SymmetricMemory)", static=True)
        set_backend = getattr(symm_mem, "set_backend", None)
        if set_backend is not None:
            boundary = self

            @functools.wraps(set_backend)
            def no_nvshmem_on_virtual_nodes(name, *args, **kwargs):
                if str(name).upper() == "NVSHMEM" and boundary.nvshmem_missing:
                    message = f"pkb: NVSHMEM is not available here: {boundary.nvshmem_missing} (docs/topology.md)"
                    boundary.unavailable.append(message)
                    raise NvshmemUnavailable(message)
                return set_backend(name, *args, **kwargs)

            _hide_original(no_nvshmem_on_virtual_nodes, set_backend)
            symm_mem.set_backend = no_nvshmem_on_virtual_nodes

    def _fence(self, owner: Any, name: str, group_of: Callable, what: str, static: bool = False) -> None:
        """Replace ``owner.name`` by a function that checks the group ``group_of(*args, **kwargs)`` names (a
        group, a group's name, or None: not given) before calling the original."""
        original = getattr(owner, name, None)
        if original is None:
            return
        boundary = self

        @functools.wraps(original)
        def within_a_node(*args, **kwargs):
            try:
                group = group_of(*args, **kwargs)
            except TypeError:  # arguments the original will refuse itself
                group = None
            if group is not None:
                boundary.check_group(group, what)
            return original(*args, **kwargs)

        _hide_original(within_a_node, original)
        try:
            setattr(owner, name, staticmethod(within_a_node) if static else within_a_node)
        except (AttributeError, TypeError):  # a read-only binding: the sandbox still holds the boundary
            pass

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
    """A copy of an op's packet (``torch.ops.symm_mem.one_shot_all_reduce``) whose calls are recorded, and its
    overloads' too (``.default``). It stays an ``OpOverloadPacket`` (its overloads ``OpOverload``s) in every
    other respect: torch walks each namespace's ops and reads them as packets (``torch.compile`` collects
    their decompositions), and a plain function there broke it."""
    base = type(packet)

    class RecordedPacket(base):
        def __call__(self, *args, **kwargs):
            recorder.record(label, packet, args, kwargs)
            for check in recorder.checks:
                check(label, args, kwargs)
            return base.__call__(self, *args, **kwargs)

        def __getattr__(self, key):
            found = base.__getattr__(self, key)
            if isinstance(found, torch._ops.OpOverload) and not key.startswith("__"):
                found = _recorded_overload(found, recorder, label)
                setattr(self, key, found)
            return found

    recorded = RecordedPacket.__new__(RecordedPacket)
    recorded.__dict__.update({key: list(value) if isinstance(value, list) else value  # its own list of overloads
                              for key, value in packet.__dict__.items() if not isinstance(value, torch._ops.OpOverload)})
    for name in packet.overloads():
        getattr(recorded, name)  # every overload recorded now: none reached later bypasses the checks
    return recorded


def _recorded_overload(overload: "torch._ops.OpOverload", recorder: StockCallRecorder, label: str):
    base = type(overload)

    class RecordedOverload(base):
        def __call__(self, /, *args, **kwargs):
            recorder.record(label, overload, args, kwargs)
            for check in recorder.checks:
                check(label, args, kwargs)
            return base.__call__(self, *args, **kwargs)

    recorded = RecordedOverload.__new__(RecordedOverload)
    recorded.__dict__.update(overload.__dict__)
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
        symm_mem = modules["symm_mem"]
        for name in ("rendezvous", "set_backend", "get_symm_mem_workspace"):
            watched[f"symm_mem.{name}"] = getattr(symm_mem, name, None)
        for name in ("rendezvous", "empty_strided_p2p"):
            watched[f"_SymmetricMemory.{name}"] = getattr(getattr(symm_mem, "_SymmetricMemory", None), name, None)
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
