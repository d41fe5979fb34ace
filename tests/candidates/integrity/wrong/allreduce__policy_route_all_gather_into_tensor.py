"""POLICY route: ``dist.all_gather_into_tensor`` of every rank's buffer, then an fp32 sum in rank order, rounded
once. Expected under ``--policy forbid-collectives``: ``forbidden`` (``dist.all_gather_into_tensor``)."""
import torch
import torch.distributed as dist


def solution(tensor):
    world = dist.get_world_size()
    gathered = tensor.new_empty((world, *tensor.shape))
    dist.all_gather_into_tensor(gathered, tensor.contiguous())
    return gathered.float().sum(0).to(tensor.dtype)
