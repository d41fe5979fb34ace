"""POLICY route: ``dist.all_to_all_single`` of W copies of the buffer (chunk d for rank d): each rank receives every
rank's buffer, then an fp32 sum in rank order, rounded once. Expected under ``--policy forbid-collectives``:
``forbidden`` (``dist.all_to_all_single``)."""
import torch
import torch.distributed as dist


def solution(tensor):
    world = dist.get_world_size()
    flat = tensor.contiguous().reshape(1, -1)
    received = torch.empty((world, flat.shape[1]), dtype=tensor.dtype)
    dist.all_to_all_single(received, flat.expand(world, -1).contiguous())
    return received.float().sum(0).to(tensor.dtype).view_as(tensor)
