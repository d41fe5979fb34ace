"""POLICY route: blocking ``dist.send`` / ``dist.recv`` between every pair of ranks (lower rank sends first), then
an fp32 sum in rank order, rounded once. Expected under ``--policy forbid-collectives``: ``forbidden``
(``dist.send``, ``dist.recv``)."""
import torch
import torch.distributed as dist


def solution(tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = tensor.contiguous()
    parts = [None] * world
    parts[rank] = mine
    for peer in range(world):
        if peer == rank:
            continue
        theirs = torch.empty_like(mine)
        if rank < peer:
            dist.send(mine, peer)
            dist.recv(theirs, peer)
        else:
            dist.recv(theirs, peer)
            dist.send(mine, peer)
        parts[peer] = theirs
    return torch.stack(parts).float().sum(0).to(tensor.dtype)
