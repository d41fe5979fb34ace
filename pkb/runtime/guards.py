"""Inside a candidate's rank process: record the stock routes its code takes to move data, and notice tampering.

``StockCallRecorder`` names the routes. Before the candidate is imported it wraps every entry point into the stock
stack that it knows to move data: torch.distributed's functions, the methods of process groups (``ProcessGroup``)
and of their backends (``Backend``: ProcessGroupGloo, ProcessGroupNCCL, one a candidate builds for itself), the
functional collectives and every operator of the ``c10d``, ``_c10d_functional`` and ``symm_mem`` namespaces, the
c10d stores (``Store``: ``set``, ``get``, ``add``, ... of the rendezvous store or any other), the store-based
collectives, RPC, and the problem's own reference. A call is recorded (``collectives_used``) while a window is open
on the harness's thread (``window``: the candidate's call, its inputs being made, its outputs being read into plain
tensors, where a lazy output does its work), and on every other thread (the candidate's own) at any time after the
candidate is loaded (``go_live``). Each label goes to the parent the moment the rank first sees it (``sink``: a
message on the rank's channel, before the call runs), so what the candidate later does to the rank's own record
changes nothing the parent has.

Routes it cannot name are seen by their effect: every collective that reaches a process group moves the group's
sequence number, whichever way it was asked for (DDP's C++ reducer, an operator's C++ kernel, torch's originals
reached around the wrappers). At each window's ends the recorder compares the numbers group by group, for the
registered groups and for the ones the candidate built itself (their constructors are wrapped): a group that moved
with no named call on that group is recorded as ``c10d.unnamed_route``. Between windows only the harness's own
synchronisation may move a group (the world group): any other group that moved is recorded the same way. The
harness's own synchronisation runs on its thread outside windows, where nothing is recorded. NCCL counts
point-to-point calls apart from collectives: there, sends and receives are seen through their named entry
points only.

On several nodes each label says how far the call reaches (``span_label``): ``dist.isend@network`` connects only
ranks on different nodes (the network leg, the only way between real nodes), ``dist.all_reduce@mixed`` spans nodes
and also joins ranks of one node, a bare label stays inside one node (or its reach cannot be told: a group the
candidate built itself); a store, the store collectives and RPC can reach every rank (``@mixed``). ``dist.all_reduce@relay`` is a network call that passed on, to a rank of some
node, data that an earlier network call of the same solution call brought from another rank of that node: data
between two ranks of one node, carried by the stock stack through a rank of another node. ``moved_inside_a_node``
is what ``--policy forbid-collectives`` forbids.

``tampered()`` compares the harness's clocks, synchronisation, channel and worker entry points, the recorder's own
methods and every wrapper it set, with the objects they were at start: a candidate that patched any of them is
reported.

All of this runs in the candidate's process, so it is advisory against a candidate determined to get around it
(torch's originals sit in the wrappers' closures; the record's own state can be edited before a call is made):
docs/threat-model.md says what it can and cannot guarantee. Times come from the parent's clock and outputs are
compared in the parent.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import inspect
import sys
import threading
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from pkb.topology import Topology

C10D = getattr(torch._C, "_distributed_c10d", None)  # the C++ classes: ProcessGroup, Backend, Store, ...

# Entry points that move data (recorded and, under --policy forbid-collectives, forbidden inside a node).
DIST_FUNCTIONS = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "reduce", "scatter", "gather", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "all_reduce_coalesced", "all_gather_coalesced", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list", "_all_gather_base", "_reduce_scatter_base",
    "_broadcast_coalesced", "_verify_params_across_processes",  # DDP's and FSDP's set-up broadcasts
)
PROCESS_GROUP_METHODS = (
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
    "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced", "reduce_scatter",
    "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "alltoall", "alltoall_base", "all_to_all_single", "broadcast", "reduce",
    "scatter", "gather", "send", "recv", "recv_anysource",
)
BACKEND_METHODS = (  # a process group's backend object (``pg._get_backend(device)``), or one built by hand
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base", "reduce_scatter",
    "_reduce_scatter_base", "alltoall", "alltoall_base", "broadcast", "reduce", "scatter", "gather", "send", "recv",
    "recv_anysource",
)
STORE_METHODS = (  # every way a c10d store carries a value (or a bit: check, wait, num_keys) between processes
    "set", "get", "add", "append", "compare_set", "multi_get", "multi_set", "delete_key", "check", "wait",
    "num_keys", "list_keys", "queue_push", "queue_pop", "queue_len",
)
STORE_COLLECTIVES = ("all_gather", "all_sum", "broadcast_send", "broadcast_recv", "gather_send", "gather_recv",
                     "scatter_send", "scatter_recv")  # torch._C._distributed_c10d._StoreCollectives
RPC_FUNCTIONS = ("rpc_sync", "rpc_async", "remote")
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
# The operator namespaces whose every operator is wrapped (torch.ops.NAMESPACE.op), and their labels' prefix.
OP_NAMESPACES = {"c10d": "c10d_op", "_c10d_functional": "functional_op", "_c10d_functional_autograd": "functional_op"}
UNNAMED_ROUTE = "c10d.unnamed_route"  # a collective that moved a process group's sequence number with no named call
# Synchronisation and set-up only: recorded, never forbidden (nor counted as an unnamed route on their group).
SYNC_ONLY = frozenset({"dist.barrier", "dist.monitored_barrier", "ProcessGroup.barrier", "ProcessGroup.monitored_barrier",
                       "Backend.barrier", "Backend.monitored_barrier", "c10d_op.barrier", "c10d_op.monitored_barrier_",
                       "c10d_op.check_for_nan", "functional_op.wait_tensor", "functional_op._wrap_tensor_autograd",
                       "symm_mem._barrier", "symm_mem._rendezvous", "store.barrier", "store_collectives.barrier"})
NETWORK, MIXED, RELAY = "@network", "@mixed", "@relay"  # a call's reach on several nodes (``span_label``)
WORLD_WIDE = ("store", "store_collectives", "rpc")  # routes that can reach any rank: counted as reaching all of them
P2P = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}  # dist's point-to-point: the peer argument
PG_P2P = {"send": 1, "recv": 1}  # ProcessGroup.send(tensors, dstRank, tag): the peer's position (a group rank)
SENDS = {"send", "isend", "send_object_list"}  # dist's one-way calls, by direction (``_directions``)
RECEIVES = {"recv", "irecv", "recv_object_list", "recv_anysource"}
FROM_SOURCE = {"broadcast": "src", "broadcast_object_list": "src", "scatter": "src", "scatter_object_list": "src"}
TO_DESTINATION = {"reduce": "dst", "gather": "dst", "gather_object": "dst"}
MAX_NOTED = 512  # labels one rank sends the parent at most (a flood of invented labels stops there)


def moved_inside_a_node(labels) -> list[str]:
    """The labels of stock calls (``collectives_used``) that moved data inside a node: what ``--policy
    forbid-collectives`` forbids. Synchronisation and the network leg between nodes (``@network``: calls that
    connect only ranks on different nodes, where a real cluster has nothing but the network) are allowed; a
    call over a group with several ranks on one node (``@mixed``) moves data inside that node too, and so does a
    network call that relays one node's data back into it (``@relay``)."""
    return [label for label in labels if label.split("@")[0] not in SYNC_ONLY and not label.endswith(NETWORK)]


