"""Candidate sources that tests in both tiers write to files: an honest all-reduce, an all-gather with a tail."""

HONEST_ALLREDUCE = """
REQUIRES = ()
import torch
import torch.distributed as dist

def solution(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    return out
"""

ALLGATHER = """
import torch
import torch.distributed as dist


def solution(tensor):
    out = tensor.new_empty((dist.get_world_size(),) + tensor.shape)
    dist.all_gather_into_tensor(out, tensor)
    return out{tail}
"""
