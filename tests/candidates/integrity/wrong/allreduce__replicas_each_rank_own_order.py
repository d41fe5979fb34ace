"""WRONG: each rank sums the all-gathered buffers in its own order (starting from itself), in bf16.

Every rank's answer is as accurate as a ring's, but the ranks' copies of a replicated output differ in many
elements: NCCL gives every rank the same bits. Expected: caught by the replica agreement check.
"""
import torch
import torch.distributed as dist


def solution(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous())
    out = parts[rank].clone()
    for k in range(1, world):
        out = out + parts[(rank + k) % world]
    return out
