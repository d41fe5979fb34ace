"""An honest all-to-all written with dist.P2POp + dist.batch_isend_irecv (as ring attention does)."""
import torch
import torch.distributed as dist


def solution(tensor):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = torch.empty_like(tensor)
    out[rank].copy_(tensor[rank])
    ops = []
    for peer in range(world_size):
        if peer != rank:
            ops.append(dist.P2POp(dist.isend, tensor[peer].contiguous(), peer))
            ops.append(dist.P2POp(dist.irecv, out[peer], peer))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out