class StockCallRecorder:
    """Wraps stock entry points to record their use, without changing what torch sees.

    One wrapper per original function, set on every owner that binds it (``torch.distributed`` and
    ``distributed_c10d`` both bind ``isend``): torch compares function identities (``P2POp`` accepts
    only ``op in [isend, irecv]`` as bound in c10d, ``batch_isend_irecv`` tests ``op.op is isend``),
    so a candidate's ``dist.isend`` must be the very object c10d holds. ``functools.wraps`` keeps
    names, docstrings and signatures; the wrapper returns what the original returns.

    ``used``: every label this process recorded; ``sink(labels)``, where the worker sets one: sends each label to
    the parent the first time it is recorded (``_note``), before the call it names runs.
    """

    def __init__(self, topology: Topology | None = None):
        self.used: set[str] = set()
        self.sink: Callable[[list[str]], None] | None = None
        self.topology = topology or Topology.from_env()  # the run's nodes: each label says how far its call reaches
        self._several_nodes = self.topology is not None and self.topology.num_nodes > 1
        self.patched: list[tuple[Any, str]] = []  # (owner, name) of every wrapper set: the tamper snapshot checks them
        self.checks: list[Callable] = []  # (label, args, kwargs) -> None or raise, before every recorded call
        self._wrappers: dict[int, Callable] = {}  # id(original) -> its one wrapper
        self._wrapper_ids: set[int] = set()
        self._depth = 0  # windows open on the harness's thread (``window`` nests)
        self._harness_thread: int | None = None  # set by ``go_live``: other threads are recorded from then on
        self._made: list[weakref.ref] = []  # every ProcessGroup and Backend constructed in Python since install
        self._local = threading.local()  # per thread: how deep inside wrapped calls (the outermost one is judged)
        self._noted_lock = threading.Lock()
        self._num_sent = 0  # labels sent through ``sink``
        self._last: dict[str, tuple[Any, int]] | None = None  # the groups' numbers when last compared
        self._excused: dict[str, int] = {}  # per group: collectives that synchronisation and set-up calls made
        self._named: set[str] = set()  # the groups a named data-moving call reached since the last comparison
        self._reached: set[int] = set()  # ranks of other nodes whose data network calls brought (``begin_call``)
        self._world_key: str | None = None  # the world group's name, once there is one (``_sequence_numbers``)

    # -- what is recorded -------------------------------------------------------------------------------------

    def recording(self) -> bool:
        """Whether a call made now is recorded: inside a window, or on a thread of the candidate's."""
        return self._depth > 0 or (self._harness_thread is not None and threading.get_ident() != self._harness_thread)

    def record(self, label: str, original: Callable, args: tuple, kwargs: dict, outermost: bool = True) -> None:
        """Record one call of ``original`` (``label``) with its reach; the group it ran on explains that group's
        sequence number; an outermost network call is checked for relaying (``_relayed``)."""
        ranks, spanned = None, label
        if self._several_nodes:
            ranks = _reach(label, original, args, kwargs, self.topology)
            spanned = _span(label, ranks, self.topology)
        if spanned not in self.used:
            self._note(spanned)
        if label in SYNC_ONLY:
            return
        _attribute_groups(self._named, label, args, kwargs, self._world_key)
        if outermost and ranks and spanned.endswith(NETWORK):
            self._relayed(label, original, args, kwargs, ranks)

    def _note(self, label: str) -> None:
        if label in self.used:
            return
        with self._noted_lock:
            if label in self.used:
                return
            self.used.add(label)
            if self.sink is not None and self._num_sent < MAX_NOTED:
                self._num_sent += 1
                self.sink([label])

    def go_live(self) -> None:
        """The candidate is loaded: from now on calls made on any thread but this one are recorded, and groups
        are compared between windows too."""
        self._harness_thread = threading.get_ident()
        self._last = self._sequence_numbers()

    def begin_call(self) -> None:
        """A new call of the solution: data relayed by an earlier call is not this call's (``_relayed``)."""
        self._reached = set()

    @contextlib.contextmanager
    def window(self):
        """Record the stock calls made inside (a candidate's call, a timed repeat's calls, inputs being made,
        outputs being materialised), and afterwards every group whose sequence number moved with no named call on
        it (``UNNAMED_ROUTE``, with its group's reach). Windows nest: the outermost one compares."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        before = self._sequence_numbers()
        if self._last is not None:  # between windows: the harness's own synchronisation runs over the world only
            self._compare(self._last, before, skip_world=True)
        self._excused, self._named = {}, set()
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            after = self._sequence_numbers()
            self._compare(before, after)
            self._last = after

    def _compare(self, before: dict, after: dict, skip_world: bool = False) -> None:
        """Record an unnamed route on every group that moved from ``before`` to ``after`` more than its
        synchronisation explains, with no named call on it; then start counting afresh."""
        world = _default_group()
        for name, (group, number) in after.items():
            moved = number - before.get(name, (None, 0))[1] - self._excused.get(name, 0)
            if moved > 0 and name not in self._named and not (skip_world and group is world):
                self._note(_span_of_group(UNNAMED_ROUTE, group, self.topology))
        self._excused, self._named = {}, set()

    def _run_excused(self, label: str, original: Callable, invoke: Callable, args: tuple, kwargs: dict):
        """``invoke(*args, **kwargs)`` (synchronisation or set-up), the collectives it makes on its own group (on
        every group where that cannot be told) not counted as an unnamed route; the synchronisation calls it makes
        itself (``dist.barrier`` calls ``ProcessGroup.barrier``) are counted once, here."""
        groups = _groups_of_call(label, original, args, kwargs)  # a barrier's own group: two numbers read, not all
        numbers = self._sequence_numbers if groups is None else lambda: _numbers_of(groups)
        before = numbers()
        self._local.excusing = True
        try:
            return invoke(*args, **kwargs)
        finally:
            self._local.excusing = False
            for name, (_, number) in numbers().items():
                self._excused[name] = self._excused.get(name, 0) + number - before.get(name, (None, 0))[1]

    def _relayed(self, label: str, original: Callable, args: tuple, kwargs: dict, ranks: list[int]) -> None:
        """``label@relay`` where this network call sends, to a rank of some node, what an earlier network call of
        this solution call brought from another rank of that node (data between two ranks of one node, carried
        across by the stock stack). Collectives count as sending and receiving; a receive is counted from the
        moment it is posted."""
        try:
            me, node_of = _rank(), self.topology.node_of
            sends, receives = _directions(label, original, args, kwargs, ranks, me)
        except Exception:  # a call torch itself will refuse
            return
        for peer in sends:
            if any(source != peer and node_of(source) == node_of(peer) for source in self._reached):
                self._note(label + RELAY)
                break
        self._reached.update(source for source in receives if node_of(source) != node_of(me))

    # -- the groups' sequence numbers -----------------------------------------------------------------------------

    def _sequence_numbers(self) -> dict[str, tuple[Any, int]]:
        """Every process group of this rank, by name (``_group_key``): (the group, how many collectives it has
        run), the registered ones and those the candidate built itself (``_made``)."""
        numbers = {}
        if self._world_key is None and _default_group() is not None:
            self._world_key = _group_key(_default_group())
        for group in list(c10d._world.pg_map):
            try:
                numbers[group.group_name] = (group, int(_get_sequence_number(group)))
            except Exception:  # a backend that keeps no sequence number (or a group being torn down)
                continue
        if not self._made:
            return numbers
        owned = _registered_backends()
        self._made[:] = [made for made in self._made if made() is not None]
        for made in list(self._made):
            obj = made()
            key = _group_key(obj, owned) if obj is not None else None
            if key is None or key in numbers:  # gone, or a registered group (or its backend): counted above
                continue
            try:
                numbers[key] = (obj, int(_get_number_of(obj)))
            except Exception:  # not set up yet, or torn down
                continue
        return numbers

    # -- wrapping ---------------------------------------------------------------------------------------------

    def _enter(self) -> bool:
        """Into a wrapped call on this thread; whether it is the outermost one."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        return depth == 0

    def _leave(self) -> None:
        self._local.depth -= 1

    def call(self, label: str, original: Callable, args: tuple, kwargs: dict, invoke: Callable | None = None):
        """What every wrapper does: record, run the checks, call ``original`` (or ``invoke``, an operator's own
        call, where ``original`` is only what the call is read from)."""
        invoke = invoke or original
        if not self.recording():  # the reference's ranks, the harness's own calls: what the wrapper costs them is this
            for check in self.checks:
                check(label, args, kwargs)
            return invoke(*args, **kwargs)
        outermost = self._enter()
        try:
            self.record(label, original, args, kwargs, outermost)
            for check in self.checks:
                check(label, args, kwargs)
            if label in SYNC_ONLY and not getattr(self._local, "excusing", False):
                return self._run_excused(label, original, invoke, args, kwargs)
            return invoke(*args, **kwargs)
        finally:
            self._leave()

    def _wrap(self, original: Callable, label: str) -> Callable:
        recorder = self
        if isinstance(original, torch._ops.OpOverloadPacket):
            return _recorded_packet(original, recorder, label)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            return recorder.call(label, original, args, kwargs)

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
            return
        self.patched.append((owner, name))

    def _track_constructor(self, cls: type) -> None:
        """Keep every instance of ``cls`` made from Python (a process group or backend a candidate builds for itself
        is in no registry: its sequence number is read from this list)."""
        original = cls.__dict__.get("__init__")
        if original is None or id(original) in self._wrapper_ids:
            return
        made = self._made

        @functools.wraps(original)
        def constructed(instance, *args, **kwargs):
            original(instance, *args, **kwargs)
            try:
                made.append(weakref.ref(instance))
            except TypeError:  # no weak references to it: kept alive by the candidate or gone
                pass

        _hide_original(constructed, original)
        self._wrapper_ids.add(id(constructed))
        try:
            cls.__init__ = constructed
        except (AttributeError, TypeError):
            return
        self.patched.append((cls, "__init__"))

    def install(self, problem_module: Any = None) -> None:
        for name in (*DIST_FUNCTIONS, "barrier", "monitored_barrier"):
            for owner in (dist, c10d):
                self._patch(owner, name, f"dist.{name}")
        for name in (*PROCESS_GROUP_METHODS, "barrier", "monitored_barrier"):
            self._patch(dist.ProcessGroup, name, f"ProcessGroup.{name}")
        if C10D is not None:
            for name in (*BACKEND_METHODS, "barrier", "monitored_barrier"):
                self._patch(C10D.Backend, name, f"Backend.{name}")
            for name in (*STORE_METHODS, "barrier"):
                self._patch(C10D.Store, name, f"store.{name}")
            collectives = getattr(C10D, "_ControlCollectives", None)
            for name in (*STORE_COLLECTIVES, "barrier") if collectives is not None else ():
                self._patch(collectives, name, f"store_collectives.{name}")
            for cls in (C10D.ProcessGroup, *_backend_classes()):
                self._track_constructor(cls)
        try:
            import torch.distributed.rpc as rpc
            import torch.distributed.rpc.api as rpc_api
        except ImportError:  # a build without RPC: nothing of it to record
            rpc = rpc_api = None
        for name in RPC_FUNCTIONS if rpc is not None else ():
            for owner in (rpc, rpc_api):
                self._patch(owner, name, f"rpc.{name}")
        try:
            import torch.distributed._functional_collectives as functional
        except ImportError:
            functional = None
        for name in FUNCTIONAL_FUNCTIONS if functional else ():
            self._patch(functional, name, f"functional.{name}")
        for name in symm_mem_ops():
            self._patch(torch.ops.symm_mem, name, f"symm_mem.{name}")
        for namespace, prefix in OP_NAMESPACES.items():
            for name in ops_of(namespace):
                self._patch(getattr(torch.ops, namespace), name, f"{prefix}.{name}")
        if problem_module is not None:
            self._patch(problem_module, "reference", "reference")

    def run(self, fn: Callable, *args):
        """Call ``fn`` with its window open (``window``), as a new solution call (``begin_call``)."""
        self.begin_call()
        with self.window():
            return fn(*args)


