"""All-to-all over peer memory: every rank pulls its chunk from every peer's buffer in one CUDA kernel.

Per rank: tensor [W, *shape] (chunk d is for rank d)  ->  [W, *shape], chunk s = rank s's chunk
`rank` (bit-exact). Steps: copy the input into this rank's symmetric buffer; barrier (every peer's
data is in place); the kernel copies chunk `rank` of every rank s's buffer into chunk s of the output,
all W pieces at once (16 bytes per load where the chunk allows; its own chunk is a local copy);
barrier (no rank overwrites its buffer while a peer still reads it). Each rank reads (W-1)/W * S bytes
over NVLink and its peers read as much from it (S: the input's bytes).
"""

import torch
import torch.distributed as dist

from pkb.solutions._cuda_common import staging_buffer
from pkb.solutions._peer_common import copy_from_peers, peer_kernels

REQUIRES = ("cuda",)

peer_kernels()  # built here, at import, not inside a timed call


def solution(tensor):
    world_size, rank = dist.get_world_size(), dist.get_rank()
    numel = tensor.numel()
    chunk = numel // world_size
    buffer = staging_buffer(numel, tensor.dtype)
    buffer.local[:numel].copy_(tensor.reshape(-1))
    buffer.barrier()
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    copy_from_peers(buffer, out, [(s, rank * chunk, s * chunk) for s in range(world_size)], chunk)
    buffer.barrier()
    return out
