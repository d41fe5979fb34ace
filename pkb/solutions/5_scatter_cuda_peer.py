"""Scatter over peer memory: rank r reads slice r of the root's buffer in one CUDA kernel.

Per rank: on src, tensor [W, *shape]; elsewhere, tensor [*shape] (a receive buffer, not read)  ->
[*shape] = slice `rank` of the root's tensor (bit-exact). Steps: the root copies its W slices into
its symmetric buffer; barrier (the root's data is in place); every rank's kernel copies its slice of
the root's buffer into its output (16 bytes per load where the slice allows; the root's own slice is
a local copy); barrier (the root does not overwrite its buffer while a peer still reads it). Each
non-root rank reads S bytes (one slice) over NVLink; the root sends (W-1) * S.
"""

import torch
import torch.distributed as dist

from pkb.solutions._cuda_common import staging_buffer
from pkb.solutions._peer_common import copy_from_peers, peer_kernels

REQUIRES = ("cuda",)

peer_kernels()  # built here, at import, not inside a timed call


def solution(tensor, src=0):
    world_size, rank = dist.get_world_size(), dist.get_rank()
    slice_shape = tensor.shape[1:] if rank == src else tensor.shape
    slice_numel = tensor.numel() // world_size if rank == src else tensor.numel()
    buffer = staging_buffer(world_size * slice_numel, tensor.dtype)  # the same size on every rank
    if rank == src:
        buffer.local[:tensor.numel()].copy_(tensor.reshape(-1))
    buffer.barrier()
    out = torch.empty(slice_shape, dtype=tensor.dtype, device=tensor.device)
    copy_from_peers(buffer, out, [(src, rank * slice_numel, 0)], slice_numel)
    buffer.barrier()
    return out
