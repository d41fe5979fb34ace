import torch
import torch.distributed as dist


def solution(A_local, B_local):
    partial = A_local.float() @ B_local.float()
    dist.all_reduce(partial)
    return partial.to(A_local.dtype)
