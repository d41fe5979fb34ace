"""The timing protocol, run inside each rank process (docs/timing.md).

Every tensor input is rotated through fresh random copies (enough that together they exceed 3x the
L2 cache on a GPU), so no iteration sees the previous one's objects or values in cache. After a
barrier and warm-up, ``num_iters`` calls run back to back between two device-wide synchronizes; the
host wall clock (and on a GPU, CUDA events) brackets the whole loop. This repeats ``num_repeats``
times. The parent takes the max over ranks of each repeat and the median over repeats.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.distributed as dist

CPU_CACHE_BYTES = 32 << 20  # what to outgrow on a CPU, where no L2 size is reported per device


def input_bytes(inputs: tuple) -> int:
    return sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))


def cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    return CPU_CACHE_BYTES


def num_copies_for(one_copy_bytes: int, device: torch.device, max_copies: int) -> int:
    """Enough input copies to exceed 3x the cache together, at least 2 and at most ``max_copies``."""
    needed = -(-3 * cache_bytes(device) // max(one_copy_bytes, 1))
    return max(2, min(max_copies, needed))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # device-wide: every stream of this device


def time_calls(fn: Callable, make_inputs: Callable[[tuple], tuple], seeds: list[tuple], device: torch.device,
               num_warmup: int, warmup_s: float, num_repeats: int, min_repeat_s: float, min_iters: int,
               max_iters: int, cuda_graph: bool = False) -> dict:
    """Time ``fn`` over rotating fresh inputs; returns per-repeat seconds per call (wall and events).

    Warm-up runs at least ``num_warmup`` calls and ``warmup_s`` seconds (clocks settle under load),
    then each repeat runs enough calls to last ``min_repeat_s``. Both counts come from the slowest
    rank's estimate, so every rank makes the same number of (collective) calls.

    ``cuda_graph``: capture one repeat's calls in a CUDA graph and time its replays, which removes
    launch overhead for microsecond-scale problems (the calls must be capturable: no host syncs).
    """
    first = make_inputs(seeds[0])
    copies = [first] + [make_inputs(seed) for seed in seeds[1:num_copies_for(input_bytes(first), device, len(seeds))]]
    calls = 0

    def call_next(count: int) -> None:
        nonlocal calls
        for _ in range(count):
            fn(*copies[calls % len(copies)])
            calls += 1

    _aligned_start(device)
    began = time.perf_counter()
    call_next(max(num_warmup, 1))
    _sync(device)
    per_call = _slowest(device, (time.perf_counter() - began) / max(num_warmup, 1))
    call_next(max(0, math.ceil(warmup_s / per_call) - num_warmup))
    num_iters = int(min(max_iters, max(min_iters, math.ceil(min_repeat_s / per_call))))
    run_repeat = lambda: call_next(num_iters)  # noqa: E731
    if cuda_graph and device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        _sync(device)
        with torch.cuda.graph(graph):
            call_next(num_iters)
        run_repeat = graph.replay
    wall, events = [], []
    for _ in range(num_repeats):
        _aligned_start(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        run_repeat()
        if device.type == "cuda":
            end.record()
        _sync(device)
        wall.append((time.perf_counter() - began) / num_iters)
        if device.type == "cuda":
            events.append(start.elapsed_time(end) / 1e3 / num_iters)
    return {"wall_s": wall, "event_s": events, "num_copies": len(copies), "num_iters": num_iters,
            "num_warmup": num_warmup, "cuda_graph": bool(cuda_graph and device.type == "cuda")}


def _aligned_start(device: torch.device) -> None:
    """Every rank's host leaves here together: finish local work, then a barrier that completes on the device."""
    _sync(device)
    dist.barrier()
    _sync(device)


def _slowest(device: torch.device, seconds: float) -> float:
    """The largest of every rank's ``seconds`` (at least a nanosecond)."""
    on = device if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([max(seconds, 1e-9)], dtype=torch.float64, device=on)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)
