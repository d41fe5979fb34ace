"""The timing protocol (docs/timing.md): the rank side, driven by the parent one phase at a time.

``TimedLoop`` lives in each rank process. The parent sends ``prepare`` (fresh input copies, warm-up,
the number of calls per repeat), then ``repeat`` several times (an aligned start and ``num_iters``
calls back to back between device-wide synchronizes), then ``finish`` (synchronize and join any
thread the candidate left running), then ``outputs`` (the last output computed on each input copy).

The parent times every ``repeat`` and ``finish`` with its own clock, from sending the job until the
last rank replies: that clock is the one the verdict uses, since no code in a rank process can
change it. The rank's own wall clock and CUDA events are reported beside it as a cross-check.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

CPU_CACHE_BYTES = 32 << 20  # what to outgrow on a CPU, where no L2 size is reported per device

# The harness's own clocks and synchronisation, bound before any candidate code is imported, so a
# candidate that patches the modules' attributes does not change what the harness calls.
_perf_counter = time.perf_counter
_cuda_synchronize = torch.cuda.synchronize
_barrier = dist.barrier
_all_reduce = dist.all_reduce
_Event = torch.cuda.Event


def input_bytes(inputs) -> int:
    """Bytes of every tensor in ``inputs``, however deeply nested in lists, tuples and dicts."""
    if isinstance(inputs, torch.Tensor):
        return inputs.numel() * inputs.element_size()
    if isinstance(inputs, (list, tuple)):
        return sum(input_bytes(x) for x in inputs)
    if isinstance(inputs, dict):
        return sum(input_bytes(x) for x in inputs.values())
    return 0


def cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    return CPU_CACHE_BYTES


def num_copies_for(one_copy_bytes: int, device: torch.device, max_copies: int) -> int:
    """Enough input copies to exceed 3x the cache together, at least 2 and at most ``max_copies``."""
    needed = -(-3 * cache_bytes(device) // max(one_copy_bytes, 1))
    return max(2, min(max_copies, needed))


def _round_seed(seed: tuple, round_index: int) -> tuple:
    """The seeds of a copy's values in refresh round ``round_index`` (round 0: the copy's own seeds)."""
    return tuple(part ^ (0x9E3779B97F4A7C15 * round_index & (2**63 - 1)) for part in seed)


def _same_layout(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous() == b.is_contiguous()
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_layout(x, y) for x, y in zip(a, b))
    return a == b if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) else False


def _copy_into(old, fresh) -> None:
    if isinstance(old, torch.Tensor):
        old.data.copy_(fresh)  # through .data: the tensor's version counter does not move
    elif isinstance(old, (list, tuple)):
        for x, y in zip(old, fresh):
            _copy_into(x, y)


def _equal_values(a, b) -> bool:
    """Whether two input sets hold the same values (NaNs count as different: the caller then only redoes work)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, torch.nn.Module) and isinstance(b, torch.nn.Module):
        return _equal_values(list(a.state_dict().values()), list(b.state_dict().values()))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal_values(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal_values(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # objects without a value comparison: assume changed, redo
        return False


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
    """One case's timing in one rank process: ``fn`` called over rotating fresh input copies."""

    def __init__(self, fn: Callable, make_inputs: Callable[[tuple], tuple], seeds: list[tuple], device: torch.device):
        first = make_inputs(seeds[0])
        # Every rank keeps the same number of copies: warm-up makes one call per copy, and the calls
        # are collective. Ranks' inputs can differ in size (a scatter's root holds W buffers), and
        # differing counts left the ranks waiting on each other (seen on two H200s: scatter, 16 MiB).
        count = int(largest_over_ranks(device, num_copies_for(input_bytes(first), device, len(seeds))))
        self.seeds = seeds[:count]
        self.make_inputs = make_inputs
        self.copies = [first] + [make_inputs(seed) for seed in self.seeds[1:]]
        self.fn = fn
        self.device = device
        self.calls = 0
        self.num_iters = 0
        self.last_outputs: dict[int, Any] = {}
        self.round = 0  # how many times the copies have been refreshed
        self.output_round: dict[int, int] = {}  # the round whose values each last output was computed on
        self.graph = None
        self.threads_before = set(threading.enumerate())

    def call_next(self, count: int) -> None:
        for _ in range(count):
            index = self.calls % len(self.copies)
            self.last_outputs[index] = self.fn(*self.copies[index])
            self.output_round[index] = self.round
            self.calls += 1

    def prepare(self, num_warmup: int, warmup_s: float, min_repeat_s: float, min_iters: int, max_iters: int,
                cuda_graph: bool = False, **_) -> dict:
        """Warm up (at least ``num_warmup`` calls, one per input copy, and ``warmup_s`` seconds) and pick
        calls per repeat from the slowest rank's estimate, so every rank makes the same number of
        (collective) calls. Every copy gets an output here, which the parent checks after timing.

        The estimate comes from a second batch of calls: the first pays one-off costs (lazy CUDA
        module loading, cuBLAS heuristics, allocator growth), and an estimate that counted them was
        up to 10x too slow, which cut the warm-up short (seen on an H200: the first GEMM measurement
        of a fresh rank 5 % slower, before its clocks had risen) and made repeats too short."""
        aligned_start(self.device)
        num_warmup = max(num_warmup, len(self.copies))
        self.call_next(num_warmup)
        sync(self.device)
        began = _perf_counter()
        self.call_next(num_warmup)
        sync(self.device)
        per_call = largest_over_ranks(self.device, (_perf_counter() - began) / num_warmup)
        self.call_next(max(0, math.ceil(warmup_s / per_call) - 2 * num_warmup))
        self.num_iters = int(min(max_iters, max(min_iters, math.ceil(min_repeat_s / per_call))))
        if cuda_graph and self.device.type == "cuda":
            self.graph = torch.cuda.CUDAGraph()
            sync(self.device)
            with torch.cuda.graph(self.graph):
                self.call_next(self.num_iters)
        # Finish the warm-up here: otherwise its queued work (warmup_s of it) lands in the first repeat,
        # whose parent-clock time then counts it (seen on an H200: +40-70 % on the mean of the repeats).
        sync(self.device)
        return {"num_iters": self.num_iters, "num_copies": len(self.copies), "per_call_s": per_call,
                "cuda_graph": self.graph is not None}

    def refresh(self, round_index: int) -> None:
        """New values in every input copy, in place where the shapes allow: same objects, addresses
        and version counters, new contents. A cache keyed on any of those now returns stale results,
        which the parent's check of the timed outputs catches. Untimed; reference and candidate
        refresh alike."""
        self.round = round_index
        for index, seed in enumerate(self.seeds):
            fresh = self.make_inputs(_round_seed(seed, round_index))
            old = self.copies[index]
            if _same_layout(old, fresh):
                _copy_into(old, fresh)
            else:
                self.copies[index] = fresh
        sync(self.device)

    def repeat(self) -> dict:
        """One timed repeat: aligned start, ``num_iters`` calls back to back, device-wide synchronize."""
        aligned_start(self.device)
        if self.device.type == "cuda":
            start, end = _Event(enable_timing=True), _Event(enable_timing=True)
            start.record()
        began = _perf_counter()
        if self.graph is not None:
            self.graph.replay()
        else:
            self.call_next(self.num_iters)
        if self.device.type == "cuda":
            end.record()
        sync(self.device)
        wall = (_perf_counter() - began) / self.num_iters
        event = start.elapsed_time(end) / 1e3 / self.num_iters if self.device.type == "cuda" else None
        return {"wall_s": wall, "event_s": event}

    def finish(self, timeout_s: float = 60.0) -> dict:
        """Synchronize, and wait for threads the candidate started: their work counts too."""
        sync(self.device)
        leftover = [t for t in threading.enumerate() if t not in self.threads_before and t.is_alive()]
        deadline = _perf_counter() + timeout_s
        for thread in leftover:
            thread.join(timeout=max(0.0, deadline - _perf_counter()))
        sync(self.device)
        return {"threads_left_running": len(leftover)}

    def outputs(self) -> list:
        """The last output on each copy's current values. Copies the last repeat did not reach are
        called once more here (untimed; every rank makes the same calls), so reference and candidate
        outputs line up whatever their number of calls per repeat.

        A function that changes its inputs in place (an optimizer step, an in-place all-reduce) made
        each copy's last output depend on how often that copy was called, which differs between
        groups: such copies get back the values this round started from and are called once more."""
        for index, seed in enumerate(self.seeds):
            start = self.make_inputs(_round_seed(seed, self.round))
            if not _equal_values(self.copies[index], start):
                if _same_layout(self.copies[index], start):
                    _copy_into(self.copies[index], start)
                else:
                    self.copies[index] = start
                self.output_round.pop(index, None)
        for index in range(len(self.copies)):
            if self.output_round.get(index) != self.round:
                self.last_outputs[index] = self.fn(*self.copies[index])
                self.output_round[index] = self.round
        sync(self.device)
        return [self.last_outputs[index] for index in range(len(self.copies))]