def _backend_classes() -> list[type]:
    """Every c10d backend class this build has (ProcessGroupGloo, ProcessGroupNCCL, ...)."""
    return [cls for cls in vars(C10D).values() if isinstance(cls, type) and issubclass(cls, C10D.Backend)
            and cls is not C10D.Backend]


def symm_mem_ops() -> list[str]:
    """Every operator of torch's ``symm_mem`` namespace (its C++ ops and those torch.distributed._symmetric_memory
    defines in Python, imported first), the listed fused ops first."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (defines some of the namespace's ops)
    except ImportError:
        pass
    registered = ops_of("symm_mem")
    return [*SYMM_MEM_FUSED_OPS, *(name for name in registered if name not in SYMM_MEM_FUSED_OPS)]


def ops_of(namespace: str) -> list[str]:
    """The operators registered in ``namespace`` (``torch.ops.NAMESPACE``), by name."""
    return sorted(name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith(namespace + "::"))


# bound before any candidate is imported: what the recorder reads of the process groups
_get_sequence_number = getattr(dist.ProcessGroup, "_get_sequence_number_for_group", None)
_get_backend_sequence_number = getattr(getattr(C10D, "Backend", None), "_get_sequence_number_for_group", None)
_get_backend = getattr(dist.ProcessGroup, "_get_backend", None)


def _is_group(value) -> bool:
    """``isinstance(value, dist.ProcessGroup)`` at a tenth of its cost (ProcessGroup's metaclass checks in Python;
    this runs for every argument of every recorded call)."""
    return issubclass(type(value), dist.ProcessGroup)


def _default_group():
    return c10d._world.default_pg


def _numbers_of(groups: dict[str, Any]) -> dict[str, tuple[Any, int]]:
    """``_sequence_numbers`` of these groups (or backends) only."""
    numbers = {}
    for name, group in groups.items():
        try:
            numbers[name] = (group, int(_get_number_of(group)))
        except Exception:  # no sequence number kept
            continue
    return numbers


def _get_number_of(obj) -> int:
    """The sequence number of a process group or a backend."""
    if _is_group(obj):
        return _get_sequence_number(obj)
    return _get_backend_sequence_number(obj)


def _registered_backends() -> dict[int, str]:
    """id of each registered group's backend objects -> the group's name."""
    owned = {}
    for group in list(c10d._world.pg_map):
        try:
            for device in group._device_types:
                owned[id(_get_backend(group, device))] = group.group_name
        except Exception:
            continue
    return owned


def _group_key(obj, owned: dict[int, str] | None = None) -> str:
    """The name a process group or backend is counted under: a registered group's name (a backend: its group's),
    else ``private:<id>`` (one the candidate built and registered nowhere)."""
    known = _KEYS.get(id(obj))
    if known is not None and known[0] is obj:
        return known[1]
    if _is_group(obj) and obj in c10d._world.pg_map:
        _KEYS[id(obj)] = (obj, obj.group_name)  # a registered group keeps its name (and is kept alive by torch)
        return obj.group_name
    owned = _registered_backends() if owned is None else owned
    return owned.get(id(obj), f"private:{id(obj)}")


_KEYS: dict[int, tuple[Any, str]] = {}  # id of a registered group -> (the group, its name): read on every call


def _groups_of_call(label: str, original: Callable, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The process groups (or backends) a call runs on, by name (``_group_key``), or None where they cannot be
    told. Read on every recorded call: no signature is bound here."""
    kind, _, name = label.partition(".")
    try:
        if kind == "dist":  # its group: the one process group among its arguments, else the world
            if name == "batch_isend_irecv":
                ops = kwargs.get("p2p_op_list", args[0] if args else ())
                return _named_groups(op.group or _default_group() for op in ops)
            group = kwargs.get("group", kwargs.get("process_group"))
            if group is None:
                group = next((value for value in args if _is_group(value)), _default_group())
            return _named_groups([group]) if _is_group(group) else None
        if kind in ("ProcessGroup", "Backend"):
            return _named_groups(args[:1]) if args else None
        if kind in ("functional_op", "c10d_op", "symm_mem"):
            return _named_groups(group for group in map(_as_group, (*args, *kwargs.values())) if group is not None)
    except Exception:  # arguments torch itself will refuse
        return None
    return None


