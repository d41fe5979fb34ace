"""The timing protocol (docs/timing.md): the rank side, driven by the parent one phase at a time.

``TimedLoop`` lives in each rank process. The parent sends ``prepare`` (the first input slots, warm-up, an estimate of
one call's time and of one slot's bytes), then ``copies`` (as many input slots as the parent decided there are calls
per repeat), then for each repeat ``refresh`` (new values in every slot, from entropy sent with the refresh),
``repeat`` (an aligned start, then one call on each slot in turn, back to back, between device-wide synchronizes) and
``check`` (summaries of every slot's last output under projections the parent chose after the repeat, and the full
outputs of the slots it names), then ``finish`` (synchronize, join any thread the candidate left running) and
``outputs`` (the last output of every slot).

Every call's inputs get their last values just before the call: the loop copies a block of rows (an eighth of the
largest floating tensor, along its first dimension of at least 8 rows) from a second valid instance of the slot's
inputs made with the slot (its *donor*), at rows that entropy sent with the repeat job chooses (``change_block``). An
answer worked out ahead, from the values the slots held when an earlier call ran, is wrong in that block, which the
parent's checks find; to compute ahead, a candidate would have to redo this harness's change itself (docs/timing.md,
"Open").

The parent times every phase with its own clock, from sending the job until the last rank replies: that clock is the
one the verdict uses, since no code in a rank process can change it; the rank's own wall clock and CUDA events are
reported beside it as a cross-check. The number of calls per repeat is the parent's, sent with each ``repeat``.

Every output of a call the loop makes must be plain data right when the call returns (``refusal``): a plain
``torch.Tensor`` (or ``nn.Parameter``), numbers, strings, and lists, tuples and dicts of them, with no torch function or
dispatch mode left active. A tensor subclass can defer its work to whenever the harness first touches it (the check,
after the parent's clock has stopped), and so can a mode left on torch's stack: either is refused (``OutputRefused``,
``tampered``).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sys
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from pkb.runtime.channel import tensor_bytes

CPU_CACHE_BYTES = 32 << 20  # what to outgrow on a CPU, where no L2 size is reported per device
CHANGE_SHARE = 8  # a call's inputs take 1/CHANGE_SHARE of their largest floating tensor from the donor
IDLE_CHECK_S = 0.1  # leftover threads that together used no CPU over this long are blocked (waiting), not working
HOOK_SET = ("a Python profile, trace or monitoring hook was set during the timed calls: it runs the candidate's code "
            "while the harness seals and checks the outputs")
SEALED_SLOTS = 8  # slots whose outputs are sealed at the end of each repeat (``_seal``): drawn then, at random
SEALED_VALUES = 16  # values of each tensor of a sealed output, at places drawn then
MAX_DEPTH = 16  # nesting of lists, tuples and dicts an output may have

# The harness's own clocks, synchronisation and torch entry points, bound before any candidate code is imported, so a
# candidate that patches the modules' attributes does not change what the harness calls.
_perf_counter = time.perf_counter
_cuda_synchronize = torch.cuda.synchronize
_barrier = dist.barrier
_all_reduce = dist.all_reduce
_Event = torch.cuda.Event
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_function_modes = torch._C._len_torch_function_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack
_no_torch_function = torch._C.DisableTorchFunction
_urandom = os.urandom
_sleep = time.sleep
_getprofile, _gettrace = sys.getprofile, sys.gettrace
_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, torch.dtype, torch.device)
_CONTAINER_METHODS = {list: ("__iter__", "__len__", "__getitem__"), tuple: ("__iter__", "__len__", "__getitem__"),
                      dict: ("__iter__", "__len__", "__getitem__", "items", "keys", "values")}


class OutputRefused(Exception):
    """An output that is not plain data when its call returns (the module's docstring): the candidate's failure."""


def cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    return CPU_CACHE_BYTES


def _mixed(part: int, *salt) -> int:
    digest = hashlib.blake2b(repr((int(part), *salt)).encode(), digest_size=8, person=b"pkb-timing").digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def instance_seeds(seed: tuple, round_index: int, entropy: int, instance: int) -> tuple:
    """The seeds of a slot's inputs (``instance`` 0) in refresh round ``round_index``, or of its donor (1; round -1,
    entropy 0: the donor is made once, with the slot): each of the slot's own seeds (this rank's, the one all ranks
    share) mixed with the round, the entropy the parent sent with that round's refresh, and the instance. Each part is
    mixed alone, so the shared seed stays the same on every rank. The parent's exact answer to a timed call rebuilds
    its inputs from the same numbers (pkb.runtime.worker, ``time_exact``)."""
    return tuple(_mixed(part, round_index, entropy, instance) for part in seed)


def change_block(shape: tuple, entropy: int, call: int) -> tuple[int, int, int] | None:
    """The block of a tensor of ``shape`` that call ``call`` of a repeat takes from the donor, as (dim, start, length):
    along its first dimension of at least CHANGE_SHARE (else its first; a 0-d tensor whole), length 1/CHANGE_SHARE
    of it (at least 1), starting at a row drawn from the repeat's ``entropy`` and the call (the same on every rank:
    a tensor replicated across ranks stays replicated). None for an empty tensor."""
    if not shape:
        return (-1, 0, 1)
    if 0 in shape:
        return None
    dim = next((d for d, size in enumerate(shape) if size >= CHANGE_SHARE), 0)
    length = max(1, shape[dim] // CHANGE_SHARE)
    return dim, _mixed(entropy, "block", call) % (shape[dim] - length + 1), length


def donor_pair(inputs: tuple, donor_inputs: tuple):
    """(the tensor of ``inputs`` the change writes, its counterpart in ``donor_inputs``): the largest floating tensor
    (the first of them) that holds data, not structure, matched by position among the tensors of each; None where
    there is none or the donor's differs in shape or dtype. A floating tensor of zeros and ones alone is a mask (an
    expert mask, a one-hot routing) that other inputs agree with (moe_pre_all2all's split sizes): rows of another
    input set's mask made inputs no reference takes, and every timing of such a problem was pkb's failure; a sparse
    tensor (torchharmonics' convolution) has no rows to take, and narrowing it failed the same way."""
    mine, theirs = _tensors(inputs), _tensors(donor_inputs)
    floating = [index for index, tensor in enumerate(mine) if tensor.is_floating_point() and tensor.numel()
                and tensor.layout is torch.strided and not _zeros_and_ones(tensor)]  # a sparse one has no rows
    if not floating or len(mine) != len(theirs):
        return None
    index = max(floating, key=lambda i: (mine[i].numel(), -i))
    target, donor = mine[index], theirs[index]
    if donor.shape != target.shape or donor.dtype != target.dtype or donor.device != target.device:
        return None
    return target.data, donor.data  # .data: a parameter's values, written outside autograd


def _zeros_and_ones(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` (a floating one) is 0 or 1."""
    with _no_torch_function():
        values = tensor.detach()
        return bool(((values == 0) | (values == 1)).all())


def change_views(pair, entropy: int, call: int):
    """(where call ``call``'s change writes, what it copies there): views of ``pair`` (``donor_pair``'s) at the
    call's block (``change_block``), or None where the call's inputs do not change."""
    if pair is None:
        return None
    target, donor = pair
    block = change_block(tuple(target.shape), entropy, call)
    if block is None:
        return None
    dim, start, length = block
    if dim < 0:
        return target, donor
    return target.narrow(dim, start, length), donor.narrow(dim, start, length)


def apply_change(pair, entropy: int, call: int) -> None:
    """Copy call ``call``'s block (``change_block``) of the donor into its target (``pair``: ``donor_pair``'s)."""
    views = change_views(pair, entropy, call)
    if views is not None:
        views[0].copy_(views[1])


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor of ``value`` (an input set), in order: lists, tuples, dicts by key, a module's parameters and
    buffers."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    if isinstance(value, dict):
        return [tensor for key in sorted(value, key=str) for tensor in _tensors(value[key])]
    if isinstance(value, torch.nn.Module):
        return [*value.parameters(), *value.buffers()]
    return []


def _same_layout(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous() == b.is_contiguous()
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_layout(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or isinstance(a, dict) or isinstance(b, dict):
        return False
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - an object without a plain equality: not the same layout (the slot is replaced)
        return False


def _copy_into(old, fresh) -> None:
    if isinstance(old, torch.Tensor):
        old.data.copy_(fresh)  # through .data: the tensor's version counter does not move
    elif isinstance(old, (list, tuple)):
        for x, y in zip(old, fresh):
            _copy_into(x, y)


def refusal(value: Any, modes: tuple[int, int], path: str = "out", depth: int = 0) -> str | None:
    """Why ``value`` (a call's output, as the call returned it) is not plain data, or None. ``modes``: the torch
    function and dispatch mode stack depths before the call (a mode the call left active is refused too)."""
    if depth == 0 and (_function_modes(), _dispatch_modes()) != modes:
        return ("the call left a torch function or dispatch mode active (torch's mode stacks were "
                f"{modes[0]} and {modes[1]} deep before it, {_function_modes()} and {_dispatch_modes()} after)")
    kind = type(value)
    if kind is _Tensor or kind is _Parameter:
        if value.device.type == "meta":
            return f"{path} is a meta tensor (no values)"
        return None
    if kind in _PLAIN_LEAVES:
        return None
    if depth >= MAX_DEPTH:
        return f"{path} is nested more than {MAX_DEPTH} deep"
    if kind in _CONTAINER_METHODS or _plain_tuple(kind):
        if kind is dict:
            for key, item in value.items():
                if type(key) not in (str, int):
                    return f"{path} has a key of type {type(key).__qualname__} (str and int keys only)"
                found = refusal(item, modes, f"{path}[{key!r}]", depth + 1)
                if found:
                    return found
            return None
        for index, item in enumerate(value):
            found = refusal(item, modes, f"{path}[{index}]", depth + 1)
            if found:
                return found
        return None
    what = "a subclass of torch.Tensor" if isinstance(value, torch.Tensor) else "not a plain value"
    return f"{path} is a {kind.__module__}.{kind.__qualname__} ({what})"


def _plain_tuple(kind: type) -> bool:
    """Whether ``kind`` is a tuple that iterates as a tuple does (a named tuple, torch.return_types, torch.Size): its
    items are read without running code of the candidate's."""
    return issubclass(kind, tuple) and (kind is torch.Size or all(getattr(kind, name) is getattr(tuple, name)
                                                                   for name in _CONTAINER_METHODS[tuple]))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        _cuda_synchronize(device)  # device-wide: every stream of this device


def aligned_start(device: torch.device) -> None:
    """Every rank's host leaves here together: finish local work, then a barrier that completes on the device."""
    sync(device)
    _barrier()
    sync(device)


def largest_over_ranks(device: torch.device, value: float) -> float:
    """The largest of every rank's ``value`` (at least 1e-9); a collective call."""
    on = device if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([max(value, 1e-9)], dtype=torch.float64, device=on)
    _all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


class TimedLoop:
    """One case's timing in one rank process: ``fn`` called once on each of its input slots per repeat, each slot's
    inputs changed from its donor just before the call."""

    def __init__(self, fn: Callable, make_inputs: Callable[[tuple], tuple], seeds: list[tuple], device: torch.device,
                 window: Callable = contextlib.nullcontext):
        self.fn = fn
        self.window = window  # opened around each repeat's calls (what records the stock calls they make)
        self.make_inputs = make_inputs
        self.seeds = [tuple(seed) for seed in seeds]
        self.device = device
        self.copies: list[tuple] = []  # per slot, its inputs
        self.donors: list = []  # per slot, (the tensor its calls' changes write, the donor's counterpart) or None
        self.last_outputs: list[Any] = []  # per slot, the output of the last call on it
        self.round = -1  # the refresh round the slots hold (-1: the values they were made with)
        self.graph = None
        self.modes = (_function_modes(), _dispatch_modes())
        self.hooks = _hooks()  # Python's profile, trace and monitoring hooks before any call of the loop
        self.sealed: list = []  # (slot, path, places, values) of outputs sealed at the end of the last repeat
        self.refused: str | None = None  # the first output refused outside a repeat (warm-up, first touches)
        self.threads_before = set(threading.enumerate())
        self._add_copies(1)

    def _call(self, slot: int) -> None:
        output = self.fn(*self.copies[slot])
        self.last_outputs[slot] = output
        if type(output) is not _Tensor or (_function_modes(), _dispatch_modes()) != self.modes:
            self.refused = self.refused or _described(refusal(output, self.modes), "an untimed call")

    def _raise_refused(self) -> None:
        if self.refused:
            raise OutputRefused(self.refused)

    def prepare(self, num_warmup: int, warmup_s: float, **_) -> dict:
        """Warm up on the first two slots (at least ``num_warmup`` calls, and ``warmup_s`` seconds) and estimate one
        call's time from a second batch of calls (the first pays one-off costs: lazy module loading, cuBLAS
        heuristics, allocator growth; an estimate that counted them was up to 10x too slow on an H200). Every rank
        makes the same calls (they are collective); the slowest rank's estimate and the largest slot (its inputs,
        its donor and its output) are sent."""
        self._add_copies(2)
        aligned_start(self.device)
        num_warmup = max(num_warmup, len(self.copies))
        self._cycle(num_warmup)
        sync(self.device)
        began = _perf_counter()
        self._cycle(num_warmup)
        sync(self.device)
        per_call = largest_over_ranks(self.device, (_perf_counter() - began) / num_warmup)
        self._cycle(max(0, math.ceil(warmup_s / per_call) - 2 * num_warmup))
        sync(self.device)
        self._raise_refused()
        donor = tensor_bytes(self.donors[0][1]) if self.donors[0] is not None else 0
        one_slot = tensor_bytes(self.copies[0]) + tensor_bytes(self.last_outputs[0]) + donor
        return {"per_call_s": per_call, "copy_bytes": int(largest_over_ranks(self.device, one_slot))}

    def _cycle(self, count: int) -> None:
        for call in range(count):
            self._call(call % len(self.copies))

    def _add_copies(self, count: int) -> None:
        while len(self.copies) < min(count, len(self.seeds)):
            seed = self.seeds[len(self.copies)]
            inputs = self.make_inputs(instance_seeds(seed, -1, 0, 0))
            self.copies.append(inputs)
            self.donors.append(donor_pair(inputs, self.make_inputs(instance_seeds(seed, -1, 0, 1))))
            self.last_outputs.append(None)

    def make_copies(self, num_copies: int, cuda_graph: bool = False) -> None:
        """``num_copies`` input slots in all (at most as many as there are seeds), each called once (untimed: its
        first touch is not in a timed repeat); with ``cuda_graph`` (a GPU), one call on each slot captured as a graph
        that every repeat replays (with no change of the inputs between calls: docs/timing.md)."""
        self._add_copies(num_copies)
        del self.copies[num_copies:], self.donors[num_copies:], self.last_outputs[num_copies:]
        aligned_start(self.device)
        self._cycle(len(self.copies))
        if cuda_graph and self.device.type == "cuda":
            self.graph = torch.cuda.CUDAGraph()
            sync(self.device)
            with torch.cuda.graph(self.graph):
                self._cycle(len(self.copies))
        sync(self.device)
        self._raise_refused()

    def refresh(self, round_index: int, entropy: int) -> None:
        """New values in every slot, from ``entropy`` (the parent's, sent with this refresh alone: nothing in the
        rank's memory before it determines them), in place where the shapes allow: same objects, addresses and
        version counters, new contents. A cache keyed on any of those now returns stale results, which the parent's
        checks find. The donors keep the values they were made with (what a call's change copies is new to the
        slot's values either way; where the repeat's calls copy it from is the repeat's entropy's). Untimed;
        reference and candidate refresh alike."""
        self.round = round_index
        for slot, seed in enumerate(self.seeds[:len(self.copies)]):
            fresh = self.make_inputs(instance_seeds(seed, round_index, entropy, 0))
            if _same_layout(self.copies[slot], fresh):
                _copy_into(self.copies[slot], fresh)  # the donor's target is the same storage, with new values
            else:
                self.copies[slot] = fresh
                self.donors[slot] = donor_pair(fresh, self.make_inputs(instance_seeds(seed, -1, 0, 1)))
        sync(self.device)

    def repeat(self, num_calls: int, entropy: int) -> dict:
        """One timed repeat: aligned start, ``num_calls`` calls back to back (the parent's count; call k on slot k,
        its inputs changed from the slot's donor just before it: ``apply_change`` with the repeat's ``entropy``),
        device-wide synchronize. Every output is checked as it returns (``refusal``: a few type checks per call, paid
        alike by both groups); one that is not plain data raises OutputRefused once every rank has made all its
        calls."""
        slots, modes, refused = len(self.copies), self.modes, None
        profile, trace = self.hooks[0], self.hooks[1]
        # each call's change, as views ready to copy (worked out before the clock starts: one copy per call is timed)
        changes = [change_views(self.donors[call % slots], entropy, call) if self.graph is None else None
                   for call in range(num_calls)]
        aligned_start(self.device)
        if self.device.type == "cuda":
            start, end = _Event(enable_timing=True), _Event(enable_timing=True)
            start.record()
        with self.window():
            began = _perf_counter()
            if self.graph is not None:
                self.graph.replay()
            else:
                for call in range(num_calls):
                    change = changes[call]
                    if change is not None:
                        change[0].copy_(change[1])
                    output = self.fn(*self.copies[call % slots])
                    self.last_outputs[call % slots] = output
                    if type(output) is not _Tensor or (_function_modes(), _dispatch_modes()) != modes:
                        refused = refused or _described(refusal(output, modes), f"timed call {call}")
                    if _getprofile() is not profile or _gettrace() is not trace:  # two C calls: a hook set now
                        refused = refused or HOOK_SET + f" (timed call {call})"  # would watch the seal's draws
            if self.device.type == "cuda":
                end.record()
            sync(self.device)
        wall = (_perf_counter() - began) / max(num_calls, 1)
        if refused:
            raise OutputRefused(refused)
        if _hooks() != self.hooks:  # a monitoring tool, or a hook another thread set for this one
            raise OutputRefused(HOOK_SET)
        self.sealed = _seal(self.last_outputs, self.device)
        event = start.elapsed_time(end) / 1e3 / max(num_calls, 1) if self.device.type == "cuda" else None
        return {"wall_s": wall, "event_s": event}

    def _unchanged_since_the_repeat(self) -> None:
        """OutputRefused where an output sealed at the end of the repeat has changed since, or a Python profile, trace
        or monitoring hook has been set since the loop began: the call's work was done after the parent's clock had
        stopped (a red-team of issue 56 ran every timed all-reduce at once from a profile hook the harness's check
        set off, within the check's allowance: 7.7x an honest file's speedup)."""
        if _hooks() != self.hooks:
            raise OutputRefused(HOOK_SET)
        changed = _changed(self.sealed, self.last_outputs)
        if changed is not None:
            raise OutputRefused(f"the output of input copy {changed} changed after its timed repeat had ended: its "
                                "work was done after the parent's clock had stopped")

    def check(self, seed: int, num_projections: int) -> list:
        """Per slot, the summaries of its last output (``summarise``) under projections drawn from ``seed``, with
        torch functions' overrides off (no candidate code runs in them)."""
        sync(self.device)
        self._unchanged_since_the_repeat()
        if _dispatch_modes() != self.modes[1]:
            raise OutputRefused("a torch dispatch mode was active when the outputs were checked")
        with _no_torch_function():
            return [summarise(output, seed + 7919 * slot, num_projections)
                    for slot, output in enumerate(self.last_outputs)]

    def outputs_of(self, slots: list[int]) -> list:
        """The last outputs of ``slots`` (the parent's choice, after the repeat), for the parent to judge in full."""
        sync(self.device)
        self._unchanged_since_the_repeat()
        return [self.last_outputs[slot] for slot in slots]

    def finish(self, timeout_s: float = 60.0) -> dict:
        """Synchronize, and wait for threads the candidate started while they work: their work counts too. Threads
        that together use no CPU for IDLE_CHECK_S are blocked (a helper waiting on a queue for jobs that never come):
        waiting for them would charge an honest candidate the whole ``timeout_s`` (a red-team of issue 56 found one
        ``tampered`` so); work they queued on the device is still waited for."""
        sync(self.device)
        deadline, leftover = _perf_counter() + timeout_s, []
        while _perf_counter() < deadline:
            leftover = [t for t in threading.enumerate() if t not in self.threads_before and t.is_alive()]
            if not leftover:
                break
            before = [_cpu_seconds(thread) for thread in leftover]
            _sleep(min(IDLE_CHECK_S, max(0.0, deadline - _perf_counter())))
            after = [_cpu_seconds(thread) for thread in leftover]
            if all(now is not None and now == then for now, then in zip(after, before)):
                break  # none of them used the CPU (one that waits for the interpreter while others work does not
                # either: hence all of them together; a red-team's threads, each its 20 ms, looked blocked one by one)
        sync(self.device)
        return {"threads_left_running": sum(thread.is_alive() for thread in leftover)}

    def outputs(self) -> list:
        """The last output of every slot: the last repeat's calls, each on its slot's values of that round."""
        sync(self.device)
        return list(self.last_outputs)


def _hooks() -> tuple:
    """Python's profile and trace hooks of this thread, and sys.monitoring's tools (3.12 on): each registered one's
    name, the events it watches everywhere, and those it watches in the harness's own code (the seal's and the
    loop's: a tool registered before the loop could turn on events there later)."""
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None:
        return _getprofile(), _gettrace(), ()
    tools = tuple((tool, monitoring.get_tool(tool), monitoring.get_events(tool),
                   tuple(monitoring.get_local_events(tool, code) for code in _HARNESS_CODE))
                  for tool in range(6) if monitoring.get_tool(tool) is not None)
    return _getprofile(), _gettrace(), tools


def _random_below(bound: int, count: int) -> list[int]:
    """``count`` numbers in [0, bound), from the system's randomness (nothing in the process determines them)."""
    raw = _urandom(8 * count)
    return [int.from_bytes(raw[8 * i:8 * i + 8], "little") % bound for i in range(count)]


def _seal(outputs: list, device: torch.device) -> list:
    """A seal of the outputs a repeat has just computed: for SEALED_SLOTS slots, and SEALED_VALUES places of each
    tensor of their outputs, drawn now from the system's randomness (after the last call has returned: no call can
    know them), the values there. Work on an output done after this (a hook, a thread, a stream the candidate left
    running past the synchronize) changes what ``_changed`` finds at a place a call could not know."""
    keys = _random_below(2**62, len(outputs))
    slots = sorted(sorted(range(len(outputs)), key=keys.__getitem__)[:SEALED_SLOTS])  # without repeats
    sealed = []
    for slot in slots:
        for path, tensor in enumerate(_tensors(outputs[slot])):
            if (tensor.numel() == 0 or tensor.layout is not torch.strided or tensor.is_quantized
                    or tensor.device.type == "meta"):  # none the loop times as it should (quantized: indexing crashes)
                continue
            places = tuple(torch.tensor(_random_below(size, SEALED_VALUES), device=tensor.device)
                           for size in tensor.shape)
            try:
                sealed.append((slot, path, places, _values_at(tensor, places)))
            except (RuntimeError, TypeError, NotImplementedError):  # a layout or dtype torch cannot index: unsealed
                continue
    sync(device)
    return sealed


def _values_at(tensor: torch.Tensor, places: tuple) -> torch.Tensor:
    """The values of ``tensor`` at ``places`` (one index tensor per dimension; none for a 0-d tensor), as raw bytes."""
    with _no_torch_function():
        values = (tensor.detach()[places] if places else tensor.detach().reshape(1)).contiguous()
        return values.view(torch.uint8).clone() if values.dtype != torch.bool else values.clone()


def _changed(sealed: list, outputs: list) -> int | None:
    """The first slot of ``sealed`` (``_seal``'s) whose output (in ``outputs``) no longer holds the sealed values."""
    for slot, path, places, values in sealed:
        tensors = _tensors(outputs[slot])
        try:
            if path >= len(tensors) or not torch.equal(_values_at(tensors[path], places), values):
                return slot
        except (RuntimeError, TypeError, NotImplementedError):  # indexed at the seal, not now: it is not the same
            return slot
    return None


def _cpu_seconds(thread: threading.Thread) -> float | None:
    """The CPU time ``thread`` has used (None where the system cannot say, or it has ended)."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, TypeError, AttributeError, OverflowError):
        return None


def _described(found: str | None, call: str) -> str | None:
    if found is None:
        return None
    return (f"{call} returned an output that is not plain data: {found}. Outputs must be plain torch.Tensor (or "
            "nn.Parameter), numbers, strings, and lists, tuples and dicts of them when the call returns: a tensor "
            "subclass or a mode left active can do the call's work after the parent's clock has stopped")


def summarise(value: Any, seed: int, num_projections: int) -> list:
    """A short summary of every value in ``value`` (an output), flattened in order, from which the parent tells
    whether two outputs are the same computation on the same inputs without moving them: for a floating tensor
    ``[norm, nonfinite, p_1 .. p_P]`` (the norm of its finite values, how many are not finite, and ``p_j = sum_i
    v_ji x_i`` with each ``v_ji`` a random sign drawn from ``seed``, in fp64); for an integer or bool tensor the
    projections in exact int64 arithmetic; anything else as itself (or its type's name)."""
    leaves: list = []
    _summaries(value, seed, num_projections, leaves)
    return leaves


def _summaries(value: Any, seed: int, num_projections: int, leaves: list) -> None:
    if type(value) is _Tensor or type(value) is _Parameter:
        leaves.append(_tensor_summary(value.detach(), seed + 104729 * len(leaves), num_projections))
    elif isinstance(value, torch.Tensor):  # a subclass: never asked for its values (refused where it was returned)
        leaves.append(f"<{type(value).__qualname__}>")
    elif type(value) is list or _plain_tuple(type(value)):
        for item in value:
            _summaries(item, seed, num_projections, leaves)
    elif type(value) is dict:
        for key in sorted(value, key=str):
            _summaries(value[key], seed, num_projections, leaves)
    elif type(value) in (type(None), bool, int, float, str):
        leaves.append(value)
    elif type(value) in (complex, torch.dtype, torch.device):
        leaves.append(str(value))
    else:
        leaves.append(f"<{type(value).__qualname__}>")


def _tensor_summary(tensor: torch.Tensor, seed: int, num_projections: int) -> list:
    if tensor.device.type == "meta":
        return ["meta", list(tensor.shape)]
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor.resolve_conj())
    flat = tensor.reshape(-1)
    generator = torch.Generator(device=flat.device)
    if flat.is_floating_point():
        values = flat.to(torch.float64)
        finite = torch.isfinite(values)
        values = torch.where(finite, values, 0.0)
        summary = [float(values.square().sum().sqrt()), int((~finite).sum())]
        for j in range(num_projections):
            generator.manual_seed(seed + j)
            signs = torch.randint(0, 2, flat.shape, generator=generator, device=flat.device).to(torch.float64) * 2 - 1
            summary.append(float((signs * values).sum()))
        return summary
    try:
        values = flat.to(torch.int64)
    except (RuntimeError, TypeError):  # a dtype without arithmetic (bits, quantized): its bytes
        values = flat.contiguous().view(torch.uint8).to(torch.int64)
    summary = ["int", int(values.numel())]
    for j in range(num_projections):
        generator.manual_seed(seed + j)
        signs = torch.randint(0, 2, flat.shape, generator=generator, device=flat.device) * 2 - 1
        summary.append(int((signs * values).sum()))
    return summary


# The code objects of the seal and the loop, whose sys.monitoring events ``_hooks`` reads (bound at import: nothing of
# the candidate's has run).
_HARNESS_CODE = tuple(function.__code__ for function in (
    _seal, _changed, _random_below, _values_at, _hooks, TimedLoop.repeat, TimedLoop.check, TimedLoop.outputs_of,
    TimedLoop._unchanged_since_the_repeat))
