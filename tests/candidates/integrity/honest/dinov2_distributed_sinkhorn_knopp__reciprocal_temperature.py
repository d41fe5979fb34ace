"""Honest: DINOv2's distributed Sinkhorn-Knopp with the teacher temperature applied as a multiplication by its
reciprocal (scores * (1 / teacher_temp), the usual way a kernel applies a temperature), fp32 throughout as the
reference, the same all-reduces and iterations. 1/teacher_temp is one fp32 rounding of the exact reciprocal."""

import torch
import torch.distributed as dist


def solution(teacher_output, teacher_temp, n_masked_patches_tensor, n_iterations=3, group=None):
    inv_temp = 1.0 / teacher_temp
    Q = torch.exp(teacher_output.float() * inv_temp).t()
    B = n_masked_patches_tensor.clone()
    dist.all_reduce(B, group=group)
    K = Q.shape[0]
    sum_Q = torch.sum(Q)
    dist.all_reduce(sum_Q, group=group)
    Q = Q / sum_Q
    for _ in range(n_iterations):
        sum_of_rows = torch.sum(Q, dim=1, keepdim=True)
        dist.all_reduce(sum_of_rows, group=group)
        Q = Q / sum_of_rows / K
        Q = Q / torch.sum(Q, dim=0, keepdim=True) / B
    Q = Q * B
    return Q.t().contiguous()