def _named_groups(groups) -> dict[str, Any] | None:
    return {_group_key(group): group for group in groups} or None


def _attribute_groups(named: set[str], label: str, args: tuple, kwargs: dict, world_key: str | None) -> None:
    """Add to ``named`` the groups a recorded data-moving call runs on (``_groups_of_call``, without building
    anything in the common cases: this runs on every recorded call); ``world_key``: the world group's name."""
    kind = label[:label.find(".")]
    if kind in ("ProcessGroup", "Backend"):
        if args:
            named.add(_group_key(args[0]))
        return
    if kind == "dist" and "batch" not in label:
        group = kwargs.get("group", kwargs.get("process_group"))
        if group is None:
            group = next((value for value in args if _is_group(value)), None)
        if group is None and world_key is not None:
            named.add(world_key)
        elif _is_group(group):
            named.add(_group_key(group))
        return
    named.update(_groups_of_call(label, None, args, kwargs) or ())


def _span_of_group(label: str, group, topology: Topology | None) -> str:
    """``label`` with the reach of a collective over ``group`` (``span_label``'s suffixes)."""
    try:
        ranks = _group_ranks_of(group)
    except Exception:  # a group the candidate built itself: its ranks cannot be told
        ranks = None
    return _span(label, ranks, topology)


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
    return _span(label, _reach(label, original, args, kwargs, topology), topology)


