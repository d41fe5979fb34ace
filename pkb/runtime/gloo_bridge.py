"""gloo made to behave as NCCL does, so code written for GPUs is judged the same in ``cpu`` mode.

In ``cpu`` and ``shared-gpu`` modes the process group is gloo. Where gloo refuses or changes what
NCCL accepts, ``install()`` replaces the stock ``torch.distributed`` entry points (one object, set on
both ``torch.distributed`` and ``distributed_c10d``, so identities torch compares still hold) with
versions that reproduce NCCL's behaviour on top of gloo's own calls:

- ``all_gather_into_tensor`` / ``reduce_scatter_tensor``: any output (input) shape that holds W times
  the elements, e.g. a stacked ``[W, *shape]`` buffer or 0-d inputs (NCCL checks element counts; gloo
  wants ``[W * n0, ...]``).
- ``all_gather``, ``all_to_all``, ``gather``, ``scatter`` with tensors of different shapes per rank
  (NCCL runs uneven lists as grouped point-to-point or broadcast calls; gloo refuses them).
- ``reduce``: the non-root ranks' buffers are left as they were (gloo uses them as scratch space;
  NCCL only reads them).
- fp8 tensors in calls that only move data (broadcast, gathers, scatters, all-to-all, send/recv):
  moved as bytes (gloo: "Invalid scalar type").
- point-to-point with the rank itself as the peer (``isend``/``irecv``/``batch_isend_irecv``), which
  NCCL allows and gloo's transport cannot do.
- in ``shared-gpu`` mode, CUDA tensors: point to point (gloo fails with "Bad address") and the
  collectives below (``all_reduce``, the gathers, scatters, reductions, broadcast and all-to-alls)
  run on host copies, the tensors the call writes copied back, so a rank's GPU code (a reference
  included: pkb.runtime.worker) needs no CUDA path of gloo's.

A bridged call that NCCL would run asynchronously completes before it returns and gives back a
finished work object (``wait``, ``result()`` and ``get_future()`` as NCCL's: the result is the tensors
the call writes). What is not bridged (and so fails in ``cpu`` mode as gloo fails) is listed in
docs/architecture.md, "cpu mode and NCCL".
"""

from __future__ import annotations

import collections
import functools
import inspect
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                     "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, name))

_original: dict[str, Callable] = {}
_signature: dict[str, inspect.Signature] = {}
_bridges: dict[str, Callable] = {}


class DoneWork:
    """The work object of a bridged call that finished before it returned. ``outputs``: the tensors the
    call writes (or sends), which ``result()`` and the future's value give back, as NCCL's work does."""

    def __init__(self, on_wait: Callable[[], None] | None = None, outputs: Sequence[torch.Tensor] = ()):
        self._on_wait = on_wait
        self._outputs = list(outputs)

    def wait(self, timeout=None) -> bool:
        if self._on_wait is not None:
            on_wait, self._on_wait = self._on_wait, None
            on_wait()
        return True

    def is_completed(self) -> bool:
        return self._on_wait is None

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def synchronize(self) -> None:
        self.wait()

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return list(self._outputs)

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(self.result())
        return future


class StagedWork(DoneWork):
    """A gloo work on a host copy; ``wait`` waits for it, then runs ``then`` (copy back to the GPU)."""

    def __init__(self, work, then: Callable[[], None] | None = None, keep: Any = None,
                 outputs: Sequence[torch.Tensor] = ()):
        super().__init__(self._finish, outputs)
        self._work, self._then, self._keep = work, then, keep

    def _finish(self) -> None:
        if self._work is not None:
            self._work.wait()
        if self._then is not None:
            self._then()
        self._keep = None


def _bridge(name: str):
    def register(fn: Callable) -> Callable:
        _bridges[name] = fn
        return fn
    return register


def _call(name: str, *args, **kwargs):
    """The stock (gloo) function itself."""
    return _original[name](*args, **kwargs)


def _arguments(name: str, args: tuple, kwargs: dict) -> dict:
    bound = _signature[name].bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype in FP8_DTYPES else tensor


def _is_fp8(*tensors) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES for t in tensors)


def _global_rank(group, group_rank: int) -> int:
    return group_rank if group is None or group is c10d.GroupMember.WORLD else dist.get_global_rank(group, group_rank)


def _group_rank_of(group, global_rank: int | None, group_rank: int | None) -> int:
    if group_rank is not None:
        return group_rank
    return global_rank if group is None or group is c10d.GroupMember.WORLD else dist.get_group_rank(group, global_rank)


