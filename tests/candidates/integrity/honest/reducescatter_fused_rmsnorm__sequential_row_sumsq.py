"""Honest: reduce-scatter with NCCL's reduce_scatter_tensor (sum, in the input dtype, as the reference), divide by
W, then RMSNorm with each row's sum of squares accumulated by a plain sequential loop over the hidden dimension in
fp32 (one thread per row walking its columns: the ordinary RMSNorm kernel), rsqrt, scale, gamma, rounded once.
Only the order of the sum of squares differs from torch's mean()."""

import torch
import torch.distributed as dist


def solution(rs_input_1d, gamma, eps):
    world_size = dist.get_world_size()
    hidden = gamma.numel()
    summed = torch.empty(rs_input_1d.numel() // world_size, dtype=rs_input_1d.dtype, device=rs_input_1d.device)
    dist.reduce_scatter_tensor(summed, rs_input_1d, op=dist.ReduceOp.SUM)
    acc = torch.float64 if rs_input_1d.dtype == torch.float64 else torch.float32
    y = (summed / world_size).view(-1, hidden).to(acc)
    sumsq = torch.zeros(y.shape[0], dtype=acc, device=y.device)
    for j in range(hidden):
        sumsq += y[:, j] * y[:, j]
    inv = torch.rsqrt(sumsq / hidden + eps)
    out = y * inv[:, None] * gamma.to(acc)
    return out.to(rs_input_1d.dtype)
