"""WRONG: a threshold compressor: every rank drops its entries with |v| < 0.02 before the reduction.

About 1.6 % of each rank's entries are lost (set to 0) before an honest all-reduce. The errors are small
in absolute terms (each below 0.02), and the rule's honest scale for an all-reduce's element is its sensitivity
(u * sqrt(sum v^2), about 0.008 at W = 4 in bf16) regardless of how small the lost contribution is.
"""
import torch
import torch.distributed as dist


def solution(tensor):
    out = torch.where(tensor.abs() < 0.02, torch.zeros_like(tensor), tensor)
    dist.all_reduce(out)
    return out