def _reach(label: str, original: Callable, args: tuple, kwargs: dict, topology: Topology | None) -> list[int] | None:
    """The global ranks a call connects on several nodes (None on one node, or where they cannot be told)."""
    if topology is None or topology.num_nodes == 1 or label in SYNC_ONLY:
        return None
    kind = label.split(".")[0]
    if kind in WORLD_WIDE:
        return list(range(topology.world_size))
    if kind not in ("dist", "ProcessGroup", "Backend", "functional", "functional_op", "c10d_op"):
        return None
    try:
        return _ranks_reached(label, original, args, kwargs)
    except Exception:  # a call torch itself will refuse; its reach is unknown
        return None


def _span(label: str, ranks: list[int] | None, topology: Topology | None) -> str:
    if topology is None or topology.num_nodes == 1 or not ranks or topology.same_node(ranks):
        return label
    nodes = [topology.node_of(rank) for rank in ranks]
    return label + (NETWORK if len(set(nodes)) == len(nodes) else MIXED)


def _ranks_reached(label: str, original: Callable, args: tuple, kwargs: dict) -> list[int] | None:
    """The global ranks a stock call connects (this rank and its peers), or None where they cannot be told."""
    kind, _, name = label.partition(".")
    if kind in ("functional_op", "c10d_op"):  # an operator: its group is an argument, by name or as an object
        groups = (_as_group(value) for value in (*args, *kwargs.values()))
        return next((_group_ranks_of(group) for group in groups if group is not None), None)
    if kind in ("ProcessGroup", "Backend"):
        group = args[0] if args else None
        if kind == "Backend":
            group = _group_named(_group_key(group))  # a registered group's backend: that group; else unknown
            if group is None:
                return None
        if name in PG_P2P:
            if len(args) <= PG_P2P[name] + 1:
                return None
            return sorted({_rank(), _global_rank(group, int(args[PG_P2P[name] + 1]))})
        return _group_ranks_of(group)
    arguments = _arguments(original, args, kwargs)
    if name == "batch_isend_irecv":
        peers = {_peer_of(op) for op in arguments.get("p2p_op_list") or ()}
        return sorted(peers | {_rank()})
    if kind == "dist" and name in P2P:
        group = arguments.get("group")
        peer = arguments.get(P2P[name])
        if peer is None and arguments.get(f"group_{P2P[name]}") is not None:
            peer = _global_rank(group or dist.group.WORLD, arguments[f"group_{P2P[name]}"])
        return None if peer is None else sorted({_rank(), int(peer)})
    return _group_ranks(arguments.get("group"))