def _done(async_op: bool, *written) -> DoneWork | None:
    """What a bridged call returns: a finished work object whose ``result()`` is the ``written`` tensors
    (tensors or lists of them), or None for a blocking call."""
    return DoneWork(outputs=_tensors(written)) if async_op else None


def _tensors(values) -> list[torch.Tensor]:
    """The tensors among ``values``, in lists and tuples too."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(_tensors(value))
    return found


def _through_flat(name: str, out: torch.Tensor, tensor: torch.Tensor, async_op: bool, **kwargs):
    """Call ``name`` on flat views of ``out`` and ``tensor`` (what gloo accepts), then fill ``out``."""
    flat = out.view(-1) if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype, device=out.device)
    _call(name, flat.view(tensor.dtype), tensor.reshape(-1).contiguous(), **kwargs)
    if flat.data_ptr() != out.data_ptr() or not out.is_contiguous():
        out.copy_(flat.view(out.shape))
    return _done(async_op, out)


# -- gathers and scatters of whole tensors ---------------------------------------------------------------


@_bridge("all_gather_into_tensor")
def all_gather_into_tensor(*args, **kwargs):
    a = _arguments("all_gather_into_tensor", args, kwargs)
    out, tensor, group = a["output_tensor"], a["input_tensor"], a["group"]
    world_size = dist.get_world_size(group)
    if out.numel() != world_size * tensor.numel():
        return _call("all_gather_into_tensor", *args, **kwargs)  # torch's own error
    return _through_flat("all_gather_into_tensor", out, _bytes(tensor), a["async_op"], group=group)


@_bridge("reduce_scatter_tensor")
def reduce_scatter_tensor(*args, **kwargs):
    a = _arguments("reduce_scatter_tensor", args, kwargs)
    out, tensor, group = a["output"], a["input"], a["group"]
    if tensor.numel() != dist.get_world_size(group) * out.numel() or (out.dim() <= 1 and tensor.dim() <= 1):
        return _call("reduce_scatter_tensor", *args, **kwargs)
    return _through_flat("reduce_scatter_tensor", out, tensor, a["async_op"], op=a["op"], group=group)


@_bridge("all_gather")
def all_gather(*args, **kwargs):
    a = _arguments("all_gather", args, kwargs)
    outs, tensor, group = a["tensor_list"], a["tensor"], a["group"]
    uneven = any(t.shape != tensor.shape or t.dtype != tensor.dtype for t in outs)
    if not uneven and not _is_fp8(tensor):
        return _call("all_gather", *args, **kwargs)
    if not uneven:
        _call("all_gather", [_bytes(t) for t in outs], _bytes(tensor), group=group)
        return _done(a["async_op"], outs)
    rank = dist.get_rank(group)
    for source, out in enumerate(outs):  # NCCL's way with uneven shapes: one broadcast per rank
        if out.numel() == 0 and (source != rank or tensor.numel() == 0):
            continue
        buffer = tensor.reshape(-1).contiguous() if source == rank else torch.empty(out.numel(), dtype=out.dtype,
                                                                                    device=out.device)
        _call("broadcast", _bytes(buffer), src=_global_rank(group, source), group=group)
        out.copy_(buffer.view(out.shape))
    return _done(a["async_op"], outs)


@_bridge("all_reduce")
def all_reduce(*args, **kwargs):
    """gloo's own: installed only to stage CUDA tensors in shared-gpu mode (``_STAGING_ONLY``)."""
    return _call("all_reduce", *args, **kwargs)


_STAGING_ONLY = frozenset({"all_reduce"})  # the stock function stays in place in cpu mode


@_bridge("all_to_all")
def all_to_all(*args, **kwargs):
    a = _arguments("all_to_all", args, kwargs)
    outs, ins, group = a["output_tensor_list"], a["input_tensor_list"], a["group"]
    # Always through all_to_all_single with split sizes: each rank sees only its own lists, so all
    # must take the same path whether or not theirs are even.
    send = torch.cat([_bytes(t).reshape(-1) for t in ins])
    received = torch.empty(sum(t.numel() for t in outs), dtype=_bytes(outs[0]).dtype, device=outs[0].device)
    _call("all_to_all_single", received, send, output_split_sizes=[t.numel() for t in outs],
          input_split_sizes=[t.numel() for t in ins], group=group)
    for out, piece in zip(outs, received.split([t.numel() for t in outs])):
        out.copy_(piece.view(out.dtype).view(out.shape))
    return _done(a["async_op"], outs)


