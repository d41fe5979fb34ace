"""Honest: all-gather every rank's buffer, then each rank sums them locally in rank order in fp32 and rounds once
to the buffer's dtype (more precise than a reduction in the buffer's dtype). Every rank runs the same arithmetic
on the same data, so every rank holds the same bits."""

import torch
import torch.distributed as dist


def solution(tensor):
    world = dist.get_world_size()
    gathered = torch.empty((world, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_into_tensor(gathered, tensor.contiguous())
    acc = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    total = torch.zeros(tensor.shape, dtype=acc, device=tensor.device)
    for r in range(world):
        total += gathered[r].to(acc)
    return total.to(tensor.dtype)