def _peer_of(op) -> int:
    """The global rank a ``P2POp`` exchanges with."""
    return op.peer if op.peer is not None else _global_rank(op.group or dist.group.WORLD, op.group_peer)


def _directions(label: str, original: Callable, args: tuple, kwargs: dict, ranks: list[int], me: int
                ) -> tuple[set[int], set[int]]:
    """(the ranks this call may send this rank's data to, the ranks whose data it may bring here), from ``ranks``
    (the call's reach): one-way calls by their direction, every other call both ways."""
    kind, _, name = label.partition(".")
    others = set(ranks) - {me}
    if kind == "dist":
        arguments = _arguments(original, args, kwargs)
        if name == "batch_isend_irecv":
            ops = list(arguments.get("p2p_op_list") or ())
            return ({_peer_of(op) for op in ops if "send" in getattr(op.op, "__name__", "send")},
                    {_peer_of(op) for op in ops if "send" not in getattr(op.op, "__name__", "send")})
        rooted = FROM_SOURCE.get(name) or TO_DESTINATION.get(name)
        if rooted:
            root = arguments.get(rooted)
            if root is None and arguments.get(f"group_{rooted}") is not None:
                root = _global_rank(arguments.get("group") or dist.group.WORLD, arguments[f"group_{rooted}"])
            if root is not None:
                root = int(root)
                if name in FROM_SOURCE:
                    return (others, set()) if root == me else (set(), {root})
                return (set(), others) if root == me else ({root}, set())
    if name in SENDS or (kind == "c10d_op" and "send" in name):
        return others, set()
    if name in RECEIVES or (kind == "c10d_op" and "recv" in name):
        return set(), others
    return others, others


