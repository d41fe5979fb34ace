"""Reduce (sum) to a root in one shot over peer memory: the root reads every peer's buffer in a CUDA kernel.

Per rank: tensor [*shape], dst  ->  on dst: [*shape] = the sum over ranks, accumulated in fp32 in
rank order and rounded once (within the problem's tolerance for any summation order); on every
other rank: a copy of its own tensor. Steps: every rank copies its tensor into its symmetric buffer;
barrier (every rank's data is in place); the root's kernel sums the W buffers through a device array
of their addresses (16 bytes per load), the other ranks copy their tensor; barrier (no rank
overwrites its buffer while the root still reads it). The root reads (W-1) * S bytes over NVLink, each
other rank sends S: a one-shot algorithm, best for small and medium messages.
"""

import torch
import torch.distributed as dist

from pkb.solutions._cuda_common import staging_buffer
from pkb.solutions._peer_common import peer_kernels, sum_from_peers

REQUIRES = ("cuda",)

peer_kernels()  # built here, at import, not inside a timed call


def solution(tensor, dst=0):
    numel = tensor.numel()
    buffer = staging_buffer(numel, tensor.dtype)
    buffer.local[:numel].copy_(tensor.reshape(-1))
    buffer.barrier()
    if dist.get_rank() == dst:
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        sum_from_peers(buffer, out)
    else:
        out = tensor.clone(memory_format=torch.contiguous_format)
    buffer.barrier()
    return out
