"""A large symmetric-memory workspace (4 GiB per rank, as fused kernels allocate): side by side on one
GPU, evaluations once ran it out of memory in ``symm_mem.empty`` and blamed the candidate. Each rank
stages its share in the workspace and reads every peer's from there."""

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

REQUIRES = ("cuda",)
EXPECTED = {"cpu": "skipped", "shared-gpu": "ok", "cuda": "ok"}
WORKSPACE_BYTES = 4 << 30
_workspace = {}


def solution(tensor):
    if "buffer" not in _workspace:
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            enable(dist.group.WORLD.group_name)
        buffer = symm_mem.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=tensor.device)
        _workspace.update(buffer=buffer, handle=symm_mem.rendezvous(buffer, dist.group.WORLD))
    handle, world_size = _workspace["handle"], dist.get_world_size()
    share = tensor.contiguous().view(-1).view(torch.uint8)
    _workspace["buffer"][:share.numel()].copy_(share)
    handle.barrier()
    out = tensor.new_empty((world_size,) + tuple(tensor.shape))
    for peer in range(world_size):
        peer_share = handle.get_buffer(peer, (share.numel(),), torch.uint8)
        out[peer].view(-1).view(torch.uint8).copy_(peer_share)
    handle.barrier()
    return out
