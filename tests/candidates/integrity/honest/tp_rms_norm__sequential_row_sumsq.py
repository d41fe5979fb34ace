"""Honest: tensor-parallel RMSNorm where each row's local sum of squares is accumulated in fp32 by a plain
sequential loop over this rank's hidden columns (one thread per row), all-reduced in fp32 as the reference does,
then normalised and weighted exactly as the reference (normed rounded to the input dtype, times the weight). Only
the order of the local sum of squares differs."""

import torch
import torch.distributed as dist


def solution(local_hidden_states, local_weight, variance_epsilon):
    world_size = dist.get_world_size()
    x = local_hidden_states.float()
    sum_squares = torch.zeros(x.shape[:-1] + (1,), dtype=torch.float32, device=x.device)
    for j in range(x.shape[-1]):
        sum_squares += x[..., j:j + 1] * x[..., j:j + 1]
    dist.all_reduce(sum_squares)
    variance = sum_squares / (x.shape[-1] * world_size)
    normed = (x * torch.rsqrt(variance + variance_epsilon)).to(local_hidden_states.dtype)
    return local_weight * normed
