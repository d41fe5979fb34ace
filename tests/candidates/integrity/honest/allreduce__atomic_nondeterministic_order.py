"""Honest (what a GPU atomics kernel does): an all-reduce whose reduce-scatter half accumulates each element's W
contributions in a nondeterministic arrival order (a fresh random order per element and per call, as concurrent
atomicAdds land), in the buffer's dtype, on the rank that owns the chunk; the all-gather half then copies the finished
chunks, so every rank holds the same bits. A second call on the same inputs may round differently: atomics are not
deterministic, and the problem does not promise determinism."""

import time

import torch
import torch.distributed as dist


def solution(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    flat = tensor.reshape(-1)
    n = flat.numel()
    per = -(-n // world)
    padded = torch.zeros(per * world, dtype=tensor.dtype)
    padded[:n] = flat
    received = torch.empty_like(padded)
    dist.all_to_all_single(received, padded)
    parts = received.view(world, per)
    g = torch.Generator().manual_seed(time.perf_counter_ns() ^ (rank << 20))
    order = torch.argsort(torch.rand(world, per, generator=g), dim=0)
    acc = parts.gather(0, order[:1]).squeeze(0).clone()
    for step in range(1, world):
        acc = acc + parts.gather(0, order[step:step + 1]).squeeze(0)
    out = torch.empty(per * world, dtype=tensor.dtype)
    dist.all_gather_into_tensor(out, acc)
    return out[:n].view(tensor.shape)
