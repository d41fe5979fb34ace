"""Honest: reduce-scatter with NCCL (sum in the input dtype, as the reference), divide by W, then RMSNorm whose row
statistic (mean of squares) and rsqrt are computed in fp64 -- more precise than the reference's fp32 -- then applied
in fp32 as the reference does (y * inv * gamma) and rounded once."""

import torch
import torch.distributed as dist


def solution(rs_input_1d, gamma, eps):
    world_size = dist.get_world_size()
    hidden = gamma.numel()
    summed = torch.empty(rs_input_1d.numel() // world_size, dtype=rs_input_1d.dtype, device=rs_input_1d.device)
    dist.reduce_scatter_tensor(summed, rs_input_1d, op=dist.ReduceOp.SUM)
    y = (summed / world_size).view(-1, hidden).float()
    y64 = y.double()
    inv = torch.rsqrt(y64.pow(2).mean(-1, keepdim=True) + eps).float()
    out = y * inv * gamma.float()
    return out.to(rs_input_1d.dtype)