@_bridge("all_to_all_single")
def all_to_all_single(*args, **kwargs):
    a = _arguments("all_to_all_single", args, kwargs)
    if not _is_fp8(a["input"]):
        return _call("all_to_all_single", *args, **kwargs)
    return _call("all_to_all_single", _bytes(a["output"]), _bytes(a["input"]), a["output_split_sizes"],
                 a["input_split_sizes"], group=a["group"], async_op=a["async_op"])


@_bridge("broadcast")
def broadcast(*args, **kwargs):
    a = _arguments("broadcast", args, kwargs)
    if not _is_fp8(a["tensor"]):
        return _call("broadcast", *args, **kwargs)
    return _call("broadcast", **{**a, "tensor": _bytes(a["tensor"])})


@_bridge("reduce")
def reduce(*args, **kwargs):
    a, group, root, is_root = _rooted("reduce", args, kwargs, "dst")
    if is_root:
        return _call("reduce", *args, **kwargs)
    _call("reduce", **{**a, "tensor": a["tensor"].clone(), "async_op": False})  # NCCL only reads it here
    return _done(a["async_op"], a["tensor"])


def _rooted(name: str, args: tuple, kwargs: dict, root_name: str) -> tuple[dict, Any, int, bool]:
    """(the call's arguments, its group, the root's rank in that group, whether this rank is the root)."""
    a = _arguments(name, args, kwargs)
    root = _group_rank_of(a["group"], a.get(root_name), a.get(f"group_{root_name}"))
    return a, a["group"], root, dist.get_rank(a["group"]) == root


def _receive_into(tensor: torch.Tensor, source: int, group) -> None:
    """Receive from group rank ``source`` into ``tensor`` (any strides) through a contiguous buffer."""
    buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    _bridges["recv"](buffer, src=_global_rank(group, source), group=group)
    tensor.copy_(buffer)


@_bridge("gather")
def gather(*args, **kwargs):
    """Always point to point, as NCCL runs it: only the root knows whether its list is uneven."""
    a, group, root, is_root = _rooted("gather", args, kwargs, "dst")
    tensor = a["tensor"]
    if not is_root:
        _bridges["send"](tensor.contiguous(), dst=_global_rank(group, root), group=group)
        return _done(a["async_op"], tensor)
    for source, out in enumerate(a["gather_list"]):
        if source == root:
            out.copy_(tensor.reshape(out.shape))
        else:
            _receive_into(out, source, group)
    return _done(a["async_op"], a["gather_list"])


@_bridge("scatter")
def scatter(*args, **kwargs):
    """Always point to point, as NCCL runs it: only the root knows whether its list is uneven."""
    a, group, root, is_root = _rooted("scatter", args, kwargs, "src")
    tensor = a["tensor"]
    if not is_root:
        _receive_into(tensor, root, group)
        return _done(a["async_op"], tensor)
    for target, piece in enumerate(a["scatter_list"]):
        if target == root:
            tensor.copy_(piece.reshape(tensor.shape))
        else:
            _bridges["send"](piece.contiguous(), dst=_global_rank(group, target), group=group)
    return _done(a["async_op"], tensor)


# -- CUDA tensors in shared-gpu mode: staged through host memory ------------------------------------------


def _never(tensor: torch.Tensor) -> bool:
    return False


