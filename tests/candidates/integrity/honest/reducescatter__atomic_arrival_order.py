"""Honest: a reduce-scatter as an atomic-add kernel does it: every rank's chunk for this rank arrives (here by an
all-to-all), and each output element accumulates the W contributions in its own arrival order (a different random
rank order per element, as concurrent atomicAdds land), in the buffer's dtype. Any order per element is an honest
order; the result is this rank's own (no replica to agree with)."""

import torch
import torch.distributed as dist


def solution(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    chunks = torch.stack(torch.tensor_split(tensor.contiguous(), world, dim=0)).contiguous()
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks)
    flat = received.reshape(world, -1)
    n = flat.shape[1]
    g = torch.Generator().manual_seed(1234 + rank)
    order = torch.argsort(torch.rand(world, n, generator=g), dim=0)  # per element, an arrival order of the ranks
    acc = torch.zeros(n, dtype=tensor.dtype)
    for step in range(world):
        acc = acc + flat.gather(0, order[step:step + 1]).squeeze(0)
    return acc.view(received.shape[1:])
