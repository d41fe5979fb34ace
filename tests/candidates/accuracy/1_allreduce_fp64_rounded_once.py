import torch
import torch.distributed as dist


def solution(tensor):  # the most accurate all-reduce there is: sum in fp64, round once
    out = tensor.double()
    dist.all_reduce(out)
    return out.to(tensor.dtype)
