"""POLICY route: ``dist.isend`` / ``dist.irecv`` to and from every other rank, waited for, then an fp32 sum in rank
order, rounded once. Expected under ``--policy forbid-collectives``: ``forbidden`` (``dist.isend``, ``dist.irecv``)."""
import torch
import torch.distributed as dist


def solution(tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = tensor.contiguous()
    parts = [mine if peer == rank else torch.empty_like(mine) for peer in range(world)]
    works = [dist.isend(mine, peer) for peer in range(world) if peer != rank]
    works += [dist.irecv(parts[peer], peer) for peer in range(world) if peer != rank]
    for work in works:
        work.wait()
    return torch.stack(parts).float().sum(0).to(tensor.dtype)
