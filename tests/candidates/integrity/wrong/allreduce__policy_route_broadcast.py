"""POLICY route: every rank's buffer ``dist.broadcast`` from that rank in turn, then an fp32 sum in rank order,
rounded once. Expected under ``--policy forbid-collectives``: ``forbidden`` (``dist.broadcast``)."""
import torch
import torch.distributed as dist


def solution(tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    parts = []
    for source in range(world):
        part = tensor.contiguous().clone() if source == rank else torch.empty_like(tensor.contiguous())
        dist.broadcast(part, src=source)
        parts.append(part)
    return torch.stack(parts).float().sum(0).to(tensor.dtype)
