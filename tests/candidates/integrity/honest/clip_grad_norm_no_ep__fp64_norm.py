"""Honest: the global gradient norm accumulated in fp64 (more precise than the reference's fp32 vector_norm),
all-reduced in fp64, then the clip coefficient max_norm / total_norm taken in fp32 as the reference does and applied
in place with one rounding to the gradient dtype. Only the norm is more accurate than the reference's."""

import torch
import torch.distributed as dist


def solution(grad_tensors, max_norm, norm_type=2.0, fsdp_group=None):
    p = float(norm_type)
    device = grad_tensors[0].device if grad_tensors else torch.device("cpu")
    term = torch.zeros((), dtype=torch.float64, device=device)
    for g in grad_tensors:
        term = term + g.detach().double().abs().pow(p).sum()
    if fsdp_group is not None:
        dist.all_reduce(term, group=fsdp_group)
    total_norm = (term ** (1.0 / p)).float()
    if total_norm > max_norm:
        coef = max_norm / total_norm
        for g in grad_tensors:
            g.mul_(coef)
    return total_norm
