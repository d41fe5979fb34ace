"""Honest: the data-parallel gradient reduce-scatter in fp32 as the reference, with the gradient scaling factor
applied once after the sum instead of to every term before it (sum(g) * f instead of sum(g * f): the same value,
fewer roundings; Megatron's DDP offers both, average_in_collective or pre-scaling)."""

import torch
import torch.distributed as dist


def solution(grad_bucket, gradient_scaling_factor, dp_group, intra_dp_group, inter_dp_group):
    dp_size = dist.get_world_size(dp_group)
    accumulate = torch.promote_types(grad_bucket.dtype, torch.float32)
    n = -(-grad_bucket.numel() // dp_size) * dp_size
    padded = grad_bucket.new_zeros(n, dtype=accumulate)
    padded[:grad_bucket.numel()] = grad_bucket
    shard = padded.new_empty(n // dp_size)
    dist.reduce_scatter_tensor(shard, padded, group=dp_group)
    return (shard * gradient_scaling_factor).to(grad_bucket.dtype)
