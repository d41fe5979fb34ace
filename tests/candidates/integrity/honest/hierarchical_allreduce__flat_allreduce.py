"""Honest: ignore the hierarchy and all-reduce over the whole world in one call (what NCCL does by default across
nodes with its own ring/tree): exactly the same sum, another order, every rank the same bits."""

import torch.distributed as dist


def solution(tensor, intra_group, inter_group):
    out = tensor.clone()
    dist.all_reduce(out)
    return out
