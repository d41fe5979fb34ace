"""Honest: tensor-parallel RMSNorm with the row statistics accumulated and all-reduced in fp64 (more precise than
the reference's fp32), the scale applied in fp32 and rounded to the input dtype, times the weight, as the
reference. Only the statistics are more accurate."""

import torch
import torch.distributed as dist


def solution(local_hidden_states, local_weight, variance_epsilon):
    world_size = dist.get_world_size()
    x64 = local_hidden_states.double()
    sum_squares = (x64 * x64).sum(-1, keepdim=True)
    dist.all_reduce(sum_squares)
    inv = torch.rsqrt(sum_squares / (x64.shape[-1] * world_size) + variance_epsilon).float()
    normed = (local_hidden_states.float() * inv).to(local_hidden_states.dtype)
    return local_weight * normed