def _as_group(value) -> dist.ProcessGroup | None:
    """The process group an operator's argument names: a group's name, the group, or the group boxed for the
    dispatcher (``pg.boxed()``, what ``torch.ops.c10d`` operators take); None for any other argument."""
    if isinstance(value, str):
        return _group_named(value)
    if _is_group(value):
        return value
    if isinstance(value, torch.ScriptObject):
        try:
            return dist.ProcessGroup.unbox(value)
        except Exception:  # another TorchScript class (a ReduceOp, a Work)
            return None
    return None


def _group_ranks(group) -> list[int] | None:
    """The global ranks of ``group`` as torch's calls take it: None (the world), a ProcessGroup, a group's name,
    or (functional collectives) a list of global ranks; None for what cannot be told (a device mesh)."""
    if group is None:
        return list(range(_world_size()))
    if isinstance(group, str):
        group = _group_named(group)
    if _is_group(group):
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
            return recorder.call(label, packet, args, kwargs, functools.partial(base.__call__, self))

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
            return recorder.call(label, overload, args, kwargs, functools.partial(base.__call__, self))

    recorded = RecordedOverload.__new__(RecordedOverload)
    recorded.__dict__.update(overload.__dict__)
    return recorded


def _watched(modules: dict[str, Any]) -> dict[str, Any]:
    timing, channel, worker, recorder = modules["timing"], modules["channel"], modules["worker"], modules["recorder"]
    watched = {
        "time.perf_counter": time.perf_counter, "time.monotonic": time.monotonic, "time.time": time.time,
        "torch.cuda.synchronize": torch.cuda.synchronize, "torch.cuda.Event": torch.cuda.Event,
        "torch.cuda.Event.record": torch.cuda.Event.record,
        "torch.cuda.Event.elapsed_time": torch.cuda.Event.elapsed_time,
        "channel.send_reply": channel.send_reply, "channel.to_plain": channel.to_plain,
        "channel.recv_job": channel.recv_job, "worker.to_plain": worker.to_plain,
        "worker.send_reply": worker.send_reply, "worker.recv_job": worker.recv_job,
    }
    for name in ("run", "exact", "call", "recorded", "_called", "guarded", "make_inputs", "upstream_inputs",
                 "time_prepare", "time_copies", "time_refresh", "time_repeat", "time_check", "time_finish",
                 "time_outputs"):
        watched[f"Worker.{name}"] = getattr(worker.Worker, name, None)
    for name in ("prepare", "make_copies", "refresh", "repeat", "check", "outputs_of", "finish", "outputs", "_call",
                 "_cycle"):
        watched[f"TimedLoop.{name}"] = getattr(timing.TimedLoop, name)
    for name in ("sync", "aligned_start", "largest_over_ranks", "summarise", "_summaries", "_tensor_summary", "refusal",
                 "_described", "change_views", "_function_modes", "_dispatch_modes", "_no_torch_function", "_Tensor",
                 "_Parameter", "_seal", "_changed", "_hooks", "_random_below", "_values_at", "_urandom", "_sleep",
                 "_getprofile", "_gettrace"):
        watched[f"timing.{name}"] = getattr(timing, name)
    # the recorder: its methods, where its labels go, and whether it records at all
    for name in ("recording", "record", "_note", "go_live", "begin_call", "window", "_compare", "_run_excused",
                 "_relayed", "_sequence_numbers", "_enter", "_leave", "call"):
        watched[f"StockCallRecorder.{name}"] = getattr(StockCallRecorder, name)
    watched["recorder.class"] = type(recorder)
    watched["recorder.sink"] = recorder.sink
    watched["recorder.used"] = recorder.used
    watched["recorder.checks"] = recorder.checks
    for name, function in list(watched.items()):  # a function's code can be swapped without swapping the function
        code = getattr(function, "__code__", None)
        if code is not None:
            watched[f"{name}.__code__"] = code
    for name in (*DIST_FUNCTIONS, "barrier"):  # the recorder's wrappers, once installed
        watched[f"dist.{name}"] = getattr(dist, name, None)
        watched[f"c10d.{name}"] = getattr(c10d, name, None)
    for owner, name in recorder.patched:  # every wrapper it set: ProcessGroup's, Backend's, the stores', ops'
        watched[f"{getattr(owner, '__name__', type(owner).__name__)}.{name}#{id(owner)}"] = _attribute(owner, name)
    if "symm_mem" in modules:  # the peer-memory fence's wrappers (PeerMemoryFence)
        symm_mem = modules["symm_mem"]
        for name in ("rendezvous", "set_backend", "get_symm_mem_workspace"):
            watched[f"symm_mem.{name}"] = getattr(symm_mem, name, None)
        for name in ("rendezvous", "empty_strided_p2p"):
            watched[f"_SymmetricMemory.{name}"] = getattr(getattr(symm_mem, "_SymmetricMemory", None), name, None)
    return watched


def _attribute(owner: Any, name: str) -> Any:
    """``owner.name`` as it is bound now (a class's own entry: a method, not a bound method), or None."""
    try:
        return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name, None)
    except (KeyError, AttributeError, RuntimeError):
        return None


def snapshot_harness(worker: Any, recorder: StockCallRecorder, fence: bool = False) -> dict[str, Any]:
    """The objects the harness relies on, as they are now (call after the recorder, and any peer-memory fence,
    is installed and before the candidate is imported). ``worker`` is the rank's worker module (passed in:
    this module sits below it). Keeps the modules, so later checks need no import."""
    import pkb.runtime.timed_loop as timing
    import pkb.runtime.channel as channel

    modules = {"timing": timing, "channel": channel, "worker": worker, "recorder": recorder}
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