def _is_cuda(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda


# Which tensors a call moves through host copies: CUDA ones in shared-gpu mode (install), none
# otherwise. Tests put a predicate here that stands CPU tensors in for CUDA ones.
_stages: Callable[[torch.Tensor], bool] = _never

# The arguments each staged collective writes: copied back from the host copies after the call. Only
# these, so an output that is a view of an input (in-place gather or reduce-scatter) keeps the result.
_WRITES = {"all_reduce": ("tensor",), "all_gather_into_tensor": ("output_tensor",),
           "reduce_scatter_tensor": ("output",), "all_gather": ("tensor_list",),
           "all_to_all": ("output_tensor_list",), "all_to_all_single": ("output",), "broadcast": ("tensor",),
           "reduce": ("tensor",), "gather": ("gather_list",), "scatter": ("tensor",)}


def _to_host(value):
    """``value`` with the tensors ``_stages`` picks replaced by host copies (in lists and tuples too)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True) if _stages(value) else value
    if isinstance(value, (list, tuple)) and _tensors(value):
        return [_to_host(v) for v in value]
    return value


def _copy_back(written, host) -> None:
    if isinstance(written, torch.Tensor):
        if host is not written:
            with torch.no_grad():  # the collective writes the data, as NCCL does, outside autograd
                written.copy_(host)
    elif isinstance(written, (list, tuple)):
        for tensor, copy in zip(written, host):
            _copy_back(tensor, copy)


def _staged(name: str, bridge: Callable) -> Callable:
    """``bridge``, run on host copies when the call has tensors to stage (CUDA tensors in shared-gpu
    mode): the copies are made after the device's pending work on them (a blocking copy), the call
    runs to completion on them, and the tensors it writes get the result before it returns (the work
    object of an asynchronous call is already finished, as for every bridged call)."""

    def staged(*args, **kwargs):
        if _stages is _never:
            return bridge(*args, **kwargs)
        a = _arguments(name, args, kwargs)
        if not any(_stages(t) for t in _tensors(a.values())):
            return bridge(*args, **kwargs)
        host = {key: _to_host(value) for key, value in a.items()}
        bridge(**{**host, "async_op": False})
        for key in _WRITES[name]:
            _copy_back(a[key], host[key])
        return _done(a["async_op"], *(a[key] for key in _WRITES[name]))

    return staged


# -- point to point: the rank itself as a peer, CUDA tensors staged in shared-gpu mode -------------------

_self_sent: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
_self_waiting: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)


def _self_key(group, tag: int) -> tuple:
    return (id(group) if group is not None else None, tag)


def _send_to_self(tensor: torch.Tensor, key: tuple) -> DoneWork:
    if _self_waiting[key]:
        receiver, work = _self_waiting[key].popleft()
        receiver.copy_(tensor)
        work.wait()
    else:
        _self_sent[key].append(tensor.clone())
    return DoneWork(outputs=[tensor])


def _receive_from_self(tensor: torch.Tensor, key: tuple) -> DoneWork:
    if _self_sent[key]:
        tensor.copy_(_self_sent[key].popleft())
        return DoneWork(outputs=[tensor])
    filled = []

    def check():
        if not filled:
            raise RuntimeError("irecv from this rank itself was never matched by an isend to itself")

    work = DoneWork(check, [tensor])
    _self_waiting[key].append((tensor, DoneWork(lambda: filled.append(True))))
    return work


def _peer(a: dict, global_name: str, group_name: str) -> tuple[int | None, bool]:
    """(the peer's global rank or None for any source, whether it is this rank)."""
    group = a.get("group")
    if a.get(group_name) is not None:
        peer = _global_rank(group, a[group_name])
    else:
        peer = a.get(global_name)
    return peer, peer is not None and peer == dist.get_rank()


def _point_to_point(name: str, sends: bool, blocking: bool):
    peer_name, group_peer_name = ("dst", "group_dst") if sends else ("src", "group_src")

    def bridged(*args, **kwargs):
        a = _arguments(name, args, kwargs)
        tensor = a["tensor"]
        peer, to_self = _peer(a, peer_name, group_peer_name)
        if to_self:
            key = _self_key(a.get("group"), a.get("tag", 0))
            work = _send_to_self(tensor, key) if sends else _receive_from_self(tensor, key)
            if blocking:
                work.wait()
                return None if sends else peer
            return work
        staged = _stages(tensor)
        if not staged and not _is_fp8(tensor):
            return _call(name, *args, **kwargs)
        host = tensor.detach().to("cpu", copy=True) if staged and sends else (
            torch.empty(tensor.shape, dtype=tensor.dtype) if staged else tensor)
        result = _call(name, **{**a, "tensor": _bytes(host.contiguous() if sends else host)})
        then = (lambda: tensor.copy_(host)) if staged and not sends else None
        if blocking:
            if then:
                then()
            return result
        return StagedWork(result, then, keep=host, outputs=[tensor])

    return bridged


for _name, _sends, _blocking in (("isend", True, False), ("irecv", False, False), ("send", True, True),
                                 ("recv", False, True)):
    _bridges[_name] = _point_to_point(_name, _sends, _blocking)


# -- installing ------------------------------------------------------------------------------------------


def install(stage_cuda: bool = False) -> None:
    """Bridge gloo to NCCL's behaviour in this process (a rank whose group is gloo); ``stage_cuda``
    (shared-gpu mode): CUDA tensors are moved through host memory. Idempotent."""
    global _stages
    _stages = _is_cuda if stage_cuda else _never
    for name, bridge in _bridges.items():
        if name in _original or (name in _STAGING_ONLY and not stage_cuda):
            continue
        original = getattr(c10d, name)
        _original[name] = original
        _signature[name] = inspect.signature(original)
        bridged = functools.wraps(original)(_staged(name, bridge) if stage_cuda and name in _WRITES else bridge)
        bridged.__pkb_bridged__ = True
        setattr(c10d, name, bridged)
        setattr(dist, name, bridged)
